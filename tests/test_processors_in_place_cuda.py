"""A processors call with its lists in CUDA regions on a GPU (issue 45, item 3): the list table
computed from the offsets, captured as a CUDA graph on the key's second use and replayed for
calls whose lists change length every call, answers what ``kernels.sample`` answers in-process
with the same ragged lists, and what the eager ragged path answers for the same lists as bytes; a
broken list on the replayed graph answers INVALID_ARGUMENT naming the field, and the next call is
served. In-process (a stand-in for the call's regions resolving each reference to a CUDA tensor
of this process, so the handle's graph counters are at hand), then through a server process
sharing this process's device memory (CUDA IPC). Runs where CUDA is present.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import messages
from logitserve.server.engine.device import DeviceHandle
from logitserve.server.ops.limits import Limits
from logitserve.server.ops.processors_in_place import takes_table
from logitserve.server.ops.sample import SampleCall
from logitserve.server.regions import CUDA
from logitserve.v1 import logitserve_pb2 as pb

pytestmark = pytest.mark.cuda

DEVICE = "cuda:0"
ROWS, VOCAB = 4, 4099
IDS = ("prompt_token_ids", "output_token_ids", "logit_bias_ids", "banned_token_ids", "stop_token_ids")
OFFSETS = {ids: ids.replace("_token_ids", "_offsets").replace("_ids", "_offsets") for ids in IDS}
PARAMS = dict(temperature=0.9, top_k=50, top_p=0.95, step=3, repetition_penalty=1.2, frequency_penalty=0.3,
              presence_penalty=0.1, min_tokens=6)


def _lists(seed: int, longest: int) -> dict[str, np.ndarray]:
    """Every list kind the table holds, each row up to ``longest`` ids, a grammar bitmask:
    lengths that change with ``seed``."""
    g = np.random.default_rng(seed)
    out = {}
    for ids in IDS:
        lengths = g.integers(0, longest + 1, ROWS)
        # Row 2 empty; rows 0 and 3 not (every list has ids: a list empty over the whole batch is
        # sent as its offsets alone, another key).
        lengths[2], lengths[0], lengths[3] = 0, max(lengths[0], 1), max(lengths[3], 1)
        out[ids] = g.integers(0, VOCAB, int(lengths.sum())).astype(np.int64)
        out[OFFSETS[ids]] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out["logit_bias_values"] = (g.standard_normal(out["logit_bias_ids"].shape[0]) * 4).astype(np.float32)
    out["grammar_bitmask"] = g.integers(-2**31, 2**31, (ROWS, (VOCAB + 31) // 32)).astype(np.int32)
    return out


def _expected(logits: torch.Tensor, seeds: np.ndarray, lists: dict) -> tuple[torch.Tensor, object]:
    on_device = {k: torch.from_numpy(v).to(DEVICE) for k, v in lists.items()}
    return kernels.sample(logits, **PARAMS, seed=torch.from_numpy(seeds).to(DEVICE), **on_device, logprobs=2,
                          backend="triton")


# --------------------------------------------------------------------------- in-process


class _Lease:
    kind, pinned = CUDA, False

    def __init__(self, view: torch.Tensor):
        self.view = view

    def tensor(self) -> torch.Tensor:
        return self.view


class _DeviceRegions:
    """Each reference names a CUDA buffer of this process by region name; a tensor is its first
    elements (the same address whatever the list's length), as a client's fixed buffer is."""

    leases = ()

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self.buffers = buffers

    def resolve(self, ref, dtype, shape, name, writable=False):
        n = int(np.prod(shape))
        return _Lease(self.buffers[ref.region].view(dtype)[:n].view(shape))


@pytest.fixture(scope="module")
def handle():
    h = DeviceHandle(DEVICE, backend="triton")
    yield h
    h.close()


def _call(handle, logits: torch.Tensor, seeds: np.ndarray, lists: dict, buffers: dict | None) -> SampleCall:
    """The call as a client sends it; with ``buffers``, the logits, every list and the bitmask
    written into them and sent by reference (token_ids into ``buffers["token_ids"]``)."""
    msg = messages.sample_request(logits.cpu().numpy(), seed=seeds, logprobs=2, **PARAMS, **lists)
    regions = None
    if buffers is not None:
        regions = _DeviceRegions(buffers)
        for field in ("logits", *lists):
            sent = getattr(msg, field, None)
            if not msg.HasField(field):
                continue  # an empty list: its offsets alone
            value = logits if field == "logits" else torch.from_numpy(lists[field])
            buffers[field].view(value.dtype)[:value.numel()].copy_(value.reshape(-1))
            getattr(msg, field).CopyFrom(pb.Tensor(dtype=sent.dtype, shape=sent.shape,
                                                   region=pb.RegionRef(region=field)))
        msg.output_regions["token_ids"].CopyFrom(pb.RegionRef(region="token_ids", byte_size=ROWS * 8))
        torch.cuda.synchronize()

    async def parsed():
        call = SampleCall.from_pb(msg, Limits(64, 1 << 17), regions=regions)
        await call.checked()
        return call

    return asyncio.run(parsed())


def _run(handle, call):
    return asyncio.run(handle.run_batch([call]))[0]


@pytest.fixture
def buffers():
    """A fixed CUDA buffer per field, as a client's registered regions: 1 MiB each."""
    names = ("logits", "token_ids", "logit_bias_values", "grammar_bitmask", *IDS, *OFFSETS.values())
    return {name: torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICE) for name in names}


