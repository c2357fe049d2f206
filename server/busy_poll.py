"""An event loop that polls for a while before it sleeps (``--busy-poll-us``).

gRPC's poller thread hands each call to the event loop by writing to a socket the loop waits
on. A loop asleep in ``epoll_wait`` is woken by the kernel, and on the lent H100 host (a
virtual machine) a woken thread starts late: the loop, its core and its caches come back cold.
A loop that keeps polling (``epoll_wait`` with no timeout) for ``--busy-poll-us`` after its last
event sees the next call at once. A client calling one call after another leaves the server idle
for its round trip, 700 us and more on that host, so the window is 2 ms by default on CUDA.

Measured there (Sample 1x128256 bf16, concurrency 1, 10 rounds, ``python -m
bench.service_ablation --variants echo,full,full+spin2000 --concurrency 1 --rounds 10``,
2026-11-22): p50 1,328 us sleeping against 1,203 us polling, lower in every one of the ten
rounds (by 63 to 361 us, median 129), echo 839 us.

The price: one core at 100 % while calls come less than the window apart; an idle server
sleeps. On the CPU device the window is 0 (the kernels need the cores).
"""

from __future__ import annotations

import asyncio
import selectors
import time


class BusyPollSelector(selectors.DefaultSelector):
    """A selector whose blocking ``select`` first polls without blocking for ``window_s``."""

    def __init__(self, window_s: float):
        super().__init__()
        self._window_s = window_s

    def select(self, timeout=None):
        if timeout is not None and timeout <= 0:
            return super().select(0)
        start = time.monotonic()
        until = start + (self._window_s if timeout is None else min(self._window_s, timeout))
        while time.monotonic() < until:
            ready = super().select(0)
            if ready:
                return ready
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        return super().select(left)


def event_loop_factory(window_us: int):
    """A factory of the server's event loops: busy-polling for ``window_us`` (0: asyncio's own)."""
    if window_us == 0:
        return asyncio.new_event_loop
    return lambda: asyncio.SelectorEventLoop(BusyPollSelector(window_us * 1e-6))
