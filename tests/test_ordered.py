"""Stream-ordered sessions off the GPU: the protocol's refusals through a real server, and a
session's bookkeeping (marks in order, steps retired, the wait limit, the end) with the GPU's
parts replaced by stand-ins. tests/test_ordered_cuda.py holds the ordering itself, on a GPU."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from logitserve.server.config import ServerConfig
from logitserve.server.ordered.session import MarkEnqueued, OrderedSession, PendingStep, SessionEnded
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub():
    with ServerThread(ServerConfig(port=0, host="127.0.0.1", device="cpu", warmup_dtypes=())) as server:
        with grpc.insecure_channel(server.target) as channel:
            yield pb_grpc.LogitServeStub(channel)


def _logits(rows: int = 2, vocab: int = 8) -> pb.Tensor:
    data = np.random.default_rng(0).standard_normal((rows, vocab), dtype=np.float32)
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, vocab], data=data.tobytes())


def test_a_server_without_a_gpu_opens_no_session_and_says_why(stub):
    with pytest.raises(grpc.RpcError) as caught:
        next(stub.OrderedSession(pb.OrderedSessionRequest(), timeout=30))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "CUDA device" in caught.value.details() and "cpu" in caught.value.details()


def test_an_ordered_call_needs_its_logits_in_a_cuda_region(stub):
    request = pb.SampleRequest(logits=_logits(), ordered=pb.OrderedMark(session_id=1, mark=1))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Sample(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("logits: an ordered call's logits must be in a CUDA region")


def test_an_ordered_mark_only_on_the_sample_rpc(stub):
    step = pb.StepRequest(sample=pb.SampleRequest(logits=_logits(), ordered=pb.OrderedMark(session_id=1, mark=1)))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Step(step, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ordered: only the Sample RPC" in caught.value.details()


class FakeGpu:
    """The session's GPU side, recorded: releases, and the words the client would see."""

    class device:
        index = 0

    ipc_handle = bytes(64)

    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


class FakeEvent:
    def __init__(self):
        self.passed = False
        self.fault = None

    def query(self):
        if self.fault is not None:
            raise RuntimeError(self.fault)
        return self.passed


class FakeRegions:
    def __init__(self):
        self.released = 0
        self.held = 0

    def hold(self):
        self.held += 1

    def release(self):
        self.released += 1


class FakeCall:
    def __init__(self, name: str):
        self.name = name
        self.regions = FakeRegions()


def _session(timeout_s: float = 1.0, ahead: int = 2) -> OrderedSession:
    return OrderedSession(7, "owner", FakeGpu(), timeout_s, ahead)


def _step(session: OrderedSession, mark: int) -> tuple[FakeEvent, FakeRegions]:
    event, regions = FakeEvent(), FakeRegions()
    session.add(PendingStep(mark, event, regions))
    return event, regions


def test_marks_go_in_order_from_one():
    session = _session()
    with pytest.raises(ValueError, match=r"ordered.mark: 2, but session 7's next mark is 1 \(each step's mark"):
        session.check_mark(2, "ordered.mark")
    session.check_mark(1, "ordered.mark")
    _step(session, 1)
    with pytest.raises(MarkEnqueued, match="ordered.mark: 1 is enqueued already; the first mark a call may take is 2"):
        session.check_mark(1, "ordered.mark")
    session.check_mark(2, "ordered.mark")


def test_finished_steps_release_their_leases_in_order():
    session = _session(timeout_s=10)
    (first, first_regions), (second, second_regions) = _step(session, 1), _step(session, 2)
    second.passed = True  # a later step cannot be retired before an earlier one
    assert session.poll(now=session.head_since) is None
    assert (first_regions.released, second_regions.released, len(session.pending)) == (0, 0, 2)
    first.passed = True
    assert session.poll(now=session.head_since + 0.1) is None
    assert (first_regions.released, second_regions.released, len(session.pending)) == (1, 1, 0)