def test_the_graph_follows_each_calls_lists(handle, buffers):
    """Calls on the same buffers with lists of other lengths each time: the first launches
    eagerly, the second captures the graph, the others replay it; each answer is the in-process
    kernels' and the eager ragged path's for the same lists."""
    graphs = handle.graphs
    captures, replays = graphs.captures, graphs.replays
    for i in range(6):
        logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(i)) * 3).to(DEVICE)
        seeds = np.arange(ROWS, dtype=np.int64) + 10 * i
        lists = _lists(i, longest=(5, 300, 40, 2, 900, 77)[i])
        call = _call(handle, logits, seeds, lists, buffers)
        assert takes_table(call, handle)
        got = _run(handle, call)
        want_tokens, want_lp = _expected(logits, seeds, lists)
        written = buffers["token_ids"].view(torch.int64)[:ROWS]
        assert torch.equal(written, want_tokens), f"call {i}"
        assert torch.equal(got.logprobs[0], want_lp.token_logprobs.cpu()), f"call {i}"
        assert torch.equal(got.logprobs[2], want_lp.top_token_ids.cpu()), f"call {i}"
        eager = _run(handle, _call(handle, logits, seeds, lists, None))  # lists as bytes: ragged, eagerly
        np.testing.assert_array_equal(eager.token_ids, want_tokens.cpu().numpy())
    assert graphs.captures == captures + 1
    assert graphs.replays >= replays + 5


def test_a_broken_list_on_the_replayed_graph_is_named(handle, buffers):
    logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(9)) * 3).to(DEVICE)
    seeds = np.arange(ROWS, dtype=np.int64)
    lists = _lists(9, longest=50)
    for _ in range(3):  # eager, captured, replayed
        _run(handle, _call(handle, logits, seeds, lists, buffers))
    replays = handle.graphs.replays
    n = lists["output_token_ids"].shape[0]
    broken = [({"output_token_ids": np.where(np.arange(n) == n - 1, VOCAB, lists["output_token_ids"])},
               f"output_token_ids: must be in [0, {VOCAB}) (vocab_size), got {VOCAB} in row 3"),
              ({"prompt_offsets": np.array([0, 10**12, 3, 3, lists["prompt_offsets"][-1]])},
               "prompt_offsets: must not decrease, got 3 after 1000000000000 (row 1)"),
              ({"banned_offsets": lists["banned_offsets"] + 1}, "banned_offsets: must start at 0, got 1"),
              ({"logit_bias_values": np.full_like(lists["logit_bias_values"], np.inf)},
               "logit_bias_values[0]: must be finite in float32")]
    for change, words in broken:
        with pytest.raises(ValueError) as info:
            _run(handle, _call(handle, logits, seeds, {**lists, **change}, buffers))
        assert str(info.value).startswith(words), str(info.value)
    assert handle.graphs.replays == replays + len(broken)  # checked on the graph, not eagerly
    _run(handle, _call(handle, logits, seeds, lists, buffers))
    assert torch.equal(buffers["token_ids"].view(torch.int64)[:ROWS], _expected(logits, seeds, lists)[0])


# --------------------------------------------------------------------------- through a server process


@pytest.fixture(scope="module")
def alice(tmp_path_factory):
    pytest.importorskip("cuda.bindings")
    from test_zero_copy import Caller, start_server
    from test_zero_copy_cuda import DeviceArena

    with start_server(tmp_path_factory.mktemp("pip-cuda"), "--max-region-bytes", str(128 << 20), device=DEVICE,
                      backend="triton", start_timeout=900) as server:
        c = Caller(server.target, "alice")
        c.arena = DeviceArena(c, "dev", nbytes=32 << 20)
        yield c
        c.client.unregister()
        c.close()


def test_through_the_server_lists_of_changing_lengths_and_a_broken_one(alice):
    """The same through gRPC and CUDA IPC: each field at a fixed offset of the client's region,
    lists of another length each call (eager, captured, replayed), each answer the in-process
    kernels'; a broken list answers INVALID_ARGUMENT, and the next call is served."""
    arena = alice.arena
    at = {name: arena.alloc(1 << 20) for name in ("logits", "logit_bias_values", "grammar_bitmask", *IDS,
                                                    *OFFSETS.values())}
    out = arena.out(torch.int64, (ROWS,))

    def request(logits, seeds, lists):
        msg = messages.sample_request(logits.cpu().numpy(), seed=seeds, **PARAMS, **lists)
        for field in ("logits", *lists):
            if not msg.HasField(field):
                continue
            sent = getattr(msg, field)
            value = (logits if field == "logits" else torch.from_numpy(lists[field])).to(DEVICE).reshape(-1)
            arena.mem[at[field]:at[field] + value.nbytes].view(value.dtype).copy_(value)
            getattr(msg, field).CopyFrom(pb.Tensor(dtype=sent.dtype, shape=sent.shape,
                                                   region=pb.RegionRef(region="dev", offset=at[field],
                                                                               byte_size=value.nbytes)))
        msg.output_regions["token_ids"].CopyFrom(out)
        torch.cuda.synchronize()
        return msg

    for i in range(5):
        logits = (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(40 + i)) * 3).to(DEVICE)
        seeds = np.arange(ROWS, dtype=np.int64) + i
        lists = _lists(40 + i, longest=(3, 500, 60, 1000, 9)[i])
        answer = alice.Sample(request(logits, seeds, lists))
        want = _expected(logits, seeds, lists)[0]
        assert torch.equal(arena.read(answer.token_ids, out, torch.int64), want), f"call {i}"
        if i == 3:
            bad = {**lists, "stop_offsets": lists["stop_offsets"][::-1].copy()}
            with pytest.raises(grpc.RpcError) as info:
                alice.Sample(request(logits, seeds, bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "stop_offsets: must start at 0" in info.value.details(), info.value.details()
