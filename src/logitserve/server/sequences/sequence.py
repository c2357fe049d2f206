"""One sequence: its parameters, seed and step, and its lists (prompt, output, logit bias,
banned and stop tokens) as tensors on the server's device (the table of them: table.py).

The output has room to grow: the launch stores each drawn token after it, and the room is
made before the launch (:meth:`Sequence.grow`, which the table calls within its bounds). Its
last draw's answer is kept (:class:`Drawn`), so that a retry of the call that drew it is
answered the same, never drawn again (sequences/sample.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import NotFound, Unsupported
from ..regions import RegionExists

ID_BYTES = 8  # every list is int64 on the device
OPEN_FIRST = "open it first with OpenSequences"


class SequenceNotFound(NotFound):
    """No open sequence of that id for this caller: NOT_FOUND."""


class SequenceExists(RegionExists):
    """An id this caller has open already: ALREADY_EXISTS (the status guard.py gives RegionExists)."""


class StepMismatch(Unsupported):
    """A Sample's ``sequence_steps`` naming a step its sequence cannot draw or repeat:
    FAILED_PRECONDITION (the status guard.py gives Unsupported)."""


def not_open(field: str, seq_id: int) -> SequenceNotFound:
    return SequenceNotFound(f"{field}: no open sequence {seq_id} for this caller (never opened, closed, idle past "
                            f"--sequence-idle-s, or opened before the server restarted); {OPEN_FIRST}")


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


def held_bytes(tensors) -> int:
    """The bytes of ``tensors``' buffers (None: none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# A SequenceState's lists, by attribute.
STATE_LISTS = ("prompt", "bias_ids", "bias_values", "banned", "stop")


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

    @functools.cached_property
    def nbytes(self) -> int:  # a state is never changed (replaced whole): counted once
        return held_bytes(getattr(self, attr) for attr in STATE_LISTS)

    def nbytes_with(self, replaced: dict[str, int]) -> int:
        """The bytes this state would hold with the lists of ``replaced`` (attribute -> bytes)
        in place of its own."""
        return sum(replaced[attr] if attr in replaced else held_bytes((getattr(self, attr),)) for attr in STATE_LISTS)


class Drawn(NamedTuple):
    """A sequence's last draw, as its call was answered: kept so that a retry of that call is
    answered the same. A tuple: a call makes one a row (a frozen dataclass's init cost several
    times as much)."""

    step: int
    token: int
    seed: int
    asked: tuple  # (logprobs n or None, logprobs_mode, return_kept) of the call that drew it
    logprobs: tuple | None  # its row of the answer's (token_logprobs, ..., kept_bitmask): host tensors or None

    @property
    def nbytes(self) -> int:
        return 0 if self.logprobs is None else held_bytes(self.logprobs)


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
    counted: int = 0  # the bytes the table counts for it (its nbytes while open)
    last: Drawn | None = None  # its last draw (None: none since it opened)
    # The ordered step (server/ordered/) whose draw it is in and not yet counted ("ordered
    # session S, mark M"), or None: no other call may draw it meanwhile.
    ordered: str | None = None
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
        """The bytes of the buffers it holds, as allocated: its lists, its output's whole room,
        its last answer."""
        return self.state.nbytes + self.output_capacity * ID_BYTES + self.last_bytes  # the output is int64

    @property
    def last_bytes(self) -> int:
        return 0 if self.last is None else self.last.nbytes

    @property
    def full(self) -> bool:
        return self.output_len == self.output_capacity

    def outputs(self) -> torch.Tensor:
        return self.output[:self.output_len]

    def grow(self, capacity: int) -> None:
        """The output's room made ``capacity`` tokens (more than it holds). On the launch thread,
        or on the stream the launches run on (the old buffer is read by the copy)."""
        if self.output.is_cuda:  # freed below while the copy may still read it on this stream
            self.output.record_stream(torch.cuda.current_stream(self.output.device))
        bigger = torch.empty(capacity, dtype=self.output.dtype, device=self.output.device)
        bigger[:self.output_len] = self.outputs()
        self._keep_output(bigger)

    def append(self, token: torch.Tensor, value: int) -> None:
        """``token`` (a one-element tensor on the device, whose value is ``value``) stored after
        the output, which has room for it (made by the table's ``reserve``)."""
        self.output[self.output_len:self.output_len + 1] = token
        self.appended(value)

    def appended(self, value: int) -> None:
        """Token ``value`` was stored after the output (by the launch: sequences/lists.py)."""
        self.output_len += 1
        self.output_max_id = max(self.output_max_id, value)
