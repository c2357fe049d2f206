"""Issue 32, item 1: a client maps only shared-memory objects it can name for its own token.

Before, token B could register the key token A registered (or any object of the server's user)
and read A's tensor through Silu or overwrite it through Sample's output regions; the errors
told whether a key existed. Now, under ``--shm-key-scope token`` (the default with tokens), a
key must start with the caller's prefix, decided before anything is opened.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from logitserve.client import Client, LogitServeError
from logitserve.client import regions as client_regions
from logitserve.client.keys import key_prefix, scoped_key
from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from logitserve.server.process import ServerProcess
from logitserve.server.regions import key_prefix as server_key_prefix
from logitserve.server.regions import owner_of

TOKENS = ("alice-token-0123456789", "bob-token-9876543210")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "tokens"
    path.write_text("\n".join(TOKENS) + "\n")
    with ServerProcess("--auth-token-file", str(path), "--warmup-dtypes", "none", "--max-regions", "16") as s:
        yield s


@pytest.fixture
def alice_logits(server):
    """Alice's object (named for her token) holding a tensor, registered as her region."""
    alice_token = TOKENS[0]
    buf = client_regions.shared_copy(np.arange(8, dtype=np.float32).reshape(2, 4) - 3.0,
                                     key=scoped_key(alice_token))
    with Client(server.target, token=alice_token, timeout=60) as alice:
        alice.register("secret", buf)
        yield buf
    buf.close()
    buf.unlink()


def test_client_prefix_is_the_servers():
    for token in TOKENS + ("x", " padded "):
        assert key_prefix(token) == server_key_prefix(owner_of(f"Bearer {token}"))
    assert key_prefix(TOKENS[0]) != key_prefix(TOKENS[1])


def _refusal(call) -> LogitServeError:
    with pytest.raises(LogitServeError) as err:
        call()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value


def test_another_tokens_key_is_refused_and_says_nothing_of_it(server, alice_logits):
    bob_token = TOKENS[1]
    stranger = client_regions.shared_array((64,), "uint8")  # an object of the server's user, no prefix
    try:
        with Client(server.target, token=bob_token, timeout=60) as bob:
            taken = _refusal(lambda: bob.register_system("stolen", alice_logits.key, byte_size=alice_logits.byte_size))
            other = _refusal(lambda: bob.register_system("other", stranger.key, byte_size=64))
            missing = _refusal(lambda: bob.register_system("gone", alice_logits.key + "x", byte_size=64))
            # The same words whether the object exists or not, naming bob's prefix and the rule.
            assert taken.details == missing.details
            assert key_prefix(bob_token) in taken.details and "--shm-key-scope token" in taken.details
            assert alice_logits.key not in taken.details
            assert other.details.startswith("key: must start with this token's prefix")
            assert bob.shared_memory_status() == []
            # Bob's own object, named for his token, registers and serves.
            assert bob.key_prefix == key_prefix(bob_token) and bob.shm_key("x") == key_prefix(bob_token) + "x"
            own = client_regions.shared_copy(np.ones((2, 4), np.float32), key=bob.shm_key())
            try:
                bob.register("mine", own)
                np.testing.assert_allclose(bob.softmax(own.array), np.full((2, 4), 0.25), rtol=1e-6)
                bob.unregister("mine")
            finally:
                own.close()
                own.unlink()
    finally:
        stranger.close()
        stranger.unlink()


def test_kserve_registration_is_scoped_alike(server, alice_logits):
    metadata = (("authorization", f"Bearer {TOKENS[1]}"),)
    with grpc.insecure_channel(server.target) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.SystemSharedMemoryRegister(kpb.SystemSharedMemoryRegisterRequest(
                name="stolen", key="/" + alice_logits.key, byte_size=alice_logits.byte_size), metadata=metadata,
                timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert key_prefix(TOKENS[1]) in err.value.details()


def test_any_scope_is_the_operators_choice(tmp_path):
    """``--shm-key-scope any`` with tokens: any key the server's user can open (the old rule)."""
    path = tmp_path / "tokens"
    path.write_text(TOKENS[0] + "\n")
    buf = client_regions.shared_copy(np.zeros((2, 4), np.float32))
    try:
        with ServerProcess("--auth-token-file", str(path), "--warmup-dtypes", "none", "--shm-key-scope", "any") as s, \
                Client(s.target, token=TOKENS[0], timeout=60) as client:
            client.register("plain", buf)
            assert [r.name for r in client.shared_memory_status()] == ["plain"]
            client.unregister("plain")
    finally:
        buf.close()
        buf.unlink()
