"""A mixed load against a server process (``tests/load_mix.py``'s requests), every answer checked.

Clients (each a :class:`~load_mix.Worker`) pick requests from the mix for ``seconds``, about one
in six invalid; each outcome is tallied against what its case expects. Then :func:`queue_probe`
fills a slow server's queue and times the RESOURCE_EXHAUSTED answers. test_faults runs it for a
few seconds; ``python -m bench.load`` runs it as a soak, watching the server's memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import random
import statistics
import time
from typing import Callable

import grpc
import torch

from logitserve import kernels
from logitserve.client import AsyncClient, LogitServeError
from logitserve.server.process import ServerProcess

from load_mix import MAX_ROWS, OK, Case, Worker, build_pool, close_enough, invalid_cases


@dataclasses.dataclass
class Tally:
    calls: int = 0
    ok: int = 0
    expected_errors: int = 0
    unexpected: int = 0
    wrong: int = 0
    by_rpc: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_status: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)

    def fail(self, text: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(text)


async def _one(worker: Worker, case: Case, tally: Tally) -> None:
    t0 = time.perf_counter()
    try:
        result = await case.send(worker)
        code = OK
    except LogitServeError as exc:
        code, result = exc.code, exc.details
    except grpc.RpcError as exc:
        code, result = exc.code(), exc.details()
    tally.latencies_ms.append((time.perf_counter() - t0) * 1e3)
    tally.calls += 1
    tally.by_rpc[case.rpc] += 1
    tally.by_status[code.name] += 1
    if code != case.expect:
        tally.unexpected += 1
        tally.fail(f"{case.name}: {code.name} ({result}), expected {case.expect.name}")
    elif code == OK:
        problem = case.check(result)
        if problem:
            tally.wrong += 1
            tally.fail(f"{case.name}: wrong answer: {problem}")
        else:
            tally.ok += 1
    else:
        tally.expected_errors += 1


async def _drive(target: str, config: LoadConfig, pool: list[Case], invalid: list[Case], tally: Tally) -> None:
    deadline = time.monotonic() + config.seconds

    async def client(i: int) -> None:
        r = random.Random(config.seed * 1000 + i)
        worker = Worker(target, config.call_timeout)
        try:
            while time.monotonic() < deadline:
                case = r.choice(invalid) if r.random() < 1 / 6 else r.choice(pool)
                await _one(worker, case, tally)
        finally:
            await worker.close()

    await asyncio.gather(*(client(i) for i in range(config.clients)))


def queue_probe(calls: int = 24, launch_delay_ms: float = 500, max_queue: int = 4) -> dict:
    """Fire ``calls`` at once at a server whose queue holds ``max_queue`` and whose every launch
    (one call each) sleeps ``launch_delay_ms``; time the RESOURCE_EXHAUSTED answers."""
    args = ("--max-queue", str(max_queue), "--max-batch-rows", "1", "--max-delay-us", "0", "--warmup-dtypes", "none")
    x = torch.randn(1, 8)
    want = kernels.softmax(x, backend="torch")
    with ServerProcess(*args, launch_delay_ms=launch_delay_ms) as server:
        async def fire():
            async with AsyncClient(server.target, timeout=60, retries=0) as c:
                await c.server_info()  # connected before the burst

                async def one():
                    t0 = time.perf_counter()
                    try:
                        out = await c.softmax(x)
                        return "OK", (time.perf_counter() - t0) * 1e3, close_enough(out, want, "out")
                    except LogitServeError as exc:
                        return exc.code.name, (time.perf_counter() - t0) * 1e3, None
                return await asyncio.gather(*(one() for _ in range(calls)))
        results = asyncio.run(fire())
    exhausted = sorted(ms for code, ms, _ in results if code == "RESOURCE_EXHAUSTED")
    served = sorted(ms for code, ms, _ in results if code == "OK")
    return dict(calls=calls, max_queue=max_queue, launch_delay_ms=launch_delay_ms, exhausted=len(exhausted),
                served=len(served), wrong=sum(1 for *_, p in results if p),
                unexpected=sum(1 for code, *_ in results if code not in ("OK", "RESOURCE_EXHAUSTED")),
                median_exhausted_ms=round(statistics.median(exhausted), 1) if exhausted else None,
                max_exhausted_ms=round(exhausted[-1], 1) if exhausted else None,
                max_served_ms=round(served[-1], 1) if served else None)


@dataclasses.dataclass
class LoadConfig:
    clients: int = 4
    seconds: float = 6.0
    seed: int = 0
    pool: int = 96  # distinct valid requests, with their reference answers
    call_timeout: float = 30.0
    queue_probe: bool = True
    server_args: tuple[str, ...] = ()


def run(config: LoadConfig, watch: Callable[[ServerProcess], contextlib.AbstractContextManager] | None = None) -> dict:
    """Start the server, run the clients, stop it, probe the full queue; return the tally.

    ``watch(server)``, when given, is a context manager held while the clients run (the soak
    samples the server's memory in it)."""
    pool, invalid = build_pool(config.seed, config.pool), invalid_cases()
    tally = Tally()
    args = ("--max-rows", str(MAX_ROWS), "--warmup-dtypes", "float32", *config.server_args)
    with ServerProcess(*args) as server:
        t0 = time.monotonic()
        with watch(server) if watch is not None else contextlib.nullcontext():
            asyncio.run(_drive(server.target, config, pool, invalid, tally))
        elapsed = time.monotonic() - t0
        exit_code = server.terminate()
    lat = sorted(tally.latencies_ms)
    report = dict(clients=config.clients, seconds=config.seconds, calls=tally.calls,
                  calls_per_s=round(tally.calls / elapsed, 1), ok=tally.ok, expected_errors=tally.expected_errors,
                  unexpected=tally.unexpected, wrong=tally.wrong, by_rpc=dict(tally.by_rpc),
                  by_status=dict(tally.by_status), pool=len(pool), invalid_kinds=len(invalid),
                  latency_ms=dict(p50=round(lat[len(lat) // 2], 2), p99=round(lat[int(len(lat) * 0.99)], 2),
                                  max=round(lat[-1], 2)) if lat else {},
                  server_exit_code=exit_code, failures=tally.failures)
    if config.queue_probe:
        report["queue_probe"] = queue_probe()
    return report
