"""A lone call's path (issue 45): launched by its handler's own task, the launch thread's outcome
handed to the loop once, the answer built in bulk; and batching unchanged once calls wait
together. Event-loop turns are counted as the callbacks the loop runs (asyncio.events.Handle._run),
patched in for the test alone."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from logitserve.server.engine.batcher import Batcher
from logitserve.server.engine.device import DeviceHandle, Wait
from logitserve.server.errors import DeadlineExpired
from logitserve.server.ops.sample import SampleResult
from logitserve.v1 import logitserve_pb2 as pb


class FakeCall:
    op = "fake"

    def __init__(self, value: int, key="k", rows: int = 1, fail: bool = False):
        self.value, self.key, self.rows, self.fail = value, key, rows, fail


class FakeHandle:
    """Records each launch's values and the task that made it; ``gate`` holds launches open."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.tasks: list[asyncio.Task] = []
        self.gate: asyncio.Event | None = None

    async def run_batch(self, calls, wait=Wait.THREAD):
        self.tasks.append(asyncio.current_task())
        if self.gate is not None:
            await self.gate.wait()
        self.batches.append([c.value for c in calls])
        if any(c.fail for c in calls):
            raise ValueError("bad call")
        return [c.value * 10 for c in calls]


@pytest.fixture
def turns(monkeypatch):
    """``turns[0]``: callbacks the event loop has run on this thread since the test began."""
    count = [0]
    run = asyncio.events.Handle._run
    thread = threading.get_ident()

    def counted(handle):
        if threading.get_ident() == thread:
            count[0] += 1
        return run(handle)

    monkeypatch.setattr(asyncio.events.Handle, "_run", counted)
    return count


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make(handle, **kw) -> Batcher:
    options = dict(max_batch_rows=64, max_delay_s=0.0, max_queue=100)
    options.update(kw)
    batcher = Batcher(handle, **options)
    batcher.start()
    return batcher


def test_a_lone_call_launches_from_its_own_task_in_no_turn_of_the_loop(turns):
    async def main():
        handle = FakeHandle()
        b = make(handle)
        await asyncio.sleep(0)  # the worker started and asleep
        before = turns[0]
        result = await b.submit(FakeCall(4))
        spent = turns[0] - before
        worker = b._worker
        await b.close()
        return handle, b, worker, result, spent

    handle, b, worker, result, spent = run(main())
    assert result == 40 and handle.batches == [[4]]
    assert handle.tasks[0] is not worker  # the caller's task launched it
    assert spent == 0  # no wake-up of the worker, no hand-over of the result
    assert b.launches == 1 and b.batched_requests == 1


def test_calls_arriving_during_a_lone_launch_queue_and_launch_together_after_it():
    async def main():
        handle = FakeHandle()
        handle.gate = asyncio.Event()
        b = make(handle, max_batch_rows=3)
        lone = asyncio.ensure_future(b.submit(FakeCall(0)))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(b.submit(FakeCall(i))) for i in range(1, 6)]
        await asyncio.sleep(0.01)
        # Full groups (3 rows) are not taken while the lone launch holds the device.
        depth, launched = b.queue_depth, list(handle.batches)
        handle.gate.set()
        results = await asyncio.gather(lone, *rest)
        worker = b._worker
        await b.close()
        return handle, worker, depth, launched, results

    handle, worker, depth, launched, results = run(main())
    assert depth == 5 and launched == []
    assert results == [i * 10 for i in range(6)]
    assert handle.batches == [[0], [1, 2, 3], [4, 5]]
    assert handle.tasks[0] is not worker and handle.tasks[1:] == [worker, worker]


def test_a_delay_to_wait_for_company_keeps_every_call_in_the_queue():
    async def main():
        handle = FakeHandle()
        b = make(handle, max_delay_s=0.001)
        await b.submit(FakeCall(1))
        worker = b._worker
        await b.close()
        return handle, worker

    handle, worker = run(main())
    assert handle.tasks == [worker]


def test_a_lone_call_past_its_deadline_is_never_launched():
    async def main():
        handle = FakeHandle()
        b = make(handle)
        with pytest.raises(DeadlineExpired, match="before launch"):
            await b.submit(FakeCall(1), timeout=0.0)
        await b.close()
        return handle, b

    handle, b = run(main())
    assert handle.batches == [] and b.launches == 0


