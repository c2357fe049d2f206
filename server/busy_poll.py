"""An event loop that polls for a while before it sleeps (``--busy-poll-us``).

gRPC's poller thread hands each call to the event loop by writing to a socket the loop waits
on. A loop asleep in ``epoll_wait`` is woken by the kernel, and on the lent H100 host (a
virtual machine) a woken thread starts late: the loop, its core and its caches come back cold.
A loop that keeps polling (``epoll_wait`` with no timeout) for ``--busy-poll-us`` after its last
event sees the next call at once. A client calling one call after another leaves the server idle
for its round trip, 700 us and more on that host; a window of 2000 us covers it.

Measured there, Sample 1x128256 bf16, p50 at concurrency 1 with a 2 ms window against none
(``python -m bench.service_ablation``, 2026-11-22): 1,203 against 1,328 us, lower in each of
10 rounds; in a later run 1,306 against 1,308 us; in a third (20 rounds, variants in random
order) 1,138 against 1,109 us by median, while against the previous commit the polling server
gained a median 57 us a round and the sleeping one 15. Under load (8 and 64 calls in flight, two
runs of 3 and 5 rounds) the polling server served 5-11 % fewer calls a second than the sleeping
one, by median. It stayed off by default then.

Since the loop holds off whenever the server does not serve a lone client (two calls at once in
the last 50 ms, server/guard.py), under load it sleeps as before, and three runs on the H100
host (2026-11-24, ``python -m bench.service_ablation``, 5 to 8 rounds, the server's own code
otherwise) gave at concurrency 1: -87 us (4 of 6 rounds lower), -169 us (8 of 8) and -103 us
(3 of 5; a 1 ms window -122, 5 of 5), and at 8 and 64 in flight x0.97 to x1.06 the calls a
second. A fourth run, after the default changed (20 rounds), gave -61 us (14 of 20). So it is
on by default, 2000 us; ``--busy-poll-us 0`` turns it off.

The price: one core at 100 % while calls come less than the window apart; an idle server
sleeps. While the device's launch thread works (batches under load, captures, warm-up) the loop
sleeps as usual: a loop polling in Python holds the GIL between polls, and a thread waiting for
it gets it only when it asks the holder to let go, after the 5 ms switch interval.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Callable


def _never() -> bool:
    return False


class BusyPollSelector(selectors.DefaultSelector):
    """A selector whose blocking ``select`` first polls without blocking for ``window_s``, unless
    ``hold_off()`` is true."""

    def __init__(self, window_s: float):
        super().__init__()
        self._window_s = window_s
        self.hold_off: Callable[[], bool] = _never

    def select(self, timeout=None):
        if (timeout is not None and timeout <= 0) or self.hold_off():
            return super().select(timeout)
        start = time.monotonic()
        until = start + (self._window_s if timeout is None else min(self._window_s, timeout))
        while time.monotonic() < until:
            ready = super().select(0)
            if ready:
                return ready
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        return super().select(left)


class BusyPollEventLoop(asyncio.SelectorEventLoop):
    """An event loop that polls for ``window_us`` before it sleeps (see the module's notes)."""

    def __init__(self, window_us: int):
        self.window_us = window_us
        self._selector_polling = BusyPollSelector(window_us * 1e-6)
        super().__init__(self._selector_polling)

    def hold_off_while(self, predicate: Callable[[], bool]) -> None:
        """Sleep at once, without polling, whenever ``predicate()`` is true."""
        self._selector_polling.hold_off = predicate

    def holding_off(self) -> bool:
        """Whether the loop would sleep at once now."""
        return self._selector_polling.hold_off()


def event_loop_factory(window_us: int) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of the server's event loops: busy-polling for ``window_us`` (0: asyncio's own)."""
    if window_us == 0:
        return asyncio.new_event_loop
    return lambda: BusyPollEventLoop(window_us)
