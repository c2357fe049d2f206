"""CUDA-graph launches (server/engine/graphs.py): a batch replayed from its bucket's graph gives exactly what
the eager launch and the kernels called directly give, whatever the padding rows hold; graphs are
reused per (key, bucket), large batches launch eagerly, and the byte budget drops old graphs.
Runs where CUDA is present (``-k cuda``).
"""

from __future__ import annotations

import asyncio
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.server.engine.device import DeviceHandle, Wait
from logitserve.server.engine.graphs import LaunchGraphs
from logitserve.server.ops import RouteExpertsCall, SampleCall
from logitserve.server.engine.staging import Staging
from logitserve.server.tensors import HostTensor

pytestmark = pytest.mark.cuda
DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def handles():
    graphed, eager = DeviceHandle(DEVICE, "triton"), DeviceHandle(DEVICE, "triton", cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    yield graphed, eager
    graphed.close()
    eager.close()


def _sample_calls(sizes: list[int], vocab: int, dtype: torch.dtype, seed: int, **options) -> list[SampleCall]:
    g = torch.Generator().manual_seed(seed)
    calls = []
    for i, rows in enumerate(sizes):
        logits = HostTensor.of((torch.randn(rows, vocab, generator=g) * 3).to(dtype))
        temperature = (torch.rand(rows, generator=g) + 0.3).tolist()  # float32 values, exactly
        top_k = torch.randint(0, 60, (rows,), generator=g).tolist()
        seeds = torch.randint(0, 2**62, (rows,), generator=g).tolist()
        calls.append(SampleCall(logits, temperature, top_k, 0.9, 0.0, seeds, i, options.get("filter_order", "top_k_first"),
                                options.get("random_val")))
    return calls


def _direct(call: SampleCall) -> np.ndarray:
    return kernels.sample(call.logits.torch().to(DEVICE), temperature=torch.tensor(call.temperature, device=DEVICE),
                          top_k=torch.tensor(call.top_k, device=DEVICE), top_p=call.top_p, min_p=call.min_p,
                          seed=torch.tensor(call.seed, device=DEVICE), step=call.step, filter_order=call.filter_order,
                          random_val=call.random_val, backend="triton").cpu().numpy()


# Batches in an order that leaves earlier, larger batches' rows in a bucket's padding.
SAMPLE_BATCHES = [[20, 20], [17, 16], [1], [3], [2, 3], [1], [1] * 9, [1, 1], [2], [40], [2], [1]]


@pytest.mark.parametrize("wait", list(Wait), ids=[w.value for w in Wait])
@pytest.mark.parametrize("dtype,vocab,options", [
    (torch.bfloat16, 128256, {}),
    (torch.float32, 32000, {"filter_order": "joint"}),
    (torch.float16, 1000, {"random_val": 0.3}),
])
def test_sample_batches_replayed_equal_eager_and_direct(handles, dtype, vocab, options, wait):
    graphed, eager = handles
    replays = graphed.graphs.replays
    for i, sizes in enumerate(SAMPLE_BATCHES):
        calls = _sample_calls(sizes, vocab, dtype, seed=i, **options)
        from_graph = asyncio.run(graphed.run_batch(calls, wait))
        from_eager = asyncio.run(eager.run_batch(calls))
        for call, g, e in zip(calls, from_graph, from_eager):
            np.testing.assert_array_equal(g.token_ids, e.token_ids)
            np.testing.assert_array_equal(g.token_ids, _direct(call))
            np.testing.assert_array_equal(g.seeds, e.seeds)
            np.testing.assert_array_equal(g.seeds, call.seed)
    assert graphed.graphs.replays - replays == len(SAMPLE_BATCHES)


def test_route_experts_replayed_equal_direct(handles):
    graphed, _ = handles
    g = torch.Generator().manual_seed(7)
    for sizes, wait in (([64, 64, 7], Wait.THREAD), ([5], Wait.POLL), ([64], Wait.POLL), ([3], Wait.THREAD),
                        ([64], Wait.POLL), ([64], Wait.THREAD)):
        calls = [RouteExpertsCall(HostTensor.of(torch.randn(rows, 256, generator=g).to(torch.bfloat16)), 8, True)
                 for rows in sizes]
        results = asyncio.run(graphed.run_batch(calls, wait))
        for call, r in zip(calls, results):
            w, i = kernels.topk_softmax(call.gate_logits.torch().to(DEVICE), 8, renormalize=True, backend="triton")
            np.testing.assert_array_equal(r.weights, w.cpu().numpy())
            np.testing.assert_array_equal(r.indices, i.cpu().numpy())


def test_graphs_are_reused_per_key_and_bucket(handles):
    graphed, _ = handles
    calls = _sample_calls([5], 4096, torch.float32, seed=1)
    asyncio.run(graphed.run_batch(calls))
    captures = graphed.graphs.captures
    for sizes in ([6], [7, 1], [8]):  # bucket 8, as the first
        asyncio.run(graphed.run_batch(_sample_calls(sizes, 4096, torch.float32, seed=2)))
    assert graphed.graphs.captures == captures
    asyncio.run(graphed.run_batch(_sample_calls([9], 4096, torch.float32, seed=3)))  # bucket 16
    assert graphed.graphs.captures == captures + 1


def test_large_batches_launch_eagerly_and_the_budget_drops_old_graphs():
    handle = DeviceHandle(DEVICE, "triton")
    handle.graphs = LaunchGraphs(handle.device, handle.stream, max_bytes=64 * 4096 * 4,
                                 budget_bytes=3 * 16 * 4096 * 4)

    def launch(x):
        return (x * 2,)

    def stage_for(rows):
        def make(batch_rows):
            stage = Staging()
            stage.add([HostTensor.of(torch.full((rows, 4096), float(rows)))], rows=batch_rows)
            return stage
        return make

    try:
        out, = asyncio.run(handle.launch("big", 65, stage_for(65), launch))  # 128 rows of 16 KiB: over max_bytes
        assert out.shape == (65, 4096) and (out == 130).all()
        assert handle.graphs.captures == 0
        for key in ("a", "b", "c", "d"):
            out, = asyncio.run(handle.launch(key, 9, stage_for(9), launch))
            assert out.shape == (9, 4096) and (out == 18).all()
        assert handle.graphs.captures == 4 and len(handle.graphs) == 3  # each 16 rows of 16 KiB; the budget holds three
        assert handle.graphs.get("a", 16) is None and handle.graphs.get("d", 16) is not None
    finally:
        handle.close()


def test_a_replay_polled_on_the_event_loop_leaves_it_free(handles):
    """While a graph runs, other callbacks on the loop run too: the replay waits by polling."""
    graphed, _ = handles
    calls = _sample_calls([32], 128256, torch.bfloat16, seed=4)  # 8 MB to copy: many polls
    asyncio.run(graphed.run_batch(calls))  # captured

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        results = await graphed.run_batch(calls, Wait.POLL)
        ticker.cancel()
        return results, ticks

    results, ticks = asyncio.run(main())
    np.testing.assert_array_equal(results[0].token_ids, _direct(calls[0]))
    assert ticks >= 3