def test_a_lone_call_cancelled_mid_launch_leaves_the_batcher_serving():
    async def main():
        handle = FakeHandle()
        handle.gate = asyncio.Event()
        b = make(handle)
        victim = asyncio.ensure_future(b.submit(FakeCall(1)))
        await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(b.submit(FakeCall(2)))
        await asyncio.sleep(0.01)
        victim.cancel()
        await asyncio.sleep(0.01)
        handle.gate.set()
        second = await queued
        third = await b.submit(FakeCall(3))  # alone again: from its own task
        await b.close()
        return handle, victim, second, third

    handle, victim, second, third = run(main())
    assert victim.cancelled() and second == 20 and third == 30
    assert handle.batches == [[2], [3]]


def test_a_lone_call_that_fails_is_reported_before_the_next_launch():
    order = []

    async def on_failure(exc):
        order.append("check")
        await asyncio.sleep(0.01)
        order.append("checked")

    async def main():
        handle = FakeHandle()
        b = make(handle, on_failure=on_failure)
        bad = asyncio.ensure_future(b.submit(FakeCall(1, fail=True)))
        await asyncio.sleep(0)
        good = asyncio.ensure_future(b.submit(FakeCall(2)))  # arrives during the device check
        outcomes = await asyncio.gather(bad, good, return_exceptions=True)
        order.append("answered")
        await b.close()
        return handle, outcomes

    handle, outcomes = run(main())
    assert isinstance(outcomes[0], ValueError) and outcomes[1] == 20
    assert handle.batches == [[1], [2]] and order == ["check", "checked", "answered"]


def test_the_launch_threads_outcome_reaches_its_caller_in_three_callbacks(turns):
    async def main():
        handle = DeviceHandle("cpu", backend="torch")
        try:
            await handle.submit(int, 1)  # the thread started
            spent = []
            for _ in range(5):  # the fewest of five: a loaded machine may add a spurious wake-up
                before = turns[0]
                value = await handle.submit(int, 7)
                spent.append(turns[0] - before)
            spent = min(spent)
            with pytest.raises(ValueError, match="invalid literal"):
                await handle.submit(int, "x")
            return value, spent, handle.thread_busy
        finally:
            handle.close()

    value, spent, busy = run(main())
    # The loop reads its self-pipe (the thread's call_soon_threadsafe), settles the caller's
    # future, resumes the caller. Through run_in_executor and a shield it ran seven callbacks.
    assert value == 7 and spent == 3 and not busy


def test_an_eager_launch_runs_on_the_loop_when_polled_and_on_the_launch_thread_otherwise():
    """A batch holding every call in the server (Wait.POLL) has no one to let in meanwhile: its
    eager launch (the CPU, no graph) runs on the loop, saving the two hand-overs; otherwise on the
    launch thread, while the loop receives the next batch's calls. Same outputs either way."""
    from logitserve.server.engine.device import _wait
    from logitserve.server.engine.staging import Staging
    from logitserve.server.tensors import HostTensor

    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    threads = []

    def stage_for(rows):
        stage = Staging()
        stage.add([HostTensor.of(torch.from_numpy(values))])
        return stage

    def launch(x):
        threads.append(threading.current_thread().name)
        return [x * 2]

    async def main():
        handle = DeviceHandle("cpu", backend="torch")
        try:
            outs = []
            for wait in (Wait.POLL, Wait.THREAD):
                token = _wait.set(wait)
                try:
                    outs.append(await handle.launch(None, 2, stage_for, launch))
                finally:
                    _wait.reset(token)
            return outs
        finally:
            handle.close()

    polled, threaded = run(main())
    np.testing.assert_array_equal(polled[0], values * 2)
    np.testing.assert_array_equal(threaded[0], values * 2)
    assert threads[0] == threading.current_thread().name and threads[1].startswith("logitserve-cpu")


