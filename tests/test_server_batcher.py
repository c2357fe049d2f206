"""The dynamic batcher on its own, with a fake device: coalescing, limits, cancellation,
deadlines, a full queue, and one bad call in a batch failing alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from logitserve.server.engine.batcher import Batcher
from logitserve.server.engine.device import Wait
from logitserve.server.errors import DeadlineExpired, Draining, QueueFull


class FakeCall:
    op = "fake"

    def __init__(self, value: int, key="k", rows: int = 1, fail: bool = False):
        self.value, self.key, self.rows, self.fail = value, key, rows, fail



class FakeHandle:
    """Records launches; ``gate`` (when set) holds every launch until it opens."""

    def __init__(self):
        self.batches: list[list[int]] = []
        self.waits: list[Wait] = []  # run_batch's wait, per launch
        self.gate: asyncio.Event | None = None

    async def run_batch(self, calls, wait=Wait.THREAD):
        if self.gate is not None:
            await self.gate.wait()
        self.batches.append([c.value for c in calls])
        self.waits.append(wait)
        if any(c.fail for c in calls):
            raise ValueError("bad call in this batch")
        return [c.value * 10 for c in calls]


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make(handle, **kw) -> Batcher:
    options = dict(max_batch_rows=64, max_delay_s=0.02, max_queue=100)
    options.update(kw)
    batcher = Batcher(handle, **options)
    batcher.start()
    return batcher


def test_compatible_calls_share_one_launch():
    async def main():
        handle = FakeHandle()
        b = make(handle)
        results = await asyncio.gather(*(b.submit(FakeCall(i)) for i in range(5)))
        await b.close()
        return handle, b, results

    handle, b, results = run(main())
    assert results == [0, 10, 20, 30, 40]
    assert handle.batches == [[0, 1, 2, 3, 4]]
    assert b.launches == 1 and b.batched_requests == 5 and b.queue_depth == 0


@pytest.mark.parametrize("in_server,wait", [(None, Wait.THREAD), (1, Wait.POLL), (3, Wait.POLL), (4, Wait.THREAD)])
def test_a_batch_holding_every_call_in_the_server_is_polled(in_server, wait):
    async def main():
        handle = FakeHandle()
        b = make(handle, calls_in_server=None if in_server is None else (lambda: in_server))
        await asyncio.gather(*(b.submit(FakeCall(i)) for i in range(3)))
        await b.close()
        return handle

    handle = run(main())
    assert handle.batches == [[0, 1, 2]] and handle.waits == [wait]


@pytest.mark.parametrize("launching,max_delay_s", [(0, 0), (1, 0), (0, 0.001)])
def test_every_call_goes_through_the_queue(launching, max_delay_s):
    async def main():
        handle = FakeHandle()
        handle.gate = asyncio.Event()
        b = make(handle, calls_in_server=lambda: 1, max_delay_s=max_delay_s)
        held = [asyncio.ensure_future(b.submit(FakeCall(i, key="held"))) for i in range(launching)]
        await asyncio.sleep(0.01)
        call = asyncio.ensure_future(b.submit(FakeCall(9)))
        await asyncio.sleep(0.01)
        # Behind a launch under way, the call waits in the queue, where later calls can join it.
        assert not call.done() and b.queue_depth == launching
        handle.gate.set()
        result = await call
        await asyncio.gather(*held)
        await b.close()
        return handle, result

    handle, result = run(main())
    assert result == 90 and [9] in handle.batches


def test_a_call_past_its_deadline_fails_unlaunched():
    async def main():
        handle = FakeHandle()
        b = make(handle, calls_in_server=lambda: 1, max_delay_s=0)
        with pytest.raises(DeadlineExpired):
            await b.submit(FakeCall(1), timeout=0.0)
        await b.close()
        return handle, b

    handle, b = run(main())
    assert handle.batches == [] and b.launches == 0


def test_a_lone_call_that_fails_raises_and_is_reported():
    seen = []

    async def on_failure(exc):
        seen.append(exc)

    async def main():
        b = make(FakeHandle(), calls_in_server=lambda: 1, on_failure=on_failure, max_delay_s=0)
        with pytest.raises(ValueError, match="bad call"):
            await b.submit(FakeCall(1, fail=True))
        await b.close()

    run(main())
    assert len(seen) == 1 and isinstance(seen[0], ValueError)


def test_incompatible_calls_launch_apart():
    async def main():
        handle = FakeHandle()
        b = make(handle)
        calls = [FakeCall(1, "a"), FakeCall(2, "b"), FakeCall(3, "a"), FakeCall(4, None), FakeCall(5, None)]
        results = await asyncio.gather(*(b.submit(c) for c in calls))
        await b.close()
        return handle, results

    handle, results = run(main())
    assert results == [10, 20, 30, 40, 50]
    assert sorted(handle.batches) == [[1, 3], [2], [4], [5]]  # key None never shares


def test_full_group_launches_without_waiting_and_respects_max_rows():
    async def main():
        handle = FakeHandle()
        b = make(handle, max_batch_rows=4, max_delay_s=30.0)
        t0 = time.monotonic()
        results = await asyncio.gather(*(b.submit(FakeCall(i, rows=2)) for i in range(6)))
        elapsed = time.monotonic() - t0
        await b.close()
        return handle, results, elapsed

    handle, results, elapsed = run(main())
    assert results == [i * 10 for i in range(6)]
    assert handle.batches == [[0, 1], [2, 3], [4, 5]]  # 4 rows each: full groups go at once
    assert elapsed < 5.0


def test_load_makes_batches_while_the_device_is_busy():
    async def main():
        handle = FakeHandle()
        handle.gate = asyncio.Event()
        b = make(handle, max_delay_s=0.0)
        first = asyncio.ensure_future(b.submit(FakeCall(0)))
        await asyncio.sleep(0.05)  # the first launch is now running (held at the gate)
        rest = [asyncio.ensure_future(b.submit(FakeCall(i))) for i in range(1, 6)]
        await asyncio.sleep(0.05)
        handle.gate.set()
        results = await asyncio.gather(first, *rest)
        await b.close()
        return handle, results

    handle, results = run(main())
    assert results == [i * 10 for i in range(6)]
    assert handle.batches == [[0], [1, 2, 3, 4, 5]]


def test_full_queue_answers_at_once():
    async def main():
        handle = FakeHandle()
        b = make(handle, max_queue=2, max_delay_s=30.0)
        waiting = [asyncio.ensure_future(b.submit(FakeCall(i))) for i in range(2)]
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(QueueFull, match="max-queue 2"):
            await b.submit(FakeCall(9))
        elapsed = time.monotonic() - t0
        await b.close()
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        return elapsed, outcomes, handle

    elapsed, outcomes, handle = run(main())
    assert elapsed < 0.5
    assert all(isinstance(o, Draining) for o in outcomes)  # closing fails what never launched
    assert handle.batches == []


def test_cancelled_call_leaves_the_queue_and_never_launches():
    async def main():
        handle = FakeHandle()
        b = make(handle, max_delay_s=0.2)
        victim = asyncio.ensure_future(b.submit(FakeCall(1)))
        keeper = asyncio.ensure_future(b.submit(FakeCall(2)))
        await asyncio.sleep(0.01)
        assert b.queue_depth == 2
        victim.cancel()
        await asyncio.sleep(0)
        depth_after_cancel = b.queue_depth
        result = await keeper
        await b.close()
        return handle, depth_after_cancel, result, victim

    handle, depth, result, victim = run(main())
    assert victim.cancelled() and depth == 1 and result == 20
    assert handle.batches == [[2]]


def test_expired_call_is_dropped_before_launch():
    async def main():
        handle = FakeHandle()
        handle.gate = asyncio.Event()
        b = make(handle, max_delay_s=0.0)
        first = asyncio.ensure_future(b.submit(FakeCall(1)))
        await asyncio.sleep(0.02)
        late = asyncio.ensure_future(b.submit(FakeCall(2), timeout=0.01))
        await asyncio.sleep(0.05)  # its deadline passes while the device is busy
        handle.gate.set()
        outcomes = await asyncio.gather(first, late, return_exceptions=True)
        await b.close()
        return handle, outcomes, b

    handle, outcomes, b = run(main())
    assert outcomes[0] == 10 and isinstance(outcomes[1], DeadlineExpired)
    assert handle.batches == [[1]] and b.launches == 1


def test_one_bad_call_fails_alone():
    async def main():
        handle = FakeHandle()
        b = make(handle)
        calls = [FakeCall(1), FakeCall(2, fail=True), FakeCall(3)]
        outcomes = await asyncio.gather(*(b.submit(c) for c in calls), return_exceptions=True)
        await b.close()
        return handle, outcomes

    handle, outcomes = run(main())
    assert outcomes[0] == 10 and outcomes[2] == 30
    assert isinstance(outcomes[1], ValueError)
    assert handle.batches == [[1, 2, 3], [1], [2], [3]]


def test_closed_batcher_refuses_new_calls():
    async def main():
        b = make(FakeHandle())
        await b.close()
        with pytest.raises(Draining):
            await b.submit(FakeCall(1))

    run(main())
