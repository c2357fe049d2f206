"""A same-host channel belongs to the token that opened it (--auth-token-file): its calls run as
that caller (its regions and sequences, not another's), a key no open channel has is refused
UNAUTHENTICATED, another token cannot close it, it stops when its token is taken off the file
and reloaded, and OpenChannel itself needs a valid token.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from channel_raw import RawChannel, assert_same, close_channel, open_channel

from logitserve.client import Client, LogitServeError, messages, regions
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from logitserve.v1 import channel_format as fmt

TOKEN_A, TOKEN_B = "tok-channel-a-51f0", "tok-channel-b-9c2e"
UNAUTHENTICATED = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"
X = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
SAMPLE = messages.sample_request(X, seed=3).SerializeToString()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    return path


@pytest.fixture
def server(token_file):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          auth_token_file=str(token_file))
    with ServerThread(config) as s:
        yield s


def _reload(server) -> None:
    async def reload():
        server.service.reload_tokens()
    server.run(reload())


def test_a_key_no_channel_has_is_unauthenticated(server):
    raw = RawChannel(open_channel(server.target, TOKEN_B))
    assert raw.call("Sample", SAMPLE)[0] == grpc.StatusCode.OK
    for key in (b"\x00" * 16, bytes(reversed(raw.key)), raw.key[:15] + bytes([raw.key[15] ^ 1])):
        code, _, details, body = raw.call("Sample", SAMPLE, key=key)
        assert (code, body) == (grpc.StatusCode.UNAUTHENTICATED, b"")
        assert details.startswith(fmt.UNKNOWN_KEY), details
    assert close_channel(server.target, raw.key, TOKEN_B)
    code, _, details, _ = raw.call("Sample", SAMPLE)  # its own key, once closed
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith(fmt.UNKNOWN_KEY)
    assert not close_channel(server.target, raw.key, TOKEN_B)  # closed already


def test_another_token_cannot_close_a_channel(server):
    with Client(server.target, token=TOKEN_A, channel="shm", retries=0, timeout=20) as a:
        first = a.sample(X, seed=1)
        key = a._same_host.key
        assert not close_channel(server.target, key, TOKEN_B)
        assert server.service.channels.open_channels == 1
        assert_same(a.sample(X, seed=1), first)
        assert a._same_host.key == key  # the same channel served it, not a new one
        assert close_channel(server.target, key, TOKEN_A)
        assert server.service.channels.open_channels == 0


def test_another_callers_region_is_not_found_over_a_channel(server):
    with Client(server.target, token=TOKEN_A, channel="shm", retries=0, timeout=20) as a, \
            Client(server.target, token=TOKEN_B, channel="shm", retries=0, timeout=20) as b, \
            Client(server.target, token=TOKEN_B, retries=0, timeout=20) as b_grpc, \
            regions.shared_array(X.shape, "float32", key=a.shm_key()) as buf:
        buf.array[:] = X
        a.register("logits", buf)
        assert_same(a.sample(buf.array, seed=4), b.sample(X, seed=4))  # A's region is A's over its channel
        theirs = regions.region_tensor(a.server_name("logits"), "float32", X.shape)
        errors = []
        for client in (b, b_grpc):
            with pytest.raises(LogitServeError) as info:
                client.sample(theirs, seed=4)
            errors.append(info.value)
        assert errors[0].code == grpc.StatusCode.NOT_FOUND
        assert (errors[0].code, errors[0].details) == (errors[1].code, errors[1].details)
        assert b._same_host.is_open
        # Raw, with B's key: the same.
        raw = RawChannel(open_channel(server.target, TOKEN_B))
        code, _, details, _ = raw.call("Sample", messages.sample_request(theirs, seed=4).SerializeToString())
        assert (code, details) == (grpc.StatusCode.NOT_FOUND, errors[0].details)
        a.unregister()
        buf.array = None


def test_a_channel_stops_when_its_token_is_removed(server, token_file):
    with Client(server.target, token=TOKEN_A, channel="shm", retries=0, timeout=20) as a, \
            Client(server.target, token=TOKEN_A, retries=0, timeout=20) as a_grpc, \
            Client(server.target, token=TOKEN_B, channel="shm", retries=0, timeout=20) as b:
        a.sample(X, seed=1)
        b.sample(X, seed=1)
        raw = RawChannel(open_channel(server.target, TOKEN_A))
        token_file.write_text(f"{TOKEN_B}\n")
        _reload(server)
        for client in (a, a_grpc):
            with pytest.raises(LogitServeError) as info:
                client.sample(X, seed=1)
            assert (info.value.code, info.value.details) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        assert a._same_host.is_open  # refused by the token check, not as an unknown key
        assert raw.call("Sample", SAMPLE)[:3:2] == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        assert b.sample(X, seed=1).valid.all()  # B's channel serves on
        with pytest.raises(grpc.RpcError) as opened:
            open_channel(server.target, TOKEN_A)
        assert opened.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("token", [None, "not-a-token"])
def test_open_channel_needs_a_valid_token(server, token):
    with pytest.raises(grpc.RpcError) as info:
        open_channel(server.target, token)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
    with Client(server.target, token=token, channel="shm", retries=0, timeout=20) as client:
        with pytest.raises(LogitServeError) as raised:
            client.sample(X, seed=1)
        assert (raised.value.code, raised.value.details) == (grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        assert not client._same_host.is_open
    assert server.service.channels.open_channels == 0