def test_a_caller_cancelled_during_a_thread_launch_leaves_at_once_and_the_next_launch_waits():
    """The drain's answer to a cancelled call must not wait for a slow launch; the device must
    not pass to the next launch while the thread still runs the cancelled one."""
    async def main():
        handle = DeviceHandle("cpu", backend="torch")
        release, order = threading.Event(), []

        def slow():
            release.wait(5)
            order.append("cancelled one")
            return 1

        try:
            task = asyncio.ensure_future(handle.submit(slow))
            await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0.01)
            left_at_once = task.done() and task.cancelled()
            following = asyncio.ensure_future(handle.run(order.append, "next"))
            await asyncio.sleep(0.05)
            next_waited = order == []
            release.set()
            await following
            return left_at_once, next_waited, order, handle.thread_busy
        finally:
            handle.close()

    left_at_once, next_waited, order, busy = run(main())
    assert left_at_once and next_waited and order == ["cancelled one", "next"] and not busy


def test_a_sample_answer_is_built_from_the_launchs_array():
    tokens = np.array([5, -1, 31999], dtype=np.int64)
    response = SampleResult(tokens, [1, 2, 3]).to_pb()
    assert pb.SampleResponse.FromString(response.SerializeToString()) == response
    assert np.frombuffer(response.token_ids.data, "<i8").tolist() == [5, -1, 31999]
    assert np.frombuffer(response.seeds.data, "<i8").tolist() == [1, 2, 3]
    assert np.frombuffer(response.valid.data, np.bool_).tolist() == [True, False, True]
    assert list(response.token_ids.shape) == [3] and list(response.valid.shape) == [3]
    # A sequence call's tokens come as a list: the same answer.
    assert SampleResult(tokens.tolist(), [1, 2, 3]).to_pb() == response
    assert SampleResult(torch.tensor([5, -1, 31999]).numpy(), [1, 2, 3]).to_pb() == response


def test_a_lone_calls_failure_is_reported_in_full_though_its_caller_leaves():
    order = []
    checking = asyncio.Event()

    async def on_failure(exc):
        order.append("check")
        checking.set()
        await asyncio.sleep(0.02)
        order.append("checked")

    async def main():
        handle = FakeHandle()
        b = make(handle, on_failure=on_failure)
        bad = asyncio.ensure_future(b.submit(FakeCall(1, fail=True)))
        await checking.wait()
        bad.cancel()  # its client leaves during the device check
        good = asyncio.ensure_future(b.submit(FakeCall(2)))
        await asyncio.sleep(0)
        launched_during_check = list(handle.batches)
        result = await good
        order.append("answered")
        await b.close()
        return handle, bad, launched_during_check, result

    handle, bad, launched_during_check, result = run(main())
    assert bad.cancelled() and result == 20
    assert launched_during_check == [[1]] and handle.batches == [[1], [2]]
    assert order == ["check", "checked", "answered"]


def test_a_launch_dropped_unrun_by_close_cancels_its_caller():
    async def main():
        handle = DeviceHandle("cpu", backend="torch")
        release = threading.Event()
        running = asyncio.ensure_future(handle.submit(release.wait, 5))
        await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(handle.submit(int, 1))  # behind it on the launch thread
        await asyncio.sleep(0.01)
        closing = asyncio.get_running_loop().run_in_executor(None, handle.close)  # cancels what is queued
        await asyncio.sleep(0.01)
        release.set()
        await closing
        ran = await running
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(queued, 5)  # not a TimeoutError: the caller is not left waiting
        return ran, handle.thread_busy

    ran, busy = run(main())
    assert ran is True and not busy


def test_the_loop_does_not_busy_poll_while_a_calls_checks_run_off_it():
    """A call's checks on a worker thread count as thread work: a busy-polling loop would take a
    core and the GIL from them (a processors call was 1.2 ms slower with polling on, 2 cores)."""
    class Checked:
        key, rows, value, fail = "k", 1, 7, False

        async def checked(self):
            seen.append(handle.thread_busy)

    async def main():
        batcher = Batcher(handle, max_batch_rows=8, max_delay_s=0.0, max_queue=8)
        handle.run_batch = FakeHandle().run_batch  # the launch itself is not what is checked here
        batcher.start()
        try:
            return await batcher.submit(Checked())
        finally:
            await batcher.close()

    seen = []
    handle = DeviceHandle("cpu", backend="torch")
    try:
        assert run(main()) == 70
    finally:
        handle.close()
    assert seen == [True] and not handle.thread_busy
