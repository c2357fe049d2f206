"""Dynamic batching: concurrent compatible calls share one kernel launch.

Calls with equal ``key`` (same op, dtype, row width, and the op's static options) wait in one
group. A group launches when it holds ``max_batch_rows`` rows or its oldest call has waited
``max_delay_s`` (0: at once); while the device is busy with one launch, groups keep filling, so
load itself makes batches bigger. One worker task per batcher takes ready groups oldest first
and launches them on the device handle (:meth:`.device.DeviceHandle.run_batch`), one at a time.
A lone call (no launch under way, no call queued, ``max_delay_s`` 0: nothing could join it)
skips the queue: its handler's own task launches it and awaits the launch, which saves the
worker's wake-up and the hand-over of the result (:meth:`Batcher.submit`). Calls that arrive
meanwhile queue, and the worker launches them once that launch is done. Before a launch, calls
whose client cancelled are gone and calls past their deadline fail with DEADLINE_EXCEEDED. The
queue is bounded: at ``max_queue`` waiting calls, :meth:`Batcher.submit` raises
:class:`QueueFull` at once. When a launch of several calls fails, each call is retried alone,
so one bad request cannot fail its neighbours; after a call fails alone, ``on_failure`` (if
given) sees why.

How a launch waits for the device is decided here, in :meth:`Batcher.wait_for`.
"""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .device import Wait
from ..errors import DeadlineExpired, Draining, QueueFull, exception_chain
from ..logs import get_logger, log_event

log = get_logger("batcher")


def _cut_loose(exc: BaseException) -> BaseException:
    """``exc``, which a launch raised, with the locals of the frames it came through dropped
    (their names and lines stay, for the fault's log line).

    Those frames hold the launch's calls (their tensors, the request bytes they view) and the
    device's future of the launch, which holds ``exc``: a reference cycle, freed only by a
    garbage collection unless ``exc`` reaches a handler, whose guard cuts it (guard.let_go). A
    batch's failure reaches none (its calls are retried alone): every call of a batch that ran
    out of device memory stayed until the next collection, answered OK or not. Cut here, a
    launch's calls are freed by reference counting as their handlers return."""
    for link in exception_chain(exc):
        traceback.clear_frames(link.__traceback__)  # the frame running this is skipped
    return exc


@dataclass(eq=False)
class _Pending:
    call: object
    future: asyncio.Future
    deadline: float | None  # loop.time() by which the call must have launched
    enqueued: float
    queued: bool = True


@dataclass(eq=False)
class _Group:
    ready_at: float  # when the oldest call has waited max_delay
    items: list[_Pending] = field(default_factory=list)
    rows: int = 0


