"""The busy-polling event loop (--busy-poll-us): it answers events inside and after its window,
honours timeouts, and sleeps while the server's launch thread works or no lone client calls;
the occupancy it decides that from."""

import asyncio
import socket
import threading
import time

from logitserve.server.engine.busy_poll import (LONE_CLIENT_CROWD_S, LONE_CLIENT_IDLE_S, BusyPollSelector, event_loop_factory,
                                        serves_a_lone_client)
from logitserve.server.config import ServerConfig
from logitserve.server.engine.occupancy import Occupancy


def test_occupancy_counts_calls_and_times_idleness_and_crowding():
    o = Occupancy()
    o.enter()
    assert o.calls == 1 and o.crowded_at == -float("inf")
    o.leave()
    time.sleep(0.02)
    before = time.monotonic()
    o.enter()
    assert o.idle_before >= 0.02 and o.crowded_at == -float("inf") and serves_a_lone_client(o)
    o.enter()  # a second call while the first is in
    assert o.calls == 2 and o.crowded_at >= before and not serves_a_lone_client(o)
    o.leave()
    o.leave()
    o.enter()
    assert o.calls == 1 and o.idle_before < LONE_CLIENT_IDLE_S and not serves_a_lone_client(o)
    o.crowded_at -= LONE_CLIENT_CROWD_S
    assert not serves_a_lone_client(o)  # no overlap for long, but the call came straight after another
    o.idle_before = LONE_CLIENT_IDLE_S
    assert serves_a_lone_client(o)


def _ready_after(delay_s: float, window_s: float, timeout: float | None):
    """What ``select(timeout)`` returns, and how long it took, when a byte arrives after ``delay_s``."""
    reader, writer = socket.socketpair()
    with reader, writer, BusyPollSelector(window_s) as selector:
        selector.register(reader, 1)
        timer = threading.Timer(delay_s, writer.send, (b"x",))
        timer.start()
        start = time.monotonic()
        ready = selector.select(timeout)
        took = time.monotonic() - start
        timer.join()
        return [key.fileobj for key, _ in ready] == [reader], took


def test_event_inside_the_window_is_seen_while_polling():
    seen, took = _ready_after(0.01, window_s=1.0, timeout=None)
    assert seen and took < 0.5


def test_event_after_the_window_wakes_the_sleeping_selector():
    seen, took = _ready_after(0.05, window_s=0.001, timeout=None)
    assert seen and took >= 0.04


def test_timeout_bounds_the_poll_and_the_sleep():
    seen, took = _ready_after(0.5, window_s=1.0, timeout=0.02)
    assert not seen and 0.015 < took < 0.4
    seen, took = _ready_after(0.5, window_s=0.001, timeout=0.02)
    assert not seen and 0.015 < took < 0.4


def test_loops_made_by_the_factory_run_coroutines_and_timers():
    async def main():
        await asyncio.sleep(0.01)
        return 7

    for window_us in (0, 500):
        with asyncio.Runner(loop_factory=event_loop_factory(window_us)) as runner:
            assert runner.run(main()) == 7


def _cpu_seconds_of_select(selector, timeout: float) -> float:
    reader, writer = socket.socketpair()
    with reader, writer:
        selector.register(reader, 1)
        start = time.thread_time()
        selector.select(timeout)
        selector.unregister(reader)
        return time.thread_time() - start


def test_polls_on_the_cpu_and_sleeps_while_held_off():
    with BusyPollSelector(window_s=0.2) as selector:
        assert _cpu_seconds_of_select(selector, 0.1) > 0.05  # polling: the core stays busy
        selector.hold_off = lambda: True
        assert _cpu_seconds_of_select(selector, 0.1) < 0.05  # asleep in epoll_wait


def test_server_polls_only_for_a_lone_client_and_not_while_its_launch_thread_works():
    from logitserve.server.app import create_server
    from logitserve.server.engine.busy_poll import BusyPollEventLoop

    async def main():
        service, _ = create_server(ServerConfig(device="cpu", port=0, warmup_dtypes=()))
        await service.start()
        try:
            hold_off = asyncio.get_running_loop().holding_off
            occupancy = service.occupancy
            assert hold_off()  # no call yet: nothing says a lone client calls
            occupancy.idle_before = LONE_CLIENT_IDLE_S  # a call after an idle gap, as a lone client's come
            assert not hold_off()
            started, release = threading.Event(), threading.Event()

            def work():
                started.set()
                release.wait(10)
            running = asyncio.ensure_future(service.handle.run(work))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
            assert hold_off() and service.handle.thread_busy
            release.set()
            await running
            assert not hold_off()
            occupancy.crowded_at = time.monotonic()  # two calls at once just now: load
            assert hold_off()
        finally:
            await service.stop(0)

    with asyncio.Runner(loop_factory=lambda: BusyPollEventLoop(500)) as runner:
        runner.run(main())
