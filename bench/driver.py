"""The service benchmarks' load generator: N unary calls with C in flight, timed one by one.

:func:`drive` runs on grpc.aio in this process over one or more channels (connections);
:func:`drive_processes` splits the calls over load-generator processes of their own, as one
Python process tops out near 3,000 calls/s of 256 KB requests. :class:`OtherLoad` says how much
CPU other processes took meanwhile: on a shared machine a case beside other work measures that
work too.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from .payloads import Payload, check_response

MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    # Each channel its own connection: channels of one process otherwise share one.
    ("grpc.use_local_subchannel_pool", 1),
]


class OtherLoad:
    """CPU used by processes other than the server and this one, as a fraction of the machine.

    On a shared machine (CI, several jobs) other work steals cores from a case and inflates its
    latency; this says how much, from /proc (Linux; None elsewhere), so a disturbed case can be
    run again (``--retries``) and the table shows what each number was measured beside.
    """

    def __init__(self, pids: Sequence[int]):
        self.pids = list(pids)
        self.start = self._sample()

    @staticmethod
    def _busy_total() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values) - idle, sum(values)

    def _own(self) -> int:
        ticks = 0
        for pid in self.pids:
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                # utime + stime (fields 14, 15), and cutime + cstime (16, 17): load-generator
                # processes (--load-processes) count once they are reaped.
                ticks += sum(int(v) for v in fields[11:15])
        return ticks

    def _sample(self) -> tuple[int, int, int] | None:
        try:
            busy, total = self._busy_total()
        except (OSError, ValueError):
            return None
        return busy, total, self._own()

    def fraction(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None or end[1] <= self.start[1]:
            return None
        busy, total, own = (e - s for e, s in zip(end, self.start))
        return max(busy - own, 0) / total




def loop_for(call: Callable[[], object], seconds: float) -> tuple[list[float], float]:
    """``call()`` again and again for ``seconds``: each call's seconds, and the loop's own."""
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times, time.perf_counter() - start


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, int(np.ceil(q / 100.0 * len(sorted_values))))
    return sorted_values[rank - 1]


async def drive(target: str, payload: Payload, concurrency: int, calls: int, warmup: int,
                max_seconds: float, check: bool, snapshot: Callable[[], dict] | None = None, channels: int = 1):
    """``calls`` unary calls with ``concurrency`` in flight, spread over ``channels`` channels
    (connections: a server of several processes on one port gets them spread by the kernel).

    Returns latencies (us), errors by code, wall seconds, and ``snapshot()`` taken after the
    warm-up and after the timed calls (nothing is in flight at either point).
    """
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
                  for _ in range(channels)]
        methods = [channel.unary_unary(payload.method) for channel in opened]  # bytes in, bytes out
        requests = payload.requests
        for i in range(warmup):
            raw = await methods[i % channels](requests[i % len(requests)], timeout=600)
            if check and i == 0:
                check_response(payload, raw)
        latencies: list[float] = []
        errors: dict[str, int] = {}
        issued = 0
        before = snapshot() if snapshot else {}
        start = time.perf_counter()
        deadline = start + max_seconds

        async def worker(call) -> None:
            nonlocal issued
            while issued < calls and time.perf_counter() < deadline:
                request = requests[issued % len(requests)]
                issued += 1
                t0 = time.perf_counter_ns()
                try:
                    await call(request, timeout=60)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    continue
                latencies.append((time.perf_counter_ns() - t0) / 1e3)

        await asyncio.gather(*(worker(methods[i % channels]) for i in range(concurrency)))
        wall = time.perf_counter() - start
        after = snapshot() if snapshot else {}
    return latencies, errors, wall, before, after


def _drive_in_process(target: str, payload: Payload, concurrency: int, calls: int, warmup: int,
                      max_seconds: float, channels: int):
    """:func:`drive` in a load-generator process of its own (see ``--load-processes``)."""
    latencies, errors, wall, _, _ = asyncio.run(drive(target, payload, concurrency, calls, warmup, max_seconds,
                                                      False, channels=channels))
    return latencies, errors, wall


def drive_processes(target: str, payload: Payload, concurrency: int, calls: int, warmup: int, max_seconds: float,
                    channels: int, processes: int):
    """The calls, the concurrency and the channels split over ``processes`` load generators
    (one Python process tops out near 3,000 calls/s of 256 KB requests); their latencies
    merged, their errors summed, the longest wall time."""
    share = [(concurrency * (i + 1)) // processes - (concurrency * i) // processes for i in range(processes)]
    args = [(target, payload, c, max(calls * c // concurrency, 1), warmup, max_seconds, max(channels // processes, 1))
            for c in share if c > 0]
    with multiprocessing.get_context("spawn").Pool(len(args)) as pool:
        parts = pool.starmap(_drive_in_process, args)
    errors: dict[str, int] = {}
    for _, e, _ in parts:
        for code, n in e.items():
            errors[code] = errors.get(code, 0) + n
    return [t for lat, _, _ in parts for t in lat], errors, max(w for _, _, w in parts)


class ClientFailed(RuntimeError):
    """A client process of :func:`in_client_process` raised; the message is its traceback."""


# Set to a file name, the client process of in_client_process samples its threads into it
# (bench.stack_profile; `python -m bench.stack_profile FILE` summarizes): where a client's time goes,
# beside the server's (servers.PROFILE_ENV).
CLIENT_PROFILE_ENV = "BENCH_CLIENT_STACK_SAMPLES"


def _client_entry(queue, fn: Callable, args: tuple) -> None:
    dump = None
    if os.environ.get(CLIENT_PROFILE_ENV):
        from .stack_profile import start
        dump = start(os.environ[CLIENT_PROFILE_ENV])
    try:
        result = fn(*args)
        if dump is not None:
            dump()  # before the parent reads the result and may stop this process
        queue.put(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def in_client_process(fn: Callable, *args, timeout: float = 3600):
    """``fn(*args)`` (a module-level function) in a spawned process of its own, which shares no
    process with any server, as a frontend would not: its result, or :class:`ClientFailed`."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_client_entry, args=(queue, fn, args))
    proc.start()
    status, result = queue.get(timeout=timeout)
    proc.join(60)
    if status != "ok":
        raise ClientFailed(result)
    return result


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server of several worker processes)."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            with open(f"/proc/{pids[i]}/task/{pids[i]}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except OSError:
            pass
        i += 1
    return pids


