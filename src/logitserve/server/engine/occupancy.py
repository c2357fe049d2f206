"""How many calls the server is handling, counted by the guard (server/api/guard.py) as each RPC
enters and leaves (health checks aside: their Watch streams are long).

The count decides how a batch waits for the device (server/engine/batcher.py); when calls come and go
decides whether the event loop busy-polls (server/engine/busy_poll.py). app.py wires one
:class:`Occupancy` into both, so neither imports the guard.
"""

from __future__ import annotations

import math
import time


class Occupancy:
    """The calls the server is handling, how long it had been empty when the latest call that
    found it empty arrived, and when it last held more than one call."""

    def __init__(self) -> None:
        self.calls = 0
        self.idle_before = 0.0  # seconds
        self.crowded_at = -math.inf  # time.monotonic()
        self.channel_call_at = -math.inf  # when the latest same-host channel call arrived
        self._empty_since = time.monotonic()

    def enter(self) -> None:
        now = time.monotonic()
        if self.calls == 0:
            self.idle_before = now - self._empty_since
        else:
            self.crowded_at = now
        self.calls += 1

    def leave(self) -> None:
        self.calls -= 1
        if self.calls == 0:
            self._empty_since = time.monotonic()
