"""What the open sequences may hold: at most ``--max-sequences`` of them and
``--max-sequence-bytes`` of their buffers, all callers together; with bearer tokens on, each
token at most its share (``--token-share``, server/tenancy.py) of each, so that no token can
take every sequence and lock the others out. Without tokens every caller is one identity and
the server-wide bounds alone apply.

A sequence's bytes are those of the buffers it holds, as allocated: its lists, its output's
whole room (capacity, not length: the room doubles as the output grows) and its last answer
(sequences/table.py ``Sequence.nbytes``). :class:`SequenceBounds` counts them by owner; the
table checks a change against it before it makes the change, under the table's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TooLarge
from ..tenancy import per_token_bound


@dataclass
class Holding:
    """What one owner (or everyone) holds: open sequences and their bytes."""

    sequences: int = 0
    bytes: int = 0


@dataclass
class SequenceBounds:
    """The bounds and the holdings they are checked against (under the table's lock)."""

    max_sequences: int
    max_bytes: int
    share: float = 1.0
    tokens_on: bool = False
    total: Holding = field(default_factory=Holding)
    _owners: dict = field(default_factory=dict)  # owner -> Holding, only owners holding something

    @property
    def owner_max_sequences(self) -> int:
        return per_token_bound(self.max_sequences, self.share, self.tokens_on)

    @property
    def owner_max_bytes(self) -> int:
        return per_token_bound(self.max_bytes, self.share, self.tokens_on)

    def holding(self, owner) -> Holding:
        """What ``owner`` holds (a copy)."""
        held = self._owners.get(owner)
        return Holding() if held is None else Holding(held.sequences, held.bytes)

    def holdings(self) -> dict:
        """Each owner holding something -> {"open_sequences": n, "sequence_bytes": b}."""
        return {owner: {"open_sequences": h.sequences, "sequence_bytes": h.bytes} for owner, h in self._owners.items()}

    def _share(self, flag: str, bound: int) -> str:
        return f"this token's share of the server's (--token-share {self.share} of {flag}: {bound})"

    def check(self, owner, sequences: int, nbytes: int, what: str) -> None:
        """``TooLarge`` unless ``owner`` may hold ``sequences`` more sequences and ``nbytes`` more
        bytes; ``what`` names the request (or the sequence) in the message."""
        held = self._owners.get(owner) or Holding()
        if sequences > 0:
            if self.total.sequences + sequences > self.max_sequences:
                raise TooLarge(f"{what}: {sequences} more would make {self.total.sequences + sequences} open, past "
                               f"the server's limit (--max-sequences {self.max_sequences}); close some first")
            if held.sequences + sequences > self.owner_max_sequences:
                raise TooLarge(f"{what}: {sequences} more would make {held.sequences + sequences} open for this "
                               f"caller, past {self._share('--max-sequences', self.owner_max_sequences)}; close "
                               f"some first")
        if nbytes > 0:
            if self.total.bytes + nbytes > self.max_bytes:
                raise TooLarge(f"{what}: {nbytes} more bytes would make the sequences' {self.total.bytes + nbytes}, "
                               f"past the server's limit (--max-sequence-bytes {self.max_bytes}); close or shorten "
                               f"some sequences first")
            if held.bytes + nbytes > self.owner_max_bytes:
                raise TooLarge(f"{what}: {nbytes} more bytes would make this caller's sequences' "
                               f"{held.bytes + nbytes}, past {self._share('--max-sequence-bytes', self.owner_max_bytes)}"
                               f"; close or shorten some sequences first")

    def room(self, owner) -> int:
        """The bytes ``owner`` may still add."""
        held = self._owners.get(owner) or Holding()
        return max(0, min(self.max_bytes - self.total.bytes, self.owner_max_bytes - held.bytes))

    def add(self, owner, sequences: int, nbytes: int) -> None:
        """Count ``sequences`` and ``nbytes`` more (fewer, when negative) for ``owner``."""
        held = self._owners.setdefault(owner, Holding())
        held.sequences += sequences
        held.bytes += nbytes
        self.total.sequences += sequences
        self.total.bytes += nbytes
        if held.sequences == 0 and held.bytes == 0:
            del self._owners[owner]
