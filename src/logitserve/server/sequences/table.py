"""Sequences: sampling state the server keeps per sequence (issue 33), so that a frontend names
its sequences in each Sample instead of resending every parameter, prompt and output.

A :class:`Sequence` holds one sequence's parameters, seed and step, and its lists (prompt,
output, logit bias, banned and stop tokens) as tensors on the server's device; the
:class:`SequenceTable` holds the open ones of every caller, keyed by ``(owner, id)``: the owner
is the regions' (server/regions/names.py ``owner_of`` the caller's one ``authorization``
header), so a bearer token sees only its own sequences, and two tokens may use the same ids.

Threads. The event loop opens, closes, updates and looks sequences up (the table's dict, each
sequence's ``ended``, ``last_used`` and ``state``); the launch thread reads a sequence's state and
appends the drawn token and advances the step (sequences/sample.py). One lock guards the dict,
the ``ended`` marks and the byte count; an update replaces a sequence's :class:`SequenceState`
whole, and a launch reads that reference once, so it draws with the state before the update or
after it, never a mix. The step and the output are written only by the launch thread, one
launch at a time, so the launch reads them without racing a writer. A call holds
its sequences from the lookup on: one closed (or expired) while the call waits for its launch is
seen ended at the launch, which then answers NOT_FOUND; one closed during its launch is
appended to and dropped with the call.

Idle expiry is swept on every table operation (the dict is ordered by last use, so a sweep
looks only at the expired); a server nobody calls keeps its idle sequences until the next call.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import NotFound, TooLarge
from ..regions import RegionExists

ID_BYTES = 8  # every list is int64 on the device
OPEN_FIRST = "open it first with OpenSequences"


class SequenceNotFound(NotFound):
    """No open sequence of that id for this caller: NOT_FOUND."""


class SequenceExists(RegionExists):
    """An id this caller has open already: ALREADY_EXISTS (the status guard.py gives RegionExists)."""


@dataclass(frozen=True)
class SequenceParams:
    """A sequence's sampling parameters, as the kernels' keywords (checked: sequences/open.py)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0


def _held_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, eq=False)
class SequenceState:
    """What UpdateSequences may change, replaced as a whole: one reference, which a launch
    reads once, so that it never sees half of an update."""

    params: SequenceParams
    prompt: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    banned: torch.Tensor
    stop: torch.Tensor
    max_ids: dict  # each list's largest token id (-1: none), by attribute name ("prompt", "bias_ids"...)

    @functools.cached_property
    def max_id(self) -> int:
        return max(self.max_ids.values(), default=-1)

    @property
    def nbytes(self) -> int:
        return _held_bytes((self.prompt, self.bias_ids, self.bias_values, self.banned, self.stop))


@dataclass(eq=False)
class Sequence:
    """One open sequence. ``output`` has room to grow (``output_len`` of it hold tokens)."""

    owner: str | None
    id: int
    state: SequenceState
    step: int
    output: torch.Tensor
    output_len: int
    output_max_id: int  # the largest token id of the output (-1: none); the launch thread's
    last_used: float = 0.0
    ended: str | None = None  # why it is no longer open ("closed", "expired"); None while open
    counted: int = 0  # the bytes the table counts for it (its nbytes, but for growth after it ended)
    # The output buffer's address and room, kept beside it: a list table row reads them each call.
    output_address: int = field(init=False, default=0)
    output_capacity: int = field(init=False, default=0)

    def __post_init__(self):
        self._keep_output(self.output)

    def _keep_output(self, output: torch.Tensor) -> None:
        self.output = output
        self.output_address, self.output_capacity = output.data_ptr(), output.shape[0]

    @property
    def params(self) -> SequenceParams:
        return self.state.params

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + _held_bytes((self.output,))

    def outputs(self) -> torch.Tensor:
        return self.output[:self.output_len]

    def reserve(self) -> int:
        """Room for one more token in the output (twice the room when full: amortised O(1) a
        token); the bytes the output grew by. On the launch thread, or on the stream the
        launches run on (the old buffer is read by the copy)."""
        if self.output_len < self.output.shape[0]:
            return 0
        if self.output.is_cuda:  # freed below while the copy may still read it on this stream
            self.output.record_stream(torch.cuda.current_stream(self.output.device))
        bigger = torch.empty(max(16, 2 * self.output_len), dtype=self.output.dtype, device=self.output.device)
        bigger[:self.output_len] = self.outputs()
        grown = (bigger.shape[0] - self.output.shape[0]) * ID_BYTES
        self._keep_output(bigger)
        return grown

    def append(self, token: torch.Tensor, value: int) -> int:
        """``token`` (a one-element tensor on the device, whose value is ``value``) appended to
        the output; the bytes the output grew by."""
        grown = self.reserve()
        self.output[self.output_len:self.output_len + 1] = token
        self.appended(value)
        return grown

    def appended(self, value: int) -> None:
        """Token ``value`` was stored after the output (by the launch: sequences/lists.py)."""
        self.output_len += 1
        self.output_max_id = max(self.output_max_id, value)


def not_open(field: str, seq_id: int) -> SequenceNotFound:
    return SequenceNotFound(f"{field}: no open sequence {seq_id} for this caller (never opened, closed, idle past "
                            f"--sequence-idle-s, or opened before the server restarted); {OPEN_FIRST}")


