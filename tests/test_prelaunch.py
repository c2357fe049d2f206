"""A lone Sample call launched before it is validated (ops.Prelaunch, Batcher.submit_prelaunched):
what a request's prelaunch reads, that it launches exactly what validation makes, and that the
batcher answers from it only then, with validation's errors raised after the replay."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from logitserve.server import ops
from logitserve.server.batcher import Batcher
from logitserve.server.device import Wait
from logitserve.server.guard import Occupancy
from logitserve.server.servicer import request_parsers
from logitserve.server.tensors import from_torch
from logitserve.v1 import logitserve_pb2 as pb

LIMITS = ops.Limits(max_rows=64, max_vocab=1 << 20)
READ = request_parsers()["/logitserve.v1.LogitServe/Sample"]


def received(rows: int = 1, vocab: int = 40, dtype=torch.bfloat16, **fields):
    """A SampleRequest as the server reads it (its logits in place)."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab)).to(dtype)
    fields.setdefault("seed", 7)
    return READ(pb.SampleRequest(logits=from_torch(logits), **fields).SerializeToString())


def prelaunch_and_call(request):
    return (ops.SampleCall.prelaunch(request.message, request.tensor_bytes),
            ops.SampleCall.from_pb(request.message, LIMITS, in_place=request.tensor_bytes))


@pytest.mark.parametrize("rows,fields", [
    (1, {}),
    (1, dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, step=3, seed=2**63 - 1)),
    (2, dict(temperature=0.0, filter_order=pb.FILTER_ORDER_JOINT)),
    (4, dict(top_k=2**40, top_p=1e-30)),
])
def test_a_prelaunch_launches_what_validation_makes(rows, fields):
    prelaunch, call = prelaunch_and_call(received(rows, **fields))
    assert prelaunch is not None and prelaunch.rows == rows and prelaunch.launches(call)
    assert [bytes(p.data) for p in prelaunch.parts] == [bytes(p.data) for p in call.parts]


@pytest.mark.parametrize("request_of", [
    lambda: received(seed=None),  # the server draws the seed: from_pb's to do
    lambda: received(random_val=0.5),
    lambda: received(top_k_rows=from_torch(torch.tensor([3]))),
    lambda: received(temperature_rows=from_torch(torch.tensor([0.5], dtype=torch.float64))),
    lambda: received(temperature=1e39),  # beyond float32
    lambda: received(filter_order=9),
    lambda: READ(pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[1, 40], data=b"\0" * 78),
                                  seed=1).SerializeToString()),  # data too short for its shape
    lambda: READ(pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_INT32, shape=[1, 4], data=b"\0" * 16),
                                  seed=1).SerializeToString()),
    lambda: READ(pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[80], data=b"\0" * 160),
                                  seed=1).SerializeToString()),
])
def test_other_requests_have_no_prelaunch(request_of):
    request = request_of()
    assert ops.SampleCall.prelaunch(request.message, request.tensor_bytes) is None


def test_a_call_made_from_other_values_is_not_what_was_launched():
    prelaunch, _ = prelaunch_and_call(received(temperature=0.5))
    _, other = prelaunch_and_call(received(temperature=0.6))
    assert not prelaunch.launches(other)


class GraphHandle:
    """A device handle whose captured graph (when ``captured``) answers 5 per row; records each
    replay, when its ``meanwhile`` ran, and when it was done."""

    def __init__(self, captured: bool = True):
        self.captured = captured
        self.events: list[str] = []

    async def replay_alone(self, key, parts, wait, meanwhile=None):
        if not self.captured:
            return None
        self.events.append(f"replay {parts[1].data.hex()}")
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            self.events.append("done")
        return [np.full(parts[0].shape[0], 5, dtype=np.int64)]

    async def launch(self, key, rows, stage_for, launch, *, wait):
        self.events.append("launch")
        return [np.full(rows, 6, dtype=np.int64)]


def lone(handle) -> Batcher:
    o = Occupancy()
    o.calls, o.idle_before = 1, 1.0
    return Batcher(handle, max_batch_rows=64, max_delay_s=0, max_queue=8, occupancy=o)


def submit(handle, launched, made):
    """Submit ``made`` (a received request) as prelaunched from ``launched`` to a lone server."""
    async def main():
        b = lone(handle)
        b.start()
        prelaunch = ops.SampleCall.prelaunch(launched.message, launched.tensor_bytes)

        def make_call():
            handle.events.append("made")
            return ops.SampleCall.from_pb(made.message, LIMITS, in_place=made.tensor_bytes)
        try:
            return await b.submit_prelaunched(prelaunch, make_call), b.launches
        finally:
            await b.close()
    return asyncio.run(asyncio.wait_for(main(), 20))


def test_a_lone_call_replays_while_it_is_made():
    handle, request = GraphHandle(), received(top_p=0.9)
    (result, launches) = submit(handle, request, request)
    assert result.token_ids == [5] and result.seeds == [7] and launches == 1
    assert handle.events[1:] == ["made", "done"] and handle.events[0].startswith("replay")


def test_what_validation_raises_is_raised_once_the_replay_is_done():
    handle, request = GraphHandle(), received(top_p=2.0)
    with pytest.raises(ValueError, match="top_p: must be in"):
        submit(handle, request, request)
    assert handle.events[1:] == ["made", "done"]


def test_a_call_that_is_not_what_was_launched_launches_again():
    handle = GraphHandle()
    result, launches = submit(handle, received(temperature=0.5), received(temperature=0.6))
    first, again = handle.events[0], handle.events[3]
    assert handle.events[1:3] == ["made", "done"] and again.startswith("replay") and again != first
    assert result.token_ids == [5] and launches == 1


def test_without_a_captured_graph_the_call_is_made_then_launched():
    handle, request = GraphHandle(captured=False), received()
    result, _ = submit(handle, request, request)
    assert handle.events == ["made", "launch"] and result.token_ids == [6]


def test_a_call_that_does_not_have_the_server_to_itself_is_made_then_queued():
    async def main():
        handle = GraphHandle()
        b = lone(handle)
        b.occupancy.calls = 2  # another call is in the server
        b.start()
        request = received()
        prelaunch = ops.SampleCall.prelaunch(request.message, request.tensor_bytes)

        def make_call():
            handle.events.append("made")
            return ops.SampleCall.from_pb(request.message, LIMITS, in_place=request.tensor_bytes)
        result = await b.submit_prelaunched(prelaunch, make_call)
        await b.close()
        return handle, result

    handle, result = asyncio.run(asyncio.wait_for(main(), 20))
    assert handle.events[0] == "made" and handle.events[1].startswith("replay") and result.token_ids == [5]
