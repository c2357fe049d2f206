"""Dynamic batching: concurrent compatible calls share one kernel launch.

Calls with equal ``key`` (same op, dtype, row width, and the op's static options) wait in one
group. A group launches when it holds ``max_batch_rows`` rows or its oldest call has waited
``max_delay_s``; while the device is busy with one launch, groups keep filling, so load itself
makes batches bigger. One worker task per batcher takes ready groups oldest first and launches
them with their op's ``run_batch`` on the device handle, one at a time (the handle keeps the
event loop free while the device works: server/device.py). Before a launch, calls whose client
cancelled are gone and calls past their deadline fail with DEADLINE_EXCEEDED. The queue is
bounded: at ``max_queue`` waiting calls, :meth:`Batcher.submit` raises :class:`QueueFull` at
once. When a launch of several calls fails, each call is retried alone, so one bad request
cannot fail its neighbours; after a call fails alone, ``on_failure`` (if given) sees why.

A call that finds the server idle (the rule: :meth:`Batcher._has_server_to_itself`) skips the
queue: its own handler launches it and spins for the replay, answering without a task switch.
On the H100 host that saved a median 60 us of a lone Sample call's 1,390 (docs/PERFORMANCE.md).

``Batcher.before_launch`` is a test hook, set only in-process (tests, ``bench/server_process.py``)
and never from the wire: called with a launch's calls on the device's launch thread just before
the launch, it can raise (a device fault: those calls fail with INTERNAL) or sleep (a slow batch).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .device import Wait
from .errors import DeadlineExpired, Draining, QueueFull
from .guard import Occupancy
from .logs import get_logger, log_event

log = get_logger("batcher")

# A call launches at once in its own handler, not through the queue, when it is the only call in
# a server that serves a lone client (guard.Occupancy.serves_a_lone_client). A handler that never
# yields lets no other call in, so calls launched at once run one by one: on the H100 host, with
# an idle rule alone (no overlap rule), 64 calls in flight got 2.3 calls a launch against 3.9
# through the queue.


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
                 occupancy: Occupancy | None = None,
                 on_failure: Callable[[BaseException], Awaitable[None]] | None = None):
        self.handle = handle
        self.on_failure = on_failure  # awaited with what a launch of one call raised
        self.occupancy = occupancy  # the RPCs the server is handling (Guard.occupancy), if known
        self.max_batch_rows = max_batch_rows
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self.metrics = metrics
        self.launches = 0  # kernel launches (a batch is one launch)
        self.batched_requests = 0  # calls those launches served
        self._groups: dict[object, _Group] = {}
        self._queued = 0
        self._launching = False  # a launch is under way: see _launch_ended
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._closed = False
        self.before_launch: Callable[[list], None] | None = None  # test hook: see the module docstring

    @property
    def queue_depth(self) -> int:
        return self._queued

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="logitserve-batcher")

    async def submit(self, call, *, timeout: float | None = None):
        """Queue ``call`` and wait for its result; ``timeout`` is the call's remaining deadline."""
        if self._closed:
            raise Draining("server is shutting down")
        if self._has_server_to_itself():
            if timeout is not None and timeout <= 0:
                raise DeadlineExpired("deadline passed before launch")
            return await self._launch_at_once(call)
        if self._queued >= self.max_queue:
            raise QueueFull(f"queue full: {self._queued} requests waiting (--max-queue {self.max_queue})")
        loop = asyncio.get_running_loop()
        now = loop.time()
        pending = _Pending(call, loop.create_future(), None if timeout is None else now + timeout, now)
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

    async def submit_prelaunched(self, prelaunch, make_call: Callable[[], object], *, timeout: float | None = None):
        """:meth:`submit` of the call ``make_call()`` makes (validating its request, raising what
        the request breaks), whose launch ``prelaunch`` has read from the request already
        (ops.Prelaunch). A call that finds the server to itself (as :meth:`submit` would launch
        at once) replays its graph first and is made while the device works; the replay's result
        stands if the call made is the one launched, else the call launches again, and what
        ``make_call`` raises is raised once the replay is done. Any other call is made first and
        submitted. Validation then runs while the device works instead of before it starts
        (docs/PERFORMANCE.md has what that saved a lone Sample call on the H100 host)."""
        if (self._closed or self.before_launch is not None or not self._has_server_to_itself()
                or (timeout is not None and timeout <= 0)):
            return await self.submit(make_call(), timeout=timeout)
        return await self._at_once(self._prelaunched(prelaunch, make_call))

    async def _prelaunched(self, prelaunch, make_call: Callable[[], object]):
        call = None

        def made_meanwhile() -> None:
            nonlocal call
            call = make_call()
        outputs = await self.handle.replay_alone(prelaunch.key, prelaunch.parts, Wait.SPIN, meanwhile=made_meanwhile)
        if outputs is None:  # no graph captured for it yet: made first, then launched
            call = make_call()
        self._count_launch([call], queue_seconds=[0.0])
        if outputs is not None and prelaunch.launches(call):
            return call.lone_result(outputs)
        return await self._run_alone(call)

    def _has_server_to_itself(self) -> bool:
        """Whether the call being submitted is the only one in a server that serves a lone client,
        and no launch is queued or under way: then no one is there to share its launch, and none
        is on the way. Never when ``max_delay_s`` asks calls to wait for company."""
        o = self.occupancy
        return (o is not None and o.calls == 1 and o.serves_a_lone_client()
                and self._queued == 0 and not self._launching and self.max_delay_s == 0)

    async def _launch_at_once(self, call):
        """Launch ``call`` alone in the caller's task, its replay waited for by spinning: with the
        graph captured, the handler runs to its answer without yielding to the event loop."""
        self._count_launch([call], queue_seconds=[0.0])
        return await self._at_once(self._run_alone(call))

    async def _run_alone(self, call):
        if self.before_launch is not None:
            await self.handle.run(self.before_launch, [call])
        result, = await type(call).run_batch([call], self.handle, wait=Wait.SPIN)
        return result

    async def _at_once(self, launch: Awaitable):
        """Await ``launch``, a launch made at once in the caller's task: marked under way until
        it ends, and what it raises handed to ``on_failure`` too."""
        self._launching = True
        try:
            return await launch
        except Exception as exc:
            if self.on_failure is not None:
                await self.on_failure(exc)
            raise
        finally:
            self._launch_ended()

    def _launch_ended(self) -> None:
        """A launch (the worker's, or one at once; ``_launching`` marks it under way) has ended:
        calls that came meanwhile are the worker's to launch."""
        self._launching = False
        if self._groups:
            self._wakeup.set()

    def _count_launch(self, calls: list, queue_seconds: list[float]) -> None:
        if self.metrics is not None:
            # On the loop's next turn, as the RPC's own metrics (server/guard.py): off a lone
            # call's way to its answer.
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
            batch = None if self._launching else self._take_ready(loop.time())
            if batch is None:
                self._wakeup.clear()
                # Nothing ready, or a call launched at once has the device: sleep until submit
                # opens or fills a group, that launch ends, or the oldest group's delay runs out.
                ready_at = None if self._launching else self._next_ready_at()
                timeout = None if ready_at is None else max(ready_at - loop.time(), 0.0)
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            if batch:
                self._launching = True
                try:
                    await self._launch(batch, loop)
                finally:
                    self._launch_ended()

    async def _launch(self, batch: list[_Pending], loop) -> None:
        calls = [p.call for p in batch]
        start = loop.time()
        self._count_launch(calls, queue_seconds=[start - p.enqueued for p in batch])
        try:
            if self.before_launch is not None:
                await self.handle.run(self.before_launch, calls)
            # A batch that holds every call in the server has no one to wait for: its replay is
            # polled on the event loop, saving two thread hand-overs (server/device.py).
            alone = self.occupancy is not None and self.occupancy.calls <= len(calls)
            results = await type(calls[0]).run_batch(calls, self.handle, wait=Wait.POLL if alone else Wait.THREAD)
        except Exception as exc:  # noqa: BLE001 - handed to the calls, or isolated below
            if len(batch) == 1:
                self._resolve(batch[0], exc=exc)
                if self.on_failure is not None:
                    await self.on_failure(exc)
                return
            log_event(log, "batch failed, retrying calls alone", op=calls[0].op, calls=len(batch), error=repr(exc))
            for p in batch:
                await self._launch([p], loop)
            return
        for p, result in zip(batch, results):
            self._resolve(p, result=result)

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
