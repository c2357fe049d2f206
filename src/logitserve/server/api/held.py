"""Bytes of answers the server holds for calls not yet finished, bounded server-wide, per
connection (--max-held-answer-bytes, --max-held-answer-bytes-per-connection) and, with bearer
tokens on, per token (its --token-share of the server-wide bound: server/tenancy.py).

An answer is held from before its work (its size is known at validation: ``answer_size``) until
its RPC ends, which for a client that never reads (an HTTP/2 receive window left shut) is never
while the connection lasts: gRPC keeps the unsent bytes. Past any bound a new call is
RESOURCE_EXHAUSTED before any work, so stuck clients pin at most the bound (about twice it in
memory: the serialized answer and gRPC's copy of it, docs/RELIABILITY.md), and one token's
connections at most its share of it. Without tokens every caller is one identity: the
server-wide and per-connection bounds alone apply.
"""

from __future__ import annotations

from ..errors import TooLarge
from ..regions.servicer import caller
from ..tenancy import per_token_bound


class HeldAnswers:
    def __init__(self, max_bytes: int, max_bytes_per_connection: int, share: float = 1.0, tokens_on: bool = False):
        self.max_bytes, self.max_bytes_per_connection = max_bytes, max_bytes_per_connection
        self.share = share
        self.max_bytes_per_owner = per_token_bound(max_bytes, share, tokens_on)
        self.total = 0
        self._by_peer: dict[str, int] = {}  # connections holding some
        self._by_owner: dict[str | None, int] = {}  # owners holding some

    def hold_until_done(self, context, size: int) -> None:
        """Count ``size`` answer bytes for the call of ``context`` until its RPC ends; refuse
        (TooLarge) past any bound. Event-loop only."""
        release = self.hold(context, size)
        context.add_done_callback(lambda _context: release())

    def hold(self, context, size: int):
        """Count ``size`` answer bytes for the call of ``context`` (its connection and its
        caller's owner) until the returned function is called (once); refuse (TooLarge) past
        any bound."""
        peer, owner = context.peer() or "", caller(context)
        if self.total + size > self.max_bytes:
            raise TooLarge(f"answers held for unfinished calls: {self.total} bytes, and this answer's {size} "
                           f"would pass this server's limit of {self.max_bytes} (--max-held-answer-bytes)")
        held = self._by_peer.get(peer, 0)
        if held + size > self.max_bytes_per_connection:
            raise TooLarge(f"answers held for this connection's unfinished calls: {held} bytes, and this "
                           f"answer's {size} would pass the limit of {self.max_bytes_per_connection} "
                           f"(--max-held-answer-bytes-per-connection)")
        by_owner = self._by_owner.get(owner, 0)
        if by_owner + size > self.max_bytes_per_owner:
            raise TooLarge(f"answers held for this token's unfinished calls: {by_owner} bytes, and this answer's "
                           f"{size} would pass its share of the server's limit (--token-share {self.share} of "
                           f"--max-held-answer-bytes {self.max_bytes}: {self.max_bytes_per_owner})")
        self.total += size
        self._by_peer[peer] = held + size
        self._by_owner[owner] = by_owner + size
        return lambda: self._release(peer, owner, size)

    def _release(self, peer: str, owner: str | None, size: int) -> None:
        self.total -= size
        for counts, key in ((self._by_peer, peer), (self._by_owner, owner)):
            left = counts[key] - size
            if left:
                counts[key] = left
            else:
                del counts[key]

    @property
    def connections(self) -> int:
        return len(self._by_peer)

    def holdings(self) -> dict:
        """Each owner with answers held -> {"held_answer_bytes": b} (/metrics)."""
        return {owner: {"held_answer_bytes": size} for owner, size in list(self._by_owner.items())}
