"""One stream-ordered session: its marks and stream on the GPU, the steps it has enqueued and
not yet finished, and how it ends.

A step is enqueued on the session's stream behind a wait for its ready mark; the call answers
at once. The session then keeps, per step, a CUDA event recorded after its work and the leases of
the regions it reads and writes (they stay mapped until the event has passed, whatever the
caller does meanwhile). :meth:`OrderedSession.poll` (the table's watcher, on the event loop)
retires finished steps, releasing their leases, and ends the session when the oldest step has
waited past the session's ``wait_timeout_s`` for its mark, or when the device reports a fault.

Ending (:meth:`OrderedSession.end`) is the same whatever ends it (the caller's call ended, a
timeout, a fault, the server's drain): later calls are refused, the waits are released from the
host (server/ordered/marks.py: ``ready`` and ``done`` set to RELEASED, so the steps enqueued run
on the logits as they are, and the caller's stream goes on), the session's event stream says why,
and once the stream has drained the leases go and (when the call has ended) the marks are freed.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import torch

from logitserve.v1 import logitserve_pb2 as pb

from ..errors import Unsupported


@dataclass(eq=False, slots=True)
class PendingStep:
    mark: int
    done: torch.cuda.Event  # recorded on the session's stream after the step's work
    regions: object  # the call's CallRegions, holding a launch hold (released once done)
    # With processor fields in CUDA regions: a coroutine function giving the message of the rule
    # one broke (None: none), to ask once the step is done.
    broken_rule: Callable[[], Awaitable[str | None]] | None = None
    # The host's part of the step, once it is done: ``retired(True)``; ``retired(False)`` where
    # the device faulted and the step's values cannot be read (a draw by sequence ids counted).
    retired: Callable[[bool], None] | None = None


class SessionEnded(Unsupported):
    """No such session of the caller, or it ended (FAILED_PRECONDITION); the reason is the message."""


class MarkEnqueued(Unsupported):
    """A call for a mark the session has enqueued already (FAILED_PRECONDITION)."""


@dataclass(eq=False, slots=True)
class Source:
    """A call serving the session's marks ``[first, end)``: one, or its ``repeat`` (OrderedMark).
    While it has marks to enqueue it holds its call's regions (each enqueued step holds them
    too, until it is done)."""

    call: object
    first: int
    end: int
    holding: bool = False

    def let_go(self) -> None:
        if self.holding:
            self.holding = False
            self.call.regions.release()


class OrderedSession:
    """A caller's stream-ordered session (server/ordered/table.py owns the table of them)."""

    def __init__(self, session_id: int, owner, gpu, wait_timeout_s: float, max_steps_ahead: int):
        self.id = session_id
        self.owner = owner
        self.gpu = gpu  # marks.SessionGpu
        self.wait_timeout_s = wait_timeout_s
        self.max_steps_ahead = max_steps_ahead
        # The calls whose marks are promised, in order, covering [next_enqueue, next_mark).
        self.sources: collections.deque[Source] = collections.deque()
        self.next_enqueue = 1  # the next mark to put on the GPU
        self.filling = False  # a top-up of standing calls' marks is under way (table.py)
        self.pending: collections.deque[PendingStep] = collections.deque()
        # When the oldest pending step's wait started to count: its call, or the step before it
        # finishing, whichever came later (steps enqueued ahead wait for their turn, not a mark).
        self.head_since = 0.0
        self.ended: str | None = None
        self.first_broken_mark = 0
        # The session's events for its OrderedSession call (the first, `opened`, is sent there).
        self.events: asyncio.Queue[pb.OrderedSessionEvent] = asyncio.Queue()
        self.room = asyncio.Event()  # set while a step may be enqueued (fewer than max_steps_ahead)
        self.room.set()
        self.busy = asyncio.Lock()  # one call's enqueue at a time: marks go in order
        self.drained = asyncio.Event()  # set once the session ended and its stream has finished

    def opened_event(self) -> pb.OrderedSessionEvent:
        return pb.OrderedSessionEvent(opened=pb.OrderedSessionOpened(
            session_id=self.id, device_id=self.gpu.device.index, marks_handle=self.gpu.ipc_handle, marks_offset=0,
            wait_timeout_s=self.wait_timeout_s, max_steps_ahead=self.max_steps_ahead))

    @property
    def next_mark(self) -> int:
        """The mark after every one promised: a call's, unless it replaces repetitions."""
        return self.sources[-1].end if self.sources else self.next_enqueue

    def check_mark(self, mark: int, field: str) -> None:
        """``SessionEnded`` if the session ended; ``MarkEnqueued`` for a mark on the GPU already;
        ``ValueError`` naming ``field`` for a mark past the next."""
        if self.ended is not None:
            raise SessionEnded(f"ordered session {self.id} ended: {self.ended}")
        if self.next_enqueue <= mark <= self.next_mark:
            return
        if mark < self.next_enqueue:
            raise MarkEnqueued(f"{field}: {mark} is enqueued already; the first mark a call may take is "
                               f"{self.next_enqueue} (replacing repetitions from there), or {self.next_mark}")
        raise ValueError(f"{field}: {mark}, but session {self.id}'s next mark is {self.next_mark} (each step's mark "
                         f"is the previous step's + 1, the first 1)")

    def promise(self, call, mark: int, repeat: int, enqueued: bool = True) -> None:
        """``call`` serves marks ``[mark, mark + repeat)`` (``enqueued``: its first was just put on
        the GPU; else it is ahead of the GPU, all its marks to come): what earlier calls promised
        from ``mark`` on is dropped (rows joined, left or changed)."""
        for source in self.sources:
            source.end = min(source.end, mark)
        for source in [s for s in self.sources if s.end <= s.first or s.end <= self.next_enqueue]:
            source.let_go()
        self.sources = collections.deque(s for s in self.sources if s.end > max(s.first, self.next_enqueue))
        if repeat > 1 or not enqueued:
            call.regions.hold()
            self.sources.append(Source(call, mark, mark + max(repeat, 1), holding=True))

    def next_step(self) -> tuple[object, int, int] | None:
        """The next mark to enqueue: ``(its source's call, the mark, its repetition k)``, or None."""
        self._drop_enqueued_sources()
        if not self.sources:
            return None
        source = self.sources[0]
        return source.call, self.next_enqueue, self.next_enqueue - source.first

    async def wait_for_room(self, limit: int | None = None) -> None:
        """Until fewer than ``limit`` steps (default ``max_steps_ahead``) are unfinished."""
        while len(self.pending) >= (self.max_steps_ahead if limit is None else limit):
            self.room.clear()
            await self.room.wait()
            if self.ended is not None:
                raise SessionEnded(f"ordered session {self.id} ended: {self.ended}")

    def add(self, step: PendingStep) -> None:
        """Step ``step.mark`` (:meth:`next_step`'s) is on the GPU."""
        if not self.pending:
            self.head_since = time.monotonic()
        self.pending.append(step)
        self.next_enqueue = step.mark + 1
        self._drop_enqueued_sources()
        if len(self.pending) >= self.max_steps_ahead:
            self.room.clear()

    def _drop_enqueued_sources(self) -> None:
        """Let go of the sources whose last mark is enqueued: their steps hold their regions."""
        while self.sources and self.sources[0].end <= self.next_enqueue:
            self.sources.popleft().let_go()

    def poll(self, now: float) -> str | None:
        """Retire the finished steps (their leases released); the reason to end the session, if
        it must end: the oldest step waited too long, or the device failed."""
        while self.pending:
            head = self.pending[0]
            try:
                finished = head.done.query()
            except RuntimeError as exc:  # a sticky device error, reported by any query
                self.first_broken_mark = self.first_broken_mark or head.mark
                self.events.put_nowait(pb.OrderedSessionEvent(failed=pb.OrderedStepFailed(
                    mark=head.mark, code=13, message=f"device fault: {exc}")))
                return f"device fault at mark {head.mark}: {exc}"
            if not finished:
                break
            self.pending.popleft()
            if head.retired is not None:
                head.retired(True)
            head.regions.release()
            if head.broken_rule is not None:  # it reads the server's copies of the fields, not the regions
                asyncio.ensure_future(self._report_broken_rule(head))
            self.head_since = now
            self.room.set()
        if self.pending and self.ended is None and now - self.head_since > self.wait_timeout_s:
            mark = self.pending[0].mark
            self.first_broken_mark = mark
            return (f"mark {mark} waited {now - self.head_since:.3f} s on the GPU for its ready mark, past "
                    f"wait_timeout_s {self.wait_timeout_s:g}")
        return None

    async def _report_broken_rule(self, step: PendingStep) -> None:
        """A done step's processor fields checked on the device: a broken rule becomes its
        ``failed`` event (INVALID_ARGUMENT); the session goes on."""
        try:
            message = await step.broken_rule()
        except Exception as exc:  # noqa: BLE001 - the report is best effort; the step is done
            message = f"its processor fields' checks could not be read: {exc!r}"
        if message is not None:
            self.events.put_nowait(pb.OrderedSessionEvent(failed=pb.OrderedStepFailed(mark=step.mark, code=3,
                                                                                     message=message)))

    def end(self, reason: str) -> None:
        """Refuse later calls, release the GPU waits, tell the caller (once; the first reason)."""
        if self.ended is not None:
            return
        self.ended = reason
        while self.sources:  # promised marks never enqueued: their calls' regions go
            self.sources.popleft().let_go()
        self.gpu.release()
        self.room.set()
        self.events.put_nowait(pb.OrderedSessionEvent(ended=pb.OrderedSessionEnded(
            first_broken_mark=self.first_broken_mark, reason=reason)))

    def retire_all(self) -> bool:
        """After :meth:`end`: retire the steps the released stream has finished; whether none is
        left (the stream has drained)."""
        while self.pending:
            head = self.pending[0]
            try:
                ran = head.done.query()
                if not ran:
                    return False
            except RuntimeError:
                ran = False  # a faulted context: the work will not run; its leases go
            self.pending.popleft()
            if head.retired is not None:
                head.retired(ran)
            head.regions.release()
        self.drained.set()
        return True
