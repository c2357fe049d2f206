"""The open sequences of every caller (issue 33), keyed by ``(owner, id)``: the owner is the
regions' (server/regions/names.py ``owner_of`` the caller's one ``authorization`` header), so a
bearer token sees only its own sequences, and two tokens may use the same ids. One sequence's
state is sequences/sequence.py's; what the table may hold, sequences/bounds.py's.

Threads. The event loop opens, closes, updates and looks sequences up (the table's dict, each
sequence's ``ended``, ``last_used`` and ``state``); the launch thread reads a sequence's state and
appends the drawn token and advances the step (sequences/sample.py). One lock guards the dict,
the ``ended`` marks and the bounds' counts; an update replaces a sequence's
:class:`~.sequence.SequenceState` whole, and a launch reads that reference once, so it draws
with the state before the update or after it, never a mix. The step and the output are written
only by the launch thread, one launch at a time, so the launch reads them without racing a
writer. A call holds its sequences from the lookup on: one closed (or expired) while the call
waits for its launch is seen ended at the launch, which then answers NOT_FOUND; one closed
during its launch is appended to and dropped with the call.

Bytes. Every change is checked against the bounds before it is made: an open and an update by
the bytes their lists will hold (computed from the request before anything is built, and again
from what was built), an output's growth before the launch that needs the room (:meth:`reserve`).

Idle expiry is swept on every table operation and by a timer (:meth:`start_sweeping`), so a
server nobody calls frees its idle sequences too; the dict is ordered by last use, so a sweep
looks only at the expired.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import TooLarge
from ..logs import get_logger, log_event
from .bounds import SequenceBounds
from .sequence import ID_BYTES, OPEN_FIRST, Sequence, SequenceExists, SequenceNotFound, StepMismatch, not_open

log = get_logger("sequences")


@dataclass(eq=False)
class SequenceTable:
    """The open sequences of every caller, within ``bounds``; each closed once no call has named
    it for ``idle_s`` seconds. ``clock``: monotonic seconds (tests move it). ``shared_port``: other
    server processes listen on this one's port (--workers), so that no sequence may open here
    (open.py ``open_specs`` says why)."""

    bounds: SequenceBounds
    idle_s: float
    device: torch.device
    clock: object = time.monotonic
    shared_port: bool = False
    _open: OrderedDict = field(default_factory=OrderedDict, repr=False)  # (owner, id) -> Sequence, by last use
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    expired: int = 0  # sequences closed for idleness since the start
    # Held by a Sample by sequence ids on the Triton kernels from the reading of its sequences'
    # state to the count of its tokens (sequences/lists.py): one at a time stores tokens.
    launch_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    _sweeper: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def max_sequences(self) -> int:
        return self.bounds.max_sequences

    def _sweep(self, now: float) -> None:
        """Under the lock: close the sequences idle past ``idle_s`` (the oldest come first)."""
        while self._open:
            key, seq = next(iter(self._open.items()))
            if now - seq.last_used < self.idle_s:
                return
            self._end(key, "expired")
            self.expired += 1

    def start_sweeping(self) -> None:
        """On the running loop: close the idle sequences every quarter of ``idle_s`` (at most a
        minute), calls or none, so that a sequence nobody names is freed at most that long
        after its idle time (as the channels' sweep does: server/api/channel/service.py)."""
        every = min(self.idle_s / 4, 60.0)
        loop = asyncio.get_running_loop()

        def sweep() -> None:
            with self._lock:
                before = self.expired
                self._sweep(self.clock())
                closed = self.expired - before
            if closed:
                log_event(log, "idle sequences closed", closed=closed, open=self.bounds.total.sequences)
            self._sweeper = loop.call_later(every, sweep)

        self._sweeper = loop.call_later(every, sweep)

    def stop_sweeping(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _end(self, key, why: str) -> Sequence:
        seq = self._open.pop(key)
        seq.ended = why
        self.bounds.add(seq.owner, -1, -seq.counted)
        return seq

    @staticmethod
    def _uncounted(seq: Sequence) -> int:
        """Under the lock: the bytes ``seq`` holds beyond what the bounds count (0 once it is
        closed), counted from now on: the caller tells the bounds."""
        if seq.ended is not None:
            return 0
        nbytes = seq.nbytes
        more, seq.counted = nbytes - seq.counted, nbytes
        return more

    def _recount(self, seq: Sequence) -> None:
        """Under the lock: the bounds told what ``seq`` holds now, if it is still open."""
        more = self._uncounted(seq)
        if more:
            self.bounds.add(seq.owner, 0, more)

    # ------------------------------------------------------------------ checks before the work

    def check_named(self, count: int, what: str) -> None:
        """``TooLarge`` for a request naming ``count`` sequences, more than can be open at once:
        checked before its ids are read (a request may carry millions)."""
        if count > self.max_sequences:
            raise TooLarge(f"{what}: {count} sequences named, more than can be open at once (--max-sequences "
                           f"{self.max_sequences}); name at most {self.max_sequences} a call")

    def check_room(self, owner: str | None, count: int, nbytes: int, what: str) -> None:
        """``TooLarge`` unless ``count`` more sequences of ``nbytes`` may open for ``owner``:
        checked before a request's specs are built, and again by :meth:`open`."""
        with self._lock:
            self._sweep(self.clock())
            self.bounds.check(owner, count, nbytes, what)

    def check_absent(self, owner: str | None, ids, id_field=lambda i: f"sequences[{i}].id") -> None:
        """``SequenceExists`` for the first of ``ids`` ``owner`` has open: checked before the
        request's sequences are built, and again by :meth:`open`."""
        with self._lock:
            self._check_absent(owner, ids, id_field)

    def _check_absent(self, owner, ids, id_field) -> None:
        for i, seq_id in enumerate(ids):
            if (owner, seq_id) in self._open:
                raise SequenceExists(f"{id_field(i)}: sequence {seq_id} is open already; close it first with "
                                     f"CloseSequences, or pick another id")

    def check_update(self, owner: str | None, ids, replaced: list[dict], field=lambda i: f"updates[{i}].id",
                     what: str = "UpdateSequences") -> None:
        """Before an update's changes are built: ``SequenceNotFound`` naming ``field(i)`` of the
        first of ``ids`` ``owner`` has not open; ``TooLarge`` when the lists ``replaced`` (one
        dict a sequence: attribute -> the bytes of its new list) would pass the bounds. Checked
        again by :meth:`update`."""
        with self._lock:
            self._sweep(self.clock())
            found = self._found(owner, ids, field)
            grown = sum(seq.state.nbytes_with(sizes) - seq.state.nbytes for seq, sizes in zip(found, replaced))
            self.bounds.check(owner, 0, grown, what)

    def _found(self, owner, ids, field) -> list[Sequence]:
        found = []
        for i, seq_id in enumerate(ids):
            seq = self._open.get((owner, seq_id))
            if seq is None:
                raise not_open(field(i), seq_id)
            found.append(seq)
        return found

    # ---------------------------------------------------------------------------- the changes

    def open(self, sequences: list[Sequence], id_field=lambda i: f"sequences[{i}].id",
             what: str = "OpenSequences") -> None:
        """Open ``sequences`` (one caller's, ids distinct), all or none: ``SequenceExists`` for
        an id the caller has open, ``TooLarge`` past the bounds. ``id_field(i)`` and ``what``
        name the i-th id and the request in messages (the KServe front's differ)."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            if not sequences:
                return
            owner = sequences[0].owner
            self._check_absent(owner, [seq.id for seq in sequences], id_field)
            self.bounds.check(owner, len(sequences), sum(seq.nbytes for seq in sequences), what)
            for seq in sequences:
                seq.last_used = now
                seq.counted = seq.nbytes
                self._open[(seq.owner, seq.id)] = seq
                self.bounds.add(owner, 1, seq.counted)

    def close(self, owner: str | None, ids) -> list[int]:
        """Close ``owner``'s sequences of ``ids``; the ids that were open."""
        closed = []
        with self._lock:
            self._sweep(self.clock())
            for seq_id in ids:
                if (owner, seq_id) in self._open:
                    self._end((owner, seq_id), "closed")
                    closed.append(seq_id)
        return closed

    def update(self, owner: str | None, changes: list, field=lambda i: f"updates[{i}].id",
               what: str = "UpdateSequences") -> list[int]:
        """``owner``'s sequences given new states: ``changes`` of ``(id, change)``, where
        ``change(state)`` is the sequence's new SequenceState; all or none (``SequenceNotFound``
        naming ``field(i)`` of the first id not open, ``TooLarge`` past the bounds). Each
        sequence's step, in order."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            found = self._found(owner, [seq_id for seq_id, _ in changes], field)
            states = [change(seq.state) for seq, (_, change) in zip(found, changes)]
            self.bounds.check(owner, 0, sum(new.nbytes - seq.state.nbytes for seq, new in zip(found, states)), what)
            for seq, state in zip(found, states):
                seq.state = state
                self._recount(seq)
                self._open.move_to_end((owner, seq.id))
                seq.last_used = now
            return [seq.step for seq in found]

    def lookup(self, owner: str | None, ids, field: str = "sequence_ids") -> list[Sequence]:
        """``owner``'s open sequences of ``ids`` (a Sample's rows, each named once), marked used
        now; ``SequenceNotFound`` naming the first missing one."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            found = []
            for row, seq_id in enumerate(ids):
                key = (owner, seq_id)
                seq = self._open.get(key)
                if seq is None:
                    raise not_open(f"{field}[{row}]", seq_id)
                self._open.move_to_end(key)
                seq.last_used = now
                found.append(seq)
            return found

    # ------------------------------------------------------------------------------ a launch

    def check_open(self, sequences: list[Sequence], field: str = "sequence_ids") -> None:
        """At a launch: ``SequenceNotFound`` for the first of ``sequences`` that ended (closed or
        expired) while its call waited; ``StepMismatch`` for one in an ordered step's draw not yet
        counted (its output and step are known once that step is done)."""
        with self._lock:
            for row, seq in enumerate(sequences):
                if seq.ended is not None:
                    raise SequenceNotFound(f"{field}[{row}]: sequence {seq.id} was {seq.ended} while this call "
                                           f"waited for its launch; {OPEN_FIRST}")
                if seq.ordered is not None:
                    raise StepMismatch(f"{field}[{row}]: sequence {seq.id} is in the draw of {seq.ordered}, not "
                                       f"yet done on the GPU (nothing was drawn); one sequence, one caller at a "
                                       f"time")

    def _charge(self, seq: Sequence, nbytes: int) -> None:
        """Under the lock: ``nbytes`` more counted for ``seq`` before it holds them."""
        self.bounds.add(seq.owner, 0, nbytes)
        seq.counted += nbytes

    def reserve(self, sequences: list[Sequence], field: str = "sequence_ids", answer_bytes: int = 0) -> None:
        """On the launch thread, before the draw: room for this call's draw in each of
        ``sequences``: for its answer, which it keeps as its last (``answer_bytes`` a row, in
        place of the last it keeps), and for one more token in its output. A full output's room
        doubles (amortised O(1) a token), or grows by what the bounds leave its owner where
        doubling would pass them. ``TooLarge`` naming ``field[row]`` where the bounds leave room
        for neither (then nothing grows, nothing is drawn). The room is counted before it is
        taken, so that no other change takes it meanwhile; :meth:`drew` (or :meth:`recount`, when
        the draw fails) counts what each holds after."""
        charged, planned = [], []
        with self._lock:
            try:
                for row, seq in enumerate(sequences):
                    if seq.ended is not None:  # closed meanwhile: appended to and dropped, uncounted
                        if seq.full:
                            planned.append((seq, seq.output_capacity, max(16, 2 * seq.output_len)))
                        continue
                    what = f"{field}[{row}]: sequence {seq.id} has no room for this call's"
                    kept = answer_bytes - seq.last_bytes
                    if kept > 0:
                        self.bounds.check(seq.owner, 0, kept, f"{what} answer (nothing was drawn)")
                        self._charge(seq, kept)
                        charged.append(seq)
                    if seq.full:
                        room = self.bounds.room(seq.owner) // ID_BYTES
                        if room == 0:
                            self.bounds.check(seq.owner, 0, ID_BYTES, f"{what} token (its output is full at "
                                                                      f"{seq.output_len} tokens; nothing was drawn)")
                        capacity = min(max(16, 2 * seq.output_len), seq.output_capacity + room)
                        self._charge(seq, (capacity - seq.output_capacity) * ID_BYTES)
                        charged.append(seq)
                        planned.append((seq, seq.output_capacity, capacity))
            except TooLarge:
                for seq in charged:
                    self._recount(seq)  # back to what it holds
                raise
        try:
            for seq, _, capacity in planned:
                seq.grow(capacity)
        finally:
            with self._lock:
                for seq, before, capacity in planned:
                    if seq.output_capacity == before and seq.ended is None:  # not grown: its charge back
                        self._charge(seq, (before - capacity) * ID_BYTES)

    def drew(self, sequences: list[Sequence], tokens: list[int], answers: list, on_device=None) -> None:
        """After a draw: each row's token (-1: none) stored after its sequence's output, by this
        call from ``on_device`` (the tokens on the device) when given, else by the launch
        already; each row's answer (``answers``: Drawns) kept as its sequence's last; every step
        advanced by one; what each sequence holds counted."""
        for row, (seq, token, answer) in enumerate(zip(sequences, tokens, answers)):
            if token >= 0:
                if on_device is not None:
                    seq.append(on_device[row:row + 1], token)
                else:
                    seq.appended(token)
            seq.last = answer
            seq.step += 1
        self.recount(sequences)

    def recount(self, sequences: list[Sequence]) -> None:
        """What each of ``sequences`` holds counted again (after a draw, or a failed one: the
        room :meth:`reserve` counted for an answer never kept is let go); the bounds told once
        per owner."""
        changed: dict = {}
        with self._lock:
            for seq in sequences:
                more = self._uncounted(seq)
                if more:
                    changed[seq.owner] = changed.get(seq.owner, 0) + more
            for owner, more in changed.items():
                self.bounds.add(owner, 0, more)

    def holdings(self) -> dict:
        """Each owner holding sequences -> {"open_sequences": n, "sequence_bytes": b} (/metrics)."""
        with self._lock:
            return self.bounds.holdings()

    def stats(self, owner: str | None = None) -> dict[str, int]:
        """``owner``'s open sequences and their bytes (None: a caller without a token). What
        GetServerInfo answers a caller: its own figures only; everyone's are in /metrics."""
        with self._lock:
            self._sweep(self.clock())
            held = self.bounds.holding(owner)
            return {"open_sequences": held.sequences, "sequence_bytes": held.bytes}
