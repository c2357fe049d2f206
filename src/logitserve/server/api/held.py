"""Bytes of answers the server holds for calls not yet finished, bounded server-wide and per
connection (--max-held-answer-bytes, --max-held-answer-bytes-per-connection).

An answer is held from before its work (its size is known at validation: ``answer_size``) until
its RPC ends, which for a client that never reads (an HTTP/2 receive window left shut) is never
while the connection lasts: gRPC keeps the unsent bytes. Past either bound a new call is
RESOURCE_EXHAUSTED before any work, so stuck clients pin at most the bound (about twice it in
memory: the serialized answer and gRPC's copy of it, docs/RELIABILITY.md).
"""

from __future__ import annotations

from collections import defaultdict

from ..errors import TooLarge


class HeldAnswers:
    def __init__(self, max_bytes: int, max_bytes_per_connection: int):
        self.max_bytes, self.max_bytes_per_connection = max_bytes, max_bytes_per_connection
        self.total = 0
        self._by_peer: dict[str, int] = defaultdict(int)

    def hold_until_done(self, context, size: int) -> None:
        """Count ``size`` answer bytes for the call of ``context`` until its RPC ends; refuse
        (TooLarge) past either bound. Event-loop only."""
        release = self.hold(context.peer() or "", size)
        context.add_done_callback(lambda _context: release())

    def hold(self, peer: str, size: int):
        """Count ``size`` answer bytes for connection ``peer`` until the returned function is
        called (once); refuse (TooLarge) past either bound."""
        if self.total + size > self.max_bytes:
            raise TooLarge(f"answers held for unfinished calls: {self.total} bytes, and this answer's {size} "
                           f"would pass this server's limit of {self.max_bytes} (--max-held-answer-bytes)")
        held = self._by_peer[peer]
        if held + size > self.max_bytes_per_connection:
            raise TooLarge(f"answers held for this connection's unfinished calls: {held} bytes, and this "
                           f"answer's {size} would pass the limit of {self.max_bytes_per_connection} "
                           f"(--max-held-answer-bytes-per-connection)")
        self.total += size
        self._by_peer[peer] = held + size
        return lambda: self._release(peer, size)

    def _release(self, peer: str, size: int) -> None:
        self.total -= size
        left = self._by_peer[peer] - size
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]

    @property
    def connections(self) -> int:
        return len(self._by_peer)