def test_the_wait_limit_counts_from_the_step_before_finishing():
    session = _session(timeout_s=1.0, ahead=4)
    first, _ = _step(session, 1)
    start = session.head_since
    _step(session, 2)
    assert session.poll(now=start + 0.9) is None
    first.passed = True
    assert session.poll(now=start + 1.5) is None  # mark 2's clock started when mark 1 finished
    reason = session.poll(now=start + 2.6)
    assert reason is not None and reason.startswith("mark 2 waited 1.100 s on the GPU for its ready mark")
    assert session.first_broken_mark == 2


def test_ending_releases_the_waits_refuses_calls_and_tells_the_caller_once():
    session = _session()
    event, regions = _step(session, 1)
    session.end("why")
    session.end("another reason")
    assert session.gpu.released == 1
    with pytest.raises(SessionEnded, match="ordered session 7 ended: why"):
        session.check_mark(2, "ordered.mark")
    ended = session.events.get_nowait()
    assert ended.ended.reason == "why" and session.events.empty()
    assert not session.retire_all() and regions.released == 0  # the released step has not run yet
    event.passed = True
    assert session.retire_all() and regions.released == 1 and session.drained.is_set()


def test_a_device_fault_fails_the_step_and_ends_the_session():
    session = _session()
    event, _ = _step(session, 1)
    event.fault = "CUDA error: an illegal memory access was encountered"
    reason = session.poll(now=session.head_since)
    assert reason.startswith("device fault at mark 1")
    failed = session.events.get_nowait().failed
    assert (failed.mark, failed.code) == (1, 13) and "illegal memory access" in failed.message


def test_a_call_past_the_steps_ahead_waits_for_the_oldest():
    async def scenario():
        session = _session(ahead=2)
        first, _ = _step(session, 1)
        _step(session, 2)
        waiting = asyncio.ensure_future(session.wait_for_room())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        first.passed = True
        session.poll(now=session.head_since)
        await asyncio.wait_for(waiting, 1)
        _step(session, 3)
        waiting = asyncio.ensure_future(session.wait_for_room())
        await asyncio.sleep(0.01)
        session.end("gone")
        with pytest.raises(SessionEnded):
            await asyncio.wait_for(waiting, 1)

    asyncio.run(scenario())


def _enqueue_promised(session: OrderedSession) -> tuple[str, int, int]:
    call, mark, k = session.next_step()
    session.add(PendingStep(mark, FakeEvent(), FakeRegions()))
    return call.name, mark, k


def test_a_standing_call_serves_its_marks_and_a_later_one_replaces_the_rest():
    session = _session(ahead=64)
    first = FakeCall("first")
    session.add(PendingStep(1, FakeEvent(), FakeRegions()))  # its first mark, enqueued by its handler
    session.promise(first, 1, repeat=10)
    assert first.regions.held == 1 and session.next_mark == 11
    assert [_enqueue_promised(session) for _ in range(3)] == [("first", 2, 1), ("first", 3, 2), ("first", 4, 3)]
    with pytest.raises(MarkEnqueued, match="the first mark a call may take is 5 .*, or 11"):
        session.check_mark(4, "ordered.mark")
    with pytest.raises(ValueError, match="next mark is 11"):
        session.check_mark(12, "ordered.mark")
    session.check_mark(7, "ordered.mark")  # replaces marks 7..10
    assert [_enqueue_promised(session) for _ in range(2)] == [("first", 5, 4), ("first", 6, 5)]
    second = FakeCall("second")
    session.add(PendingStep(7, FakeEvent(), FakeRegions()))
    session.promise(second, 7, repeat=3)
    assert first.regions.released == 1  # its promise ended: its enqueued steps hold its regions
    assert session.next_mark == 10
    assert [_enqueue_promised(session) for _ in range(2)] == [("second", 8, 1), ("second", 9, 2)]
    assert session.next_step() is None and second.regions.released == 1 and session.next_mark == 10


def test_ending_drops_the_promised_marks():
    session = _session(ahead=64)
    call = FakeCall("standing")
    session.add(PendingStep(1, FakeEvent(), FakeRegions()))
    session.promise(call, 1, repeat=100)
    session.end("gone")
    assert call.regions.released == 1 and session.next_step() is None


