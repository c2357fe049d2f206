"""Issue 43 on the bounds of what sequences hold, through in-process CPU servers (torch backend
and the interpreted Triton kernels, small vocabulary).

Item 6: the bytes the open sequences' buffers hold (lists, the outputs' whole room) are bounded
by --max-sequence-bytes: an open, an update or an output's growth past it is RESOURCE_EXHAUSTED
before it is made (the old code accepted twelve 5 M-token prompts, 458 MiB, and had no bound).

Item 7: with bearer tokens on, one token holds at most its --token-share of each bound a tenant
can fill (sequences and their bytes, regions and their bytes, held answers): the old code let
token A open every sequence, and token B was refused on OpenSequences and KServe's
sequence_start. /metrics shows each owner's figures under its digest, never the token.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from logitserve.client import Client, LogitServeError
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from logitserve.server import ServerConfig
from logitserve.server.api.held import HeldAnswers
from logitserve.server.errors import TooLarge
from logitserve.server.regions import RegionRegistry, owner_of
from logitserve.server.testing import ServerThread
from test_regions import owner  # noqa: F401 (the fixture: shared-memory objects of another process)
from test_sequences_kserve import _request

V = 48
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _config(**changes) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", "backend": "torch", "warmup_dtypes": (),
                           "busy_poll_us": 0, **changes})


def _error(fn, *args, **kwargs) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        fn(*args, **kwargs)
    return info.value


def _bytes(client) -> int:
    return client.server_info().stats["sequence_bytes"]


def test_an_open_or_an_update_past_max_sequence_bytes_is_refused_before_it_is_built():
    with ServerThread(_config(max_sequence_bytes=4096)) as s, Client(s.target, timeout=30) as c:
        c.open_sequences([{"id": 1, "prompt_token_ids": [1] * 400}])  # 3,200 bytes
        assert _bytes(c) == 3200
        built = []
        s.service.sequences.open = lambda sequences, *a, **k: built.append(sequences)  # reached only once built
        err = _error(c.open_sequences, [{"id": 2, "prompt_token_ids": [1] * 200}])
        assert err.code == EXHAUSTED and "--max-sequence-bytes 4096" in err.details, err.details
        assert "1600 more bytes would make the sequences' 4800" in err.details
        assert built == []
        del s.service.sequences.open
        err = _error(c.update_sequences, [{"id": 1, "prompt_token_ids": [1] * 600}])
        assert err.code == EXHAUSTED and "--max-sequence-bytes 4096" in err.details, err.details
        assert _bytes(c) == 3200  # nothing changed
        assert c.update_sequences([{"id": 1, "prompt_token_ids": [2] * 300}]) == [0]
        assert _bytes(c) == 2400
        c.open_sequences([{"id": 2, "logit_bias": {3: 1.0}, "banned_token_ids": [4, 5]}])
        assert _bytes(c) == 2400 + 8 + 4 + 16


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_an_output_grows_within_the_bound_then_its_sample_is_refused_before_the_draw(backend):
    prompt = 480  # 3,840 of the 4,096 bytes: room for 32 tokens of output
    with ServerThread(_config(backend=backend, max_sequence_bytes=4096)) as s, Client(s.target, timeout=120) as c:
        seqs = c.open_sequences([{"id": 5, "seed": 3, "prompt_token_ids": [7] * prompt}])
        x = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
        drawn = [seqs.sample(x).token_ids.tolist()[0] for _ in range(32)]  # 16 tokens of room, then 16 more
        assert -1 not in drawn and _bytes(c) == 4096
        err = _error(seqs.sample, x)
        assert err.code == EXHAUSTED, err.details
        assert ("sequence_ids[0]: sequence 5 has no room for this call's token (its output is full at 32 tokens; "
                "nothing was drawn)") in err.details and "--max-sequence-bytes 4096" in err.details
        assert c.update_sequences([{"id": 5, "prompt_token_ids": []}]) == [32]  # the refused call drew nothing
        token = seqs.sample(x).token_ids.tolist()
        assert token == c.sample(x, seed=3, step=32).token_ids.tolist()
        assert _bytes(c) == 8 * 64  # the output's room doubled


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice-token\nbob-token\n")
    return str(path)


def test_one_token_holds_at_most_its_share_of_the_sequences(tokens):
    config = _config(auth_token_file=tokens, max_sequences=4, max_sequence_bytes=4096, token_share=0.5)
    with ServerThread(config) as s, Client(s.target, token="alice-token", timeout=30) as alice, \
            Client(s.target, token="bob-token", timeout=30) as bob:
        err = _error(alice.open_sequences, [{"id": i} for i in range(4)])  # the server has room for all four
        assert err.code == EXHAUSTED, err.details
        assert "4 more would make 4 open for this caller, past this token's share of the server's (--token-share " \
               "0.5 of --max-sequences: 2)" in err.details
        alice.open_sequences([{"id": 1}, {"id": 2}])
        err = _error(bob.open_sequences, [{"id": 1, "prompt_token_ids": [1] * 257}])  # 2,056 of 2,048 bytes
        assert err.code == EXHAUSTED and "(--token-share 0.5 of --max-sequence-bytes: 2048)" in err.details
        bob.open_sequences([{"id": 1, "prompt_token_ids": [1] * 200}])
        with grpc.insecure_channel(s.target) as channel:  # bob's second over KServe's sequence_start
            kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
            kserve.ModelInfer(_request(np.zeros((1, V), np.float32), 2, start=True), timeout=30,
                              metadata=[("authorization", "Bearer bob-token")])
        err = _error(alice.open_sequences, [{"id": 3}])
        assert err.code == EXHAUSTED and "--max-sequences" in err.details
        # /metrics: every owner's figures under its digest, and the totals; never a token.
        text = generate_latest(s.service.metrics.registry).decode()
        alice_id, bob_id = owner_of("Bearer alice-token"), owner_of("Bearer bob-token")
        assert f'logitserve_open_sequences_by_owner{{owner="{alice_id}"}} 2.0' in text
        assert f'logitserve_open_sequences_by_owner{{owner="{bob_id}"}} 2.0' in text
        assert f'logitserve_sequence_bytes_by_owner{{owner="{bob_id}"}} 1728.0' in text  # the KServe draw's room
        assert "logitserve_open_sequences 4.0" in text and "logitserve_sequence_bytes 1728.0" in text
        assert "alice-token" not in text and "bob-token" not in text


def test_without_tokens_one_caller_may_fill_every_bound():
    with ServerThread(_config(max_sequences=4, token_share=0.5)) as s, Client(s.target, timeout=30) as c:
        c.open_sequences([{"id": i} for i in range(4)])
        text = generate_latest(s.service.metrics.registry).decode()
        assert 'logitserve_open_sequences_by_owner{owner=""} 4.0' in text


def test_one_token_maps_at_most_its_share_of_the_regions(owner):  # noqa: F811 (the fixture)
    key = owner.create(64 * 1024)
    registry = RegionRegistry(max_regions=4, max_mapped_bytes=40_000, share=0.5, tokens_on=True)
    registry.register_system("a", key, 0, 8000, owner="alice")
    with pytest.raises(TooLarge, match=r"byte_size: registering 'b' would map 24000 bytes for this token, over its "
                                       r"share of the server's limit \(--token-share 0.5 of 40000: 20000; 8000 "
                                       r"mapped now\)"):
        registry.register_system("b", key, 0, 16_000, owner="alice")
    registry.register_system("b", key, 0, 8000, owner="alice")
    with pytest.raises(TooLarge, match=r"name: registering 'c' would map 3 regions for this token, over its share "
                                       r"of the server's limit \(--token-share 0.5 of 4: 2\)"):
        registry.register_system("c", key, 0, 64, owner="alice")
    registry.register_system("a", key, 0, 16_000, owner="bob")  # the other half is bob's
    registry.register_system("b", key, 0, 64, owner="bob")
    assert registry.holdings() == {"alice": {"regions": 2, "region_bytes": 16_000},
                                   "bob": {"regions": 2, "region_bytes": 16_064}}
    registry.unregister(owner="alice")
    assert set(registry.holdings()) == {"bob"}
    registry.close()
    unshared = RegionRegistry(max_regions=4, share=0.5)  # tokens off: one identity, the limits alone
    for name in "abcd":
        unshared.register_system(name, key, 0, 64, owner=None)
    unshared.close()


class _Call:
    """What HeldAnswers reads of a call's context: its connection and its authorization."""

    def __init__(self, peer: str, token: str):
        self._peer, self._metadata = peer, (("authorization", f"Bearer {token}"),)

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):
        return self._metadata


def test_one_token_holds_at_most_its_share_of_the_held_answers():
    held = HeldAnswers(max_bytes=1000, max_bytes_per_connection=1000, share=0.5, tokens_on=True)
    release = held.hold(_Call("ipv4:1", "alice-token"), 400)
    with pytest.raises(TooLarge, match=r"answers held for this token's unfinished calls: 400 bytes, and this "
                                       r"answer's 200 would pass its share of the server's limit \(--token-share "
                                       r"0.5 of --max-held-answer-bytes 1000: 500\)"):
        held.hold(_Call("ipv4:2", "alice-token"), 200)  # another connection, the same token
    held.hold(_Call("ipv4:3", "bob-token"), 500)
    assert held.holdings() == {owner_of("Bearer alice-token"): {"held_answer_bytes": 400},
                               owner_of("Bearer bob-token"): {"held_answer_bytes": 500}}
    release()
    held.hold(_Call("ipv4:2", "alice-token"), 500)