class Batcher:
    """Coalesces compatible calls into launches on one :class:`~.device.DeviceHandle`."""

    def __init__(self, handle, *, max_batch_rows: int, max_delay_s: float, max_queue: int, metrics=None,
                 calls_in_server: Callable[[], int] | None = None,
                 on_failure: Callable[[BaseException], Awaitable[None]] | None = None):
        self.handle = handle
        self.on_failure = on_failure  # awaited with what a launch of one call raised
        self.calls_in_server = calls_in_server  # the RPCs the server is handling, if known (app.py)
        self.max_batch_rows = max_batch_rows
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self.metrics = metrics
        self.launches = 0  # kernel launches (a batch is one launch)
        self.batched_requests = 0  # calls those launches served
        self._groups: dict[object, _Group] = {}
        self._queued = 0
        self._alone = 0  # lone calls launching from their handlers' tasks (submit)
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._worker_busy = False  # the worker is launching a batch
        self._closed = False

    @property
    def queue_depth(self) -> int:
        return self._queued

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="logitserve-batcher")

    def _admit(self) -> None:
        """Raise unless the batcher takes another call: it is closing, or its queue is full."""
        if self._closed:
            raise Draining("server is shutting down")
        if self._queued >= self.max_queue:
            raise QueueFull(f"queue full: {self._queued} requests waiting (--max-queue {self.max_queue})")

    async def submit(self, call, *, timeout: float | None = None):
        """Queue ``call`` and wait for its result; ``timeout`` is the call's remaining deadline.

        A call whose checks read its tensors element by element (``call.checked``: Sample's
        processor fields, server/ops/processor_checks.py) is checked on a worker thread first:
        queued only once valid, it holds up neither the loop nor the launches of others.

        A lone call launches at once from the caller's task (:meth:`_launch_alone`)."""
        self._admit()
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        checked = getattr(call, "checked", None)
        if checked is not None:
            with self.handle.checking():
                await checked()
            self._admit()  # again: the checks took a while
        now = loop.time()
        deadline = None if timeout is None else arrived + timeout
        if self._alone == 0 and self._queued == 0 and not self._worker_busy and self.max_delay_s <= 0:
            return await self._launch_alone(call, deadline, now, loop)
        pending = _Pending(call, loop.create_future(), deadline, now)
        key = call.key if call.key is not None else object()  # None: a group of its own
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(ready_at=now + self.max_delay_s)
        group.items.append(pending)
        group.rows += call.rows
        self._queued += 1
        pending.future.add_done_callback(lambda _f: self._forget(key, pending))
        if len(group.items) == 1 or group.rows >= self.max_batch_rows:
            self._wakeup.set()  # a new group (the worker times its delay) or a full one
        return await pending.future

    async def _launch_alone(self, call, deadline: float | None, now: float, loop):
        """Launch ``call`` from the caller's task and return its result: the launch the worker
        would make of it (deadline, metrics, ``on_failure``), without its two hand-overs."""
        if deadline is not None and deadline <= now:
            raise DeadlineExpired("deadline passed before launch")
        self._alone += 1  # calls arriving meanwhile queue; the worker waits for this launch
        try:
            self._count_launch([call], queue_seconds=[loop.time() - now])
            try:
                return (await self.handle.run_batch([call], self.wait_for([call])))[0]
            except Exception as exc:  # noqa: BLE001 - the call's own failure: reported, then raised
                failure = _cut_loose(exc)
                if self.on_failure is not None:
                    # Before the next launch, as the worker's report is; a caller that leaves
                    # meanwhile does not stop it (its task holds the device as this launch did).
                    report = loop.create_task(self.on_failure(failure))
                    self._alone += 1
                    report.add_done_callback(self._alone_done)
                    await asyncio.shield(report)
                raise
        finally:
            self._alone_done()

    def _alone_done(self, _report: asyncio.Task | None = None) -> None:
        """A lone call's launch (or the report of its failure) is over: the worker may launch."""
        self._alone -= 1
        if self._queued:
            self._wakeup.set()

    def wait_for(self, calls: list) -> Wait:
        """How the launch of ``calls`` waits for the device: polled on the event loop when the
        batch holds every call in the server (no one else is there to receive, and two thread
        hand-overs are saved), else on the launch thread, while the loop receives the calls that
        fill the next batch. Polled always, a loaded server would launch every call alone: the
        replay ends before gRPC hands the loop the next call."""
        in_server = self.calls_in_server
        return Wait.POLL if in_server is not None and in_server() <= len(calls) else Wait.THREAD

    def _count_launch(self, calls: list, queue_seconds: list[float]) -> None:
        if self.metrics is not None:
            # On the loop's next turn, as the RPC's own metrics (server/api/guard.py): off the
            # calls' way to their answers.
            asyncio.get_running_loop().call_soon(self._observe_launch, calls, queue_seconds)
        self.launches += 1
        self.batched_requests += len(calls)

    def _observe_launch(self, calls: list, queue_seconds: list[float]) -> None:
        self.metrics.observe_batch(calls[0].op, rows=sum(c.rows for c in calls), requests=len(calls),
                                   queue_seconds=queue_seconds)

    def _forget(self, key, pending: _Pending) -> None:
        # A call cancelled (client gone, deadline) while still queued leaves the queue at once.
        if not pending.queued:
            return
        pending.queued = False
        self._queued -= 1
        group = self._groups.get(key)
        if group is not None and pending in group.items:
            group.items.remove(pending)
            group.rows -= pending.call.rows
            if not group.items:
                del self._groups[key]

    def _take_ready(self, now: float) -> list[_Pending] | None:
        """Remove and return the calls of the oldest ready group, up to max_batch_rows rows."""
        for key, group in self._groups.items():
            if group.rows < self.max_batch_rows and group.ready_at > now:
                continue
            batch, rows = [], 0
            while group.items and (not batch or rows + group.items[0].call.rows <= self.max_batch_rows):
                pending = group.items.pop(0)
                group.rows -= pending.call.rows
                pending.queued = False
                self._queued -= 1
                if pending.future.done():
                    continue
                if pending.deadline is not None and pending.deadline <= now:
                    pending.future.set_exception(DeadlineExpired("deadline passed while queued, before launch"))
                    continue
                batch.append(pending)
                rows += pending.call.rows
            if not group.items:
                del self._groups[key]
            return batch
        return None

    def _next_ready_at(self) -> float | None:
        return min((g.ready_at for g in self._groups.values()), default=None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Behind a lone call's launch (submit) nothing is taken: the groups fill meanwhile,
            # and that launch's end wakes this.
            batch = None if self._alone else self._take_ready(loop.time())
            if batch is None:
                self._wakeup.clear()
                # Nothing ready: sleep until submit opens or fills a group, or the oldest
                # group's delay runs out.
                ready_at = None if self._alone else self._next_ready_at()
                timeout = None if ready_at is None else max(ready_at - loop.time(), 0.0)
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            if batch:
                self._worker_busy = True
                try:
                    await self._launch(batch, loop)
                finally:
                    self._worker_busy = False

    async def _launch(self, batch: list[_Pending], loop) -> None:
        calls = [p.call for p in batch]
        start = loop.time()
        self._count_launch(calls, queue_seconds=[start - p.enqueued for p in batch])
        try:
            results = await self.handle.run_batch(calls, self.wait_for(calls))
        except Exception as exc:  # noqa: BLE001 - handed to the call, or the calls retried alone
            failure = _cut_loose(exc)
        else:
            for p, result in zip(batch, results):
                self._resolve(p, result=result)
            return
        if len(batch) == 1:
            # This frame is in the failure's traceback, which the call's future keeps until it is
            # read: the call must not stay reachable from it (see _cut_loose).
            del calls
            self._resolve(batch.pop(), exc=failure)
            if self.on_failure is not None:
                await self.on_failure(failure)
            return
        log_event(log, "batch failed, retrying calls alone", op=calls[0].op, calls=len(batch), error=repr(failure))
        del failure  # no call's error (each gets its own, alone): freed here, and its frames with it
        for p in batch:
            if not p.future.done():  # a call whose client left meanwhile is not launched again
                await self._launch([p], loop)

    @staticmethod
    def _resolve(pending: _Pending, *, result=None, exc: BaseException | None = None) -> None:
        if pending.future.done():  # cancelled by its client while the launch ran
            return
        if exc is not None:
            pending.future.set_exception(exc)
        else:
            pending.future.set_result(result)

    def flush(self) -> None:
        """Make every waiting group ready now (draining: no one else is coming to join them)."""
        now = asyncio.get_running_loop().time()
        for group in self._groups.values():
            group.ready_at = min(group.ready_at, now)
        self._wakeup.set()

    async def close(self) -> None:
        """Stop the worker; calls still queued fail with :class:`Draining`."""
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        for group in list(self._groups.values()):
            for p in list(group.items):
                self._resolve(p, exc=Draining("server shut down before this call launched"))
        self._groups.clear()
