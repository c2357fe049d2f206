"""The stream-ordered sessions of one server process, and the watcher that retires their steps.

A session lives while its OrderedSession call does (server/api/ordered.py): the call opens it
(:meth:`SessionTable.open`), streams its events, and on its end (the caller cancelled it, closed
its connection or died: gRPC ends the call at once) :meth:`SessionTable.close` ends the session
and frees it once its stream has drained. At most ``max_sessions`` are open, all callers
together, and ``per_token`` of them by one bearer token (--token-share), each holding a 2 MiB
marks allocation (server/ordered/marks.py) and a CUDA stream.

The watcher is one task on the event loop, running while any session has a step pending: it
polls the steps' events (a ``cudaEventQuery`` each, microseconds) every ``POLL_S`` and retires
finished ones, releasing their leases, and ends a session whose oldest step waited past its
``wait_timeout_s``. Polling, not a thread blocked in ``cudaEventSynchronize``: a thread would
block on a step whose mark never comes, and the timeout is what must end that.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from ..errors import TooLarge
from ..engine.device import DeviceHandle
from .marks import SessionGpu, StreamPool, available
from .sample import fill
from .session import OrderedSession, SessionEnded

# How often the watcher polls pending steps: a step's leases go at most this long after it is
# done, and a timeout ends a session at most this long late.
POLL_S = 0.0005
DEFAULT_STEPS_AHEAD = 8
MAX_STEPS_AHEAD = 64


class SessionTable:
    def __init__(self, handle: DeviceHandle, max_sessions: int, per_token: int, wait_timeout_s: float):
        self.handle = handle
        self.max_sessions = max_sessions
        self.per_token = per_token
        self.wait_timeout_s = wait_timeout_s
        self._sessions: dict[int, OrderedSession] = {}
        self._opening: dict[int, object] = {}  # ids being opened (their marks being allocated): their owners
        self._ids = itertools.count(1)
        self._streams = StreamPool(handle.device) if handle.device.type == "cuda" else None
        self._watcher: asyncio.Task | None = None
        self._ending: set[OrderedSession] = set()  # ended, their streams not yet drained
        self._unfreed: list = []  # closed sessions' marks (marks.SessionGpu), freed while none waits

    def __len__(self) -> int:
        return len(self._sessions)

    def unavailable(self) -> str | None:
        """Why this server opens no session (None: it does)."""
        if self.handle.device.type != "cuda" or self.handle.backend != "triton":
            return f"ordered sessions need a CUDA device with the triton backend; this server runs {self.handle.device} " \
                   f"with the {self.handle.backend} backend"
        return available()

    async def open(self, owner, wait_timeout_s: float, max_steps_ahead: int) -> OrderedSession:
        """A new session of ``owner``; ``TooLarge`` past the bounds, ``ValueError`` naming a bad field."""
        if wait_timeout_s < 0 or wait_timeout_s != wait_timeout_s:
            raise ValueError(f"wait_timeout_s: {wait_timeout_s}, must be >= 0 (0: the server's {self.wait_timeout_s:g})")
        if max_steps_ahead > MAX_STEPS_AHEAD:
            raise ValueError(f"max_steps_ahead: {max_steps_ahead}, must be <= {MAX_STEPS_AHEAD} (0: {DEFAULT_STEPS_AHEAD})")
        open_now = len(self._sessions) + len(self._opening)
        if open_now >= self.max_sessions:
            raise TooLarge(f"ordered sessions: {open_now} open, this server's limit is {self.max_sessions} "
                           f"(--max-ordered-sessions); end unused ones")
        held = sum(1 for s in self._sessions.values() if s.owner == owner) + \
            sum(1 for o in self._opening.values() if o == owner)
        if held >= self.per_token:
            raise TooLarge(f"ordered sessions: this token holds {held}, its share of this server's {self.max_sessions} "
                           f"(--max-ordered-sessions, --token-share)")
        session_id = next(self._ids)
        # Counted before the allocation's await, so that concurrent opens see it.
        self._opening[session_id] = owner
        try:
            gpu = await self.handle.run(SessionGpu, self.handle.device, self._streams)
        finally:
            del self._opening[session_id]
        timeout = min(wait_timeout_s, self.wait_timeout_s) if wait_timeout_s else self.wait_timeout_s
        session = OrderedSession(session_id, owner, gpu, timeout, max_steps_ahead or DEFAULT_STEPS_AHEAD)
        self._sessions[session_id] = session
        return session

    def get(self, owner, session_id: int, field: str) -> OrderedSession:
        """The caller's open session ``session_id``; ``SessionEnded`` naming ``field`` if it has none
        (never opened, another caller's, or ended and closed)."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise SessionEnded(f"{field}: {session_id} is no ordered session of this caller (never opened, or its "
                               f"OrderedSession call ended)")
        return session

    def watch(self) -> None:
        """Make sure the watcher runs (a step was just enqueued)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            now = time.monotonic()
            for session in [s for s in self._sessions.values() if s.ended is None]:
                reason = session.poll(now)
                if reason is not None:
                    self.end(session, reason)
                elif session.sources:
                    fill(self, session)  # standing calls' next marks, as steps finish
            for session in list(self._ending):
                if session.retire_all():
                    self._ending.discard(session)
            if not self._ending and not any(s.pending for s in self._sessions.values()):
                if not self._unfreed:
                    return
                await self._free_unfreed()
                continue  # a step enqueued meanwhile found this watcher running: look again
            await asyncio.sleep(POLL_S)

    def end(self, session: OrderedSession, reason: str) -> None:
        """End ``session`` (OrderedSession.end) and retire its steps as its released stream drains."""
        session.end(reason)
        self._ending.add(session)
        self.watch()

    async def close(self, session: OrderedSession, reason: str) -> None:
        """The session's call ended: end it (if still open), wait for its stream to drain, give
        its streams back and free its marks once no session waits."""
        self.end(session, reason)
        await session.drained.wait()
        self._sessions.pop(session.id, None)
        session.gpu.give_back_streams()
        self._unfreed.append(session.gpu)
        self.watch()  # frees it once no session waits

    async def _free_unfreed(self) -> None:
        """Free the marks of closed sessions, unless a session has a step pending (``cudaFree``
        waits for the whole device, and with it for that step's mark); the watcher calls this
        again when the last pending step is retired. A step enqueued between the check and the
        free holds the free (and the launch thread) until its mark comes: one forward for an
        engine that decodes, at most its session's wait limit for one that stalls."""
        if not self._unfreed or any(s.pending for s in self._sessions.values()):
            return
        unfreed, self._unfreed = self._unfreed, []
        try:
            for gpu in unfreed:
                await self.handle.run(gpu.free)
        except RuntimeError:  # the device's thread has stopped (the server stops): the process frees it
            pass

    def end_all(self, reason: str) -> None:
        """The server stops: end every session (their calls then end and close them)."""
        for session in list(self._sessions.values()):
            self.end(session, reason)
