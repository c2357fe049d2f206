"""Busy polling (``--busy-poll-us``): the server's one strategy for a lone client, one call
after another.

gRPC's poller thread hands each call to the event loop by writing to a socket the loop waits
on. A loop asleep in ``epoll_wait`` is woken by the kernel, and on a virtual machine a woken
thread starts late, its core and caches cold. A loop that keeps polling (``epoll_wait`` with no
timeout) for ``--busy-poll-us`` after its last event sees the next call at once; a lone client
leaves the server idle for its whole round trip, which a window of 2000 us covers.

It applies only while the server serves a lone client (:func:`serves_a_lone_client`): under
load, polling made batches smaller and cost throughput. While the device's launch thread works
(batches under load, captures, warm-up) the loop sleeps as usual: a loop polling in Python holds
the GIL between polls, and a thread waiting for it gets it only after the 5 ms switch interval.
The price: one core at 100 % while calls come less than the window apart; an idle server sleeps.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Callable

from .occupancy import Occupancy

# A server serves a lone client when its latest call found it empty for at least
# LONE_CLIENT_IDLE_S and it has held no two calls at once for LONE_CLIENT_CROWD_S. Under load the
# next call mostly comes sooner; but not always, and gRPC hands a loaded server its calls one at
# a time more often than not, so overlap seen once keeps the server off the rule for a while.
LONE_CLIENT_IDLE_S = 300e-6
LONE_CLIENT_CROWD_S = 0.05


def serves_a_lone_client(occupancy: Occupancy) -> bool:
    """Whether no two calls were in the server at once for LONE_CLIENT_CROWD_S, and the latest
    call came after LONE_CLIENT_IDLE_S of idleness or a same-host channel brought a call within
    LONE_CLIENT_CROWD_S (a channel's lone client calls again within microseconds, which the idle
    rule, made for gRPC's round trips, would take for load)."""
    now = time.monotonic()
    return (now - occupancy.crowded_at >= LONE_CLIENT_CROWD_S
            and (occupancy.idle_before >= LONE_CLIENT_IDLE_S or now - occupancy.channel_call_at < LONE_CLIENT_CROWD_S))


def _never() -> bool:
    return False


class BusyPollSelector(selectors.DefaultSelector):
    """A selector whose blocking ``select`` first polls without blocking for ``window_s``, unless
    ``hold_off()`` is true."""

    def __init__(self, window_s: float):
        super().__init__()
        self._window_s = window_s
        self.hold_off: Callable[[], bool] = _never
        # Checked between polls: true when it found work elsewhere (a same-host channel's call)
        # and scheduled it on the loop, which then runs it without waiting for an event.
        self.also_poll: Callable[[], bool] = _never

    def select(self, timeout=None):
        if (timeout is not None and timeout <= 0) or self.hold_off():
            return super().select(timeout)
        start = time.monotonic()
        until = start + (self._window_s if timeout is None else min(self._window_s, timeout))
        while time.monotonic() < until:
            ready = super().select(0)
            if ready or self.also_poll():
                return ready
        left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
        return super().select(left)


class BusyPollEventLoop(asyncio.SelectorEventLoop):
    """An event loop that polls for ``window_us`` before it sleeps (see the module's docstring)."""

    def __init__(self, window_us: int):
        self.window_us = window_us
        self._selector_polling = BusyPollSelector(window_us * 1e-6)
        super().__init__(self._selector_polling)

    def hold_off_while(self, predicate: Callable[[], bool]) -> None:
        """Sleep at once, without polling, whenever ``predicate()`` is true."""
        self._selector_polling.hold_off = predicate

    def poll_also(self, check: Callable[[], bool]) -> None:
        """While polling, also call ``check()``, which schedules what it finds on the loop."""
        self._selector_polling.also_poll = check

    def holding_off(self) -> bool:
        """Whether the loop would sleep at once now."""
        return self._selector_polling.hold_off()

    def poll_for_a_lone_client(self, occupancy: Occupancy, thread_busy: Callable[[], bool]) -> None:
        """Poll only while the server serves a lone client and ``thread_busy()`` (the device's
        launch thread has work) is false."""
        self.hold_off_while(lambda: thread_busy() or not serves_a_lone_client(occupancy))


def event_loop_factory(window_us: int) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of the server's event loops: busy-polling for ``window_us`` (0: asyncio's own)."""
    if window_us == 0:
        return asyncio.new_event_loop
    return lambda: BusyPollEventLoop(window_us)
