"""Re-running a lone client's latest call, in part, while the event loop polls for its next one.

A lone client leaves the server idle for its whole round trip (700 us and more on the H100 host).
A polling event loop (busy_poll.py) sees the next call at once, but that call's Python then runs
out of cold caches: on that host a lone Sample call's own path costs two to three times what it
costs back to back. So every ``--keep-warm-us`` of polling, :meth:`KeepWarm.rehearse` runs the
latest call's pure steps again on its own bytes, parse, validation and answer, and throws away
what they make. Nothing reaches the device, the batcher, the metrics or the log.

Measured on the H100 host (2026-11-25, ``python3 bench/probes/keep_warm.py``): a lone Sample
1x128256 bf16 call through the guarded handler, batcher and captured graph, in process, after
700 us of polling epoll took 177 us (p50) and after 700 us of polling with these steps run every
100 us, 146 us; running the whole call instead (its launch too) gave 145 us, warming the driver's
launch call alone (a one-kernel graph replayed every 100 us) 174 us.

Only requests up to :data:`MAX_REHEARSED_BYTES` are kept: the rehearsal of a big one would hold
the loop long enough to delay the next call. A rehearsal in progress delays a call that arrives
meanwhile by what is left of it (tens of us).
"""

from __future__ import annotations

import logging
from typing import Callable

from .logs import get_logger, log_event

log = get_logger("keep_warm")

# The largest request kept for rehearsal: a Sample row of 151936 float32 logits is 608 KB.
MAX_REHEARSED_BYTES = 1 << 20


class KeepWarm:
    """The latest call of any RPC whose reader ``readers`` names (rpc name -> request
    deserializer), and :meth:`rehearse`, which re-runs its parse, validation and answer while
    ``is_idle()``."""

    def __init__(self, readers: dict[str, Callable], limits, is_idle: Callable[[], bool]):
        self._readers = readers
        self._limits = limits
        self._is_idle = is_idle
        self._latest: tuple | None = None  # (reader, op, raw, result)

    def remember(self, rpc: str, op, raw: bytes, result) -> None:
        """Keep a call of ``rpc`` (request bytes ``raw``, validated by ``op.from_pb``, answered
        by ``result.to_pb()``) as the one to rehearse."""
        if len(raw) <= MAX_REHEARSED_BYTES:
            self._latest = (self._readers[rpc], op, raw, result)

    def rehearse(self) -> None:
        """Parse, validate and answer the latest call again, if the server holds no call."""
        latest = self._latest
        if latest is None or not self._is_idle():
            return
        read, op, raw, result = latest
        try:
            request = read(raw)
            op.from_pb(request.message, self._limits, in_place=request.tensor_bytes)
            result.to_pb().SerializeToString()
        except Exception as exc:  # noqa: BLE001 - a rehearsal must never reach the loop
            self._latest = None
            log_event(log, "rehearsal_failed", level=logging.WARNING, error=repr(exc))