@dataclass(eq=False)
class SequenceTable:
    """The open sequences of every caller, at most ``max_sequences`` in all; each closed once no
    call has named it for ``idle_s`` seconds. ``clock``: monotonic seconds (tests move it)."""

    max_sequences: int
    idle_s: float
    device: torch.device
    clock: object = time.monotonic
    _open: OrderedDict = field(default_factory=OrderedDict, repr=False)  # (owner, id) -> Sequence, by last use
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _bytes: int = 0
    expired: int = 0  # sequences closed for idleness since the start
    # Held by a Sample by sequence ids on the Triton kernels from the reading of its sequences'
    # state to the count of its tokens (sequences/lists.py): one at a time stores tokens.
    launch_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def _sweep(self, now: float) -> None:
        """Under the lock: close the sequences idle past ``idle_s`` (the oldest come first)."""
        while self._open:
            key, seq = next(iter(self._open.items()))
            if now - seq.last_used < self.idle_s:
                return
            self._end(key, "expired")
            self.expired += 1

    def _end(self, key, why: str) -> Sequence:
        seq = self._open.pop(key)
        seq.ended = why
        self._bytes -= seq.counted
        return seq

    def check_named(self, count: int, what: str) -> None:
        """``TooLarge`` for a request naming ``count`` sequences, more than can be open at once:
        checked before its ids are read (a request may carry millions)."""
        if count > self.max_sequences:
            raise TooLarge(f"{what}: {count} sequences named, more than can be open at once (--max-sequences "
                           f"{self.max_sequences}); name at most {self.max_sequences} a call")

    def check_room(self, count: int, what: str) -> None:
        """``TooLarge`` unless ``count`` more sequences may open: checked before a request's
        specs are read or built, and again by :meth:`open`."""
        with self._lock:
            self._sweep(self.clock())
            self._check_room(count, what)

    def _check_room(self, count: int, what: str) -> None:
        if len(self._open) + count > self.max_sequences:
            raise TooLarge(f"{what}: {count} more would make {len(self._open) + count} open, past the server's "
                           f"limit (--max-sequences {self.max_sequences}); close some first")

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

    def open(self, sequences: list[Sequence], id_field=lambda i: f"sequences[{i}].id",
             what: str = "OpenSequences") -> None:
        """Open ``sequences`` (one caller's, ids distinct), all or none: ``SequenceExists`` for
        an id the caller has open, ``TooLarge`` past ``max_sequences``. ``id_field(i)`` and
        ``what`` name the i-th id and the request in messages (the KServe front's differ)."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            if sequences:
                self._check_absent(sequences[0].owner, [seq.id for seq in sequences], id_field)
            self._check_room(len(sequences), what)
            for seq in sequences:
                seq.last_used = now
                seq.counted = seq.nbytes
                self._open[(seq.owner, seq.id)] = seq
                self._bytes += seq.counted

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

    def check_found(self, owner: str | None, ids, field=lambda i: f"updates[{i}].id") -> None:
        """``SequenceNotFound`` naming ``field(i)`` of the first of ``ids`` ``owner`` has not open:
        checked before an update's changes are built, and again by :meth:`update`."""
        with self._lock:
            self._sweep(self.clock())
            self._found(owner, ids, field)

    def _found(self, owner, ids, field) -> list[Sequence]:
        found = []
        for i, seq_id in enumerate(ids):
            seq = self._open.get((owner, seq_id))
            if seq is None:
                raise not_open(field(i), seq_id)
            found.append(seq)
        return found

    def update(self, owner: str | None, changes: list, field=lambda i: f"updates[{i}].id") -> list[int]:
        """``owner``'s sequences given new states: ``changes`` of ``(id, change)``, where
        ``change(state)`` is the sequence's new SequenceState; all or none (``SequenceNotFound``
        naming ``field(i)`` of the first id not open). Each sequence's step, in order."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            found = self._found(owner, [seq_id for seq_id, _ in changes], field)
            for seq, (_, change) in zip(found, changes):
                old = seq.state.nbytes
                seq.state = change(seq.state)
                seq.counted += seq.state.nbytes - old
                self._bytes += seq.state.nbytes - old
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

    def check_open(self, sequences: list[Sequence], field: str = "sequence_ids") -> None:
        """On the launch thread: ``SequenceNotFound`` for the first of ``sequences`` that ended
        (closed or expired) while its call waited."""
        with self._lock:
            for row, seq in enumerate(sequences):
                if seq.ended is not None:
                    raise SequenceNotFound(f"{field}[{row}]: sequence {seq.id} was {seq.ended} while this call "
                                           f"waited for its launch; {OPEN_FIRST}")

    def advance(self, sequences: list[Sequence], tokens: list[int], on_device: torch.Tensor) -> None:
        """On the launch thread, after the draw: each row's token (``tokens``, and the same on
        the device) appended to its sequence's output unless it is -1 (no token), and every
        step advanced by one. The appends run outside the lock (only this thread writes an
        output); the bytes they add are counted under it, for the sequences still open."""
        grown = []
        for row, (seq, token) in enumerate(zip(sequences, tokens)):
            if token >= 0:
                grown.append((seq, seq.append(on_device[row:row + 1], token)))
            seq.step += 1
        self._count(grown)

    def reserve(self, sequences: list[Sequence]) -> None:
        """Room for one more token in each of ``sequences``' outputs (:meth:`Sequence.reserve`),
        the bytes grown counted for those still open."""
        self._count([(seq, seq.reserve()) for seq in sequences])

    def counted(self, sequences: list[Sequence], tokens: list[int]) -> None:
        """After a launch that stored each row's token after its output (-1: none): the tokens
        counted, every step advanced by one."""
        for seq, token in zip(sequences, tokens):
            if token >= 0:
                seq.appended(token)
            seq.step += 1

    def _count(self, grown: list) -> None:
        with self._lock:
            for seq, nbytes in grown:
                if nbytes and seq.ended is None:
                    seq.counted += nbytes
                    self._bytes += nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._sweep(self.clock())
            return {"open_sequences": len(self._open), "sequence_bytes": self._bytes}