def test_a_call_ahead_of_the_gpu_takes_over_at_its_mark():
    session = _session(ahead=64)
    first, ahead = FakeCall("first"), FakeCall("ahead")
    session.add(PendingStep(1, FakeEvent(), FakeRegions()))
    session.promise(first, 1, repeat=100)
    session.promise(ahead, 4, repeat=1, enqueued=False)  # sent at mark 2, for mark 4
    assert ahead.regions.held == 1 and session.next_mark == 5
    assert [_enqueue_promised(session) for _ in range(3)] == [("first", 2, 1), ("first", 3, 2), ("ahead", 4, 0)]
    assert session.next_step() is None and first.regions.released == 1 and ahead.regions.released == 1


def test_an_ordered_steps_checks_read_the_lists_as_its_kernels_did():
    """The processor fields' checks run after the step's `done`, when the engine may already be
    changing its lists for the next step: they read copies taken right after the ready wait."""
    import torch

    from logitserve.server.ops.processor_checks import BulkChecks
    from logitserve.server.ops.sample_processors import kernel_keywords
    from logitserve.server.ordered.sample import _Snapshot
    from logitserve.server.tensors import DeviceTensor

    ids = torch.tensor([3, 9, 4], dtype=torch.int64)  # CPU tensors stand in for the engine's CUDA regions
    offsets = torch.tensor([0, 2, 3], dtype=torch.int64)
    ids_field, offsets_field = DeviceTensor(ids, torch.int64, (3,)), DeviceTensor(offsets, torch.int64, (3,))
    checks = BulkChecks()
    checks.ragged("", "output_token_ids", "output_offsets", ids_field, offsets_field, vocab=8)
    snapshot = _Snapshot()
    snapshot.take([ids_field, offsets_field])  # as the step takes them, right after its ready wait
    launched = kernel_keywords({"output_token_ids": ids_field, "output_offsets": offsets_field}, ids.device, snapshot)
    assert launched["output_token_ids"].data_ptr() != ids.data_ptr()  # the kernels read the copy
    assert launched["output_offsets"].tolist() == [0, 2, 3]
    ids[1] = 2  # the engine's next step writes its list after `done`
    broken = BulkChecks(checks.checks, snapshot)
    assert bool(broken.in_launch())  # 9 >= vocab 8, as the kernels read it
    assert "output_token_ids" in broken.error() and "got 9" in broken.error()
    assert launched["output_token_ids"].tolist() == [3, 9, 4]


def test_an_ordered_step_passes_a_parameter_every_row_shares_as_a_scalar():
    """As an engine's own call would: the kernels pick their launches from scalars (a per-row
    top_k costs the gather a second launch), and the draw is the same either way."""
    import torch

    from logitserve.server.ops.limits import Limits
    from logitserve.server.ops.sample import SampleCall
    from logitserve.server.ordered.sample import kernel_params

    def rows(dtype, values):
        return pb.Tensor(dtype=dtype, shape=[len(values)], data=np.asarray(values, dtype=np.float32 if dtype ==
                                                                           pb.DTYPE_FLOAT32 else np.int64).tobytes())

    msg = pb.SampleRequest(logits=_logits(rows=3), temperature_rows=rows(pb.DTYPE_FLOAT32, [0.7, 0.7, 0.9]),
                           top_k_rows=rows(pb.DTYPE_INT64, [50, 50, 50]), top_p=0.9, seed_rows=rows(
                               pb.DTYPE_INT64, [5, 6, 7]), step=4)
    call = SampleCall.from_pb(msg, Limits(max_rows=8, max_vocab=64))
    floats, ints = (t.torch() for t in call.params)
    params = kernel_params(call, floats, ints)
    assert torch.equal(params["temperature"], torch.tensor([0.7, 0.7, 0.9]))  # differs by row: the column
    assert torch.equal(params["seed"], torch.tensor([5, 6, 7]))
    assert params["top_k"] == 50 and type(params["top_k"]) is int  # one value in every row: a scalar
    assert params["top_p"] == np.float32(0.9) and type(params["top_p"]) is float  # float32-rounded, as the column
    assert (params["step"], params["min_p"]) == (4, 0.0)
