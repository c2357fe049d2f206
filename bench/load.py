"""Load and soak: N concurrent clients for T seconds against a server subprocess on 127.0.0.1.

    python -m bench.load --clients 16 --seconds 60 --json load.json

Every client (an :class:`~logitserve.client.AsyncClient` plus a raw channel, one per client, on
one asyncio loop) sends a random mix of every RPC (Sample seeded, unseeded, per-row, greedy,
InfiniCore ``random_val``, with NaN rows; RouteExperts; Softmax on any axis; CausalSoftmax; Silu
and broadcasting SwiGLU; Step; a 3-step StreamSteps; GetServerInfo; grpc.health Check), in
float32, bfloat16 and float16, with about one request in six invalid (data shorter than the
shape, an unknown dtype, top_p 0, k > E, rows over --max-rows, garbage bytes). Each answer is
checked against the kernels called in this process on the same inputs and seeds
(``backend="torch"``, as the server runs on the CPU): tokens and indices exactly, floats within a
few ulps (batching stacks rows, which can move the vectorised tail of a row); each invalid
request must get its status code. Unseeded samples are replayed here with the seeds the server
returns.

While the clients run, the server's resident memory is read from ``/proc/<pid>/status`` every
0.5 s; the report gives it at the end of the warm-up and at the end, and the slope after warm-up.

The queue probe then starts a second server with ``--max-queue 4 --max-batch-rows 1`` whose
launches each sleep 500 ms (``bench.server_process --launch-delay-ms``), fires 24 calls at once
and times the RESOURCE_EXHAUSTED answers: a full queue must refuse at once, not time out.

Exit status 0 when there was no unexpected status, no wrong answer, and RSS growth after warm-up
stayed under ``--rss-growth-limit-mib``; 1 otherwise. Traffic stays on loopback; the run is
bounded by ``--seconds`` (and each call by ``--call-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
from typing import Any, Awaitable, Callable

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logitserve import kernels
from logitserve.client import AsyncClient, LogitServeError
from logitserve.client.codec import encode
from logitserve.v1 import logitserve_pb2 as pb

from .server_process import ServerProcess

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
SERVICE = "/logitserve.v1.LogitServe/"
MAX_ROWS = 64  # the load server's --max-rows: the "too many rows" requests go over it
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# rtol, atol per dtype: a few ulps, since batching may move a row into a vectorised loop's tail.
TOLERANCE = {torch.float32: (4e-6, 1e-7), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-6),
             torch.float64: (1e-12, 1e-15)}


@dataclasses.dataclass
class LoadConfig:
    clients: int = 16
    seconds: float = 60.0
    warmup_seconds: float = 10.0  # RSS is judged from here on
    seed: int = 0
    pool: int = 96  # distinct valid requests, with their reference answers
    call_timeout: float = 30.0
    queue_probe: bool = True
    server_args: tuple[str, ...] = ()


@dataclasses.dataclass
class Case:
    """One request of the mix: how to send it and how to judge the outcome."""

    rpc: str
    name: str
    send: Callable[["Worker"], Awaitable[Any]]
    check: Callable[[Any], str | None] = lambda result: None  # None: right; else what is wrong
    expect: grpc.StatusCode = OK


class Worker:
    """One client: the library's AsyncClient and a raw channel (invalid bytes, health)."""

    def __init__(self, target: str, timeout: float):
        self.client = AsyncClient(target, timeout=timeout, retries=0)
        self.channel = grpc.aio.insecure_channel(target)
        self.timeout = timeout
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def raw(self, rpc: str, data: bytes) -> bytes:
        method = self.channel.unary_unary(SERVICE + rpc, request_serializer=None, response_deserializer=None)
        return await method(data, timeout=self.timeout)

    async def close(self) -> None:
        await self.client.close()
        await self.channel.close()


# ------------------------------------------------------------------------------------ checks


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _close(got: np.ndarray, want: torch.Tensor, what: str) -> str | None:
    rtol, atol = TOLERANCE[want.dtype]
    want = _np(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, expected {want.shape}"
    if not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        bad = int(np.sum(~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)))
        return f"{what}: {bad} of {want.size} values off (max abs diff {np.nanmax(np.abs(got - want)):.3g})"
    return None


def _equal(got: np.ndarray, want: torch.Tensor, what: str) -> str | None:
    want = want.numpy()
    if got.shape != want.shape or not np.array_equal(got, want):
        return f"{what}: {got.tolist()} != expected {want.tolist()}"
    return None


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


# ------------------------------------------------------------------------------- valid cases


def _logits(rng: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=rng) * 3).to(dtype)


def _sample_case(rng: torch.Generator, r: random.Random) -> Case:
    rows, vocab, dtype = r.randint(1, 4), r.choice((37, 1000, 4096)), r.choice(DTYPES)
    logits = _logits(rng, rows, vocab, dtype)
    flavour = r.choice(("scalar", "per-row", "greedy", "random_val", "nan row", "unseeded"))
    kw: dict[str, Any] = dict(seed=r.randrange(2**63), step=r.randrange(1000))
    if flavour == "scalar":
        kw.update(temperature=r.choice((0.7, 1.0, 1.3)), top_k=r.choice((0, 5, 50)), top_p=r.choice((0.8, 1.0)),
                  min_p=r.choice((0.0, 0.05)), filter_order=r.choice(("top_k_first", "joint")))
    elif flavour in ("per-row", "nan row", "unseeded"):
        kw.update(temperature=torch.tensor([r.choice((0.0, 0.6, 1.0, 1.5)) for _ in range(rows)], dtype=torch.float64),
                  top_k=torch.tensor([r.choice((0, 1, 10, 100)) for _ in range(rows)]),
                  top_p=torch.tensor([r.choice((0.5, 0.9, 1.0)) for _ in range(rows)], dtype=torch.float64),
                  min_p=torch.tensor([r.choice((0.0, 0.1)) for _ in range(rows)], dtype=torch.float64),
                  seed=torch.tensor([r.randrange(2**63) for _ in range(rows)]),
                  step=torch.tensor([r.randrange(1000) for _ in range(rows)]))
        if flavour == "nan row":
            logits[r.randrange(rows), r.randrange(vocab)] = float("nan")
    elif flavour == "greedy":
        kw.update(temperature=0.0)
    else:
        kw.update(random_val=torch.rand(rows, generator=rng, dtype=torch.float64) * 0.999,
                  temperature=r.choice((0.5, 1.0)), top_k=r.choice((0, 20)), top_p=r.choice((0.7, 1.0)))
    if flavour == "unseeded":
        del kw["seed"]
        sent = dict(kw)

        def check(result) -> str | None:  # replay the row with the seeds the server drew
            want = kernels.sample(logits, **{**sent, "seed": torch.from_numpy(result.seeds.copy())}, backend="torch")
            return _first(_equal(result.token_ids, want, "token_ids"),
                          _equal(result.valid, want >= 0, "valid"))
    else:
        want = kernels.sample(logits, **kw, backend="torch")

        def check(result) -> str | None:
            seeds = kw["seed"] if isinstance(kw.get("seed"), torch.Tensor) else None
            return _first(_equal(result.token_ids, want, "token_ids"), _equal(result.valid, want >= 0, "valid"),
                          None if seeds is None else _equal(result.seeds, seeds, "seeds"))
    return Case("Sample", f"sample {flavour}", lambda w: w.client.sample(logits, **kw), check)


def _route_case(rng: torch.Generator, r: random.Random) -> Case:
    experts = r.choice((8, 64, 128, 256))
    k, renorm = r.randint(1, min(8, experts)), r.random() < 0.5
    g = _logits(rng, r.randint(1, 16), experts, r.choice(DTYPES))
    weights, indices = kernels.topk_softmax(g, k, renormalize=renorm, backend="torch")

    def check(result) -> str | None:
        return _first(_equal(result[1], indices, "indices"), _close(result[0], weights, "weights"))
    return Case("RouteExperts", "route_experts", lambda w: w.client.route_experts(g, k, renorm), check)


def _tensor_case(rng: torch.Generator, r: random.Random) -> Case:
    dtype = r.choice(DTYPES)
    op = r.choice(("softmax", "causal_softmax", "silu", "swiglu"))
    if op == "softmax":
        last = r.random() < 0.6  # wide rows along the last axis; any axis of a small tensor
        x = _logits(rng, r.randint(1, 6), r.choice((5, 300, 2048) if last else (5, 17, 60)), dtype)
        if r.random() < 0.3:
            x = x.reshape(1, *x.shape)
        dim = -1 if last else r.randrange(-x.ndim, x.ndim)
        want = kernels.softmax(x, dim=dim, backend="torch")
        return Case("Softmax", "softmax", lambda w: w.client.softmax(x, dim=dim), lambda got: _close(got, want, "out"))
    if op == "causal_softmax":
        s = r.randint(1, 8)
        x = _logits(rng, s, s + r.randint(0, 8), dtype)
        if r.random() < 0.5:
            x = torch.stack([x, x * 0.5])
        want = kernels.causal_softmax(x, backend="torch")
        return Case("CausalSoftmax", "causal_softmax", lambda w: w.client.causal_softmax(x),
                    lambda got: _close(got, want, "out"))
    x = _logits(rng, r.randint(1, 8), r.choice((16, 1000)), dtype)
    if op == "silu":
        want = kernels.silu(x, backend="torch")
        return Case("Silu", "silu", lambda w: w.client.silu(x), lambda got: _close(got, want, "out"))
    up = _logits(rng, 1, x.shape[1], dtype) if r.random() < 0.5 else _logits(rng, *x.shape, dtype)
    want = kernels.swiglu(x, up, backend="torch")
    return Case("Silu", "swiglu", lambda w: w.client.swiglu(x, up), lambda got: _close(got, want, "out"))


def _step_kwargs(rng: torch.Generator, r: random.Random):
    """Arguments of one Step (a seeded sample, a routing, a softmax) and a check of its answer."""
    logits = _logits(rng, r.randint(1, 3), 500, torch.float32)
    seed, temperature, top_p = r.randrange(2**63), r.choice((0.0, 0.8)), r.choice((0.9, 1.0))
    g = _logits(rng, r.randint(1, 8), 64, torch.bfloat16)
    x = _logits(rng, 2, 33, torch.float16)
    want_tokens = kernels.sample(logits, temperature=temperature, top_p=top_p, seed=seed, backend="torch")
    want_w, want_i = kernels.topk_softmax(g, 6, renormalize=True, backend="torch")
    want_x = kernels.softmax(x, backend="torch")
    kwargs = dict(sample=dict(logits=logits, temperature=temperature, top_p=top_p, seed=seed),
                  route_experts=dict(gate_logits=g, k=6, renormalize=True), softmax=dict(x=x))

    def check(result) -> str | None:
        return _first(_equal(result.sample.token_ids, want_tokens, "step.sample.token_ids"),
                      _equal(result.route_experts[1], want_i, "step.route_experts.indices"),
                      _close(result.route_experts[0], want_w, "step.route_experts.weights"),
                      _close(result.softmax, want_x, "step.softmax"))
    return kwargs, check


def _step_case(rng: torch.Generator, r: random.Random) -> Case:
    kwargs, check = _step_kwargs(rng, r)
    return Case("Step", "step", lambda w: w.client.step(id="s", **kwargs), check)


def _stream_case(rng: torch.Generator, r: random.Random) -> Case:
    steps = [_step_kwargs(rng, r) for _ in range(3)]

    async def send(w: Worker):
        return [res async for res in w.client.stream_steps([dict(id=str(i), **kw) for i, (kw, _) in enumerate(steps)])]

    def check(results) -> str | None:
        if [res.id for res in results] != ["0", "1", "2"]:
            return f"stream ids {[res.id for res in results]}"
        return _first(*(c(res) for (_, c), res in zip(steps, results)))
    return Case("StreamSteps", "stream_steps", send, check)


def _info_case() -> Case:
    def check(info) -> str | None:
        return None if info.version and info.limits["max_rows"] == MAX_ROWS else f"server_info {info}"
    return Case("GetServerInfo", "server_info", lambda w: w.client.server_info(), check)


def _health_case() -> Case:
    async def send(w: Worker):
        return await w.health.Check(health_pb2.HealthCheckRequest(), timeout=w.timeout)

    def check(reply) -> str | None:
        return None if reply.status == health_pb2.HealthCheckResponse.SERVING else f"health {reply.status}"
    return Case("Health", "health", send, check)


# ----------------------------------------------------------------------------- invalid cases


def invalid_cases() -> list[Case]:
    x = torch.randn(2, 10)
    short = encode(x.numpy())
    short.data = short.data[:-4]
    unknown_dtype = encode(x.numpy())
    unknown_dtype.dtype = 99
    too_many_rows = torch.randn(MAX_ROWS + 1, 4)
    return [
        Case("Softmax", "data shorter than shape", lambda w: w.raw("Softmax", pb.SoftmaxRequest(
            x=short).SerializeToString()), expect=INVALID),
        Case("Sample", "unknown dtype", lambda w: w.raw("Sample", pb.SampleRequest(
            logits=unknown_dtype).SerializeToString()), expect=INVALID),
        Case("Sample", "top_p 0", lambda w: w.client.sample(x, top_p=0.0), expect=INVALID),
        Case("RouteExperts", "k > E", lambda w: w.client.route_experts(x, 11), expect=INVALID),
        Case("Softmax", "rows over --max-rows", lambda w: w.client.softmax(too_many_rows), expect=EXHAUSTED),
        Case("Step", "garbage bytes", lambda w: w.raw("Step", b"\xff\x00garbage"), expect=INVALID),
        Case("CausalSoftmax", "T < S", lambda w: w.client.causal_softmax(torch.randn(4, 3)), expect=INVALID),
    ]


def build_pool(config: LoadConfig) -> list[Case]:
    """The valid requests (with their reference answers), then the invalid ones."""
    rng = torch.Generator().manual_seed(config.seed)
    r = random.Random(config.seed)
    makers = [_sample_case] * 3 + [_route_case] * 2 + [_tensor_case] * 3 + [_step_case, _stream_case]
    pool = [makers[i % len(makers)](rng, r) for i in range(config.pool)]
    return pool + [_info_case(), _health_case()] * 3


# ------------------------------------------------------------------------------------ the run


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


def _rss_summary(samples: list[tuple[float, int]], warmup_s: float) -> dict:
    after = [(t, k) for t, k in samples if t >= warmup_s]
    if len(after) < 2:
        after = samples[len(samples) // 2:]
    t, kib = np.array([s[0] for s in after]), np.array([s[1] for s in after], dtype=float)
    slope = float(np.polyfit(t, kib, 1)[0]) * 60 / 1024 if len(after) >= 2 else 0.0
    return dict(samples=len(samples), start_mib=round(samples[0][1] / 1024, 1),
                warm_mib=round(after[0][1] / 1024, 1), end_mib=round(samples[-1][1] / 1024, 1),
                max_mib=round(max(k for _, k in samples) / 1024, 1),
                growth_after_warmup_mib=round((samples[-1][1] - after[0][1]) / 1024, 1),
                max_above_warm_mib=round((max(k for _, k in after) - after[0][1]) / 1024, 1),
                slope_mib_per_min=round(slope, 2),
                series_mib=[(round(t), round(k / 1024, 1)) for t, k in samples[::10]])  # every ~5 s


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
                        return "OK", (time.perf_counter() - t0) * 1e3, _close(out, want, "out")
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


def run(config: LoadConfig) -> dict:
    """Start the server, run the clients, sample RSS, probe the full queue; return the report."""
    pool, invalid = build_pool(config), invalid_cases()
    tally = Tally()
    args = ("--max-rows", str(MAX_ROWS), "--warmup-dtypes", "float32", *config.server_args)
    samples: list[tuple[float, int]] = []
    with ServerProcess(*args) as server:
        stop = threading.Event()
        t_start = time.monotonic()

        def sample_rss() -> None:
            while not stop.is_set():
                kib = server.rss_kib()
                if kib is not None:
                    samples.append((time.monotonic() - t_start, kib))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        try:
            asyncio.run(_drive(server.target, config, pool, invalid, tally))
        finally:
            stop.set()
            sampler.join()
        exit_code = server.terminate()
    elapsed = samples[-1][0] if samples else config.seconds
    lat = sorted(tally.latencies_ms)
    report = dict(
        clients=config.clients, seconds=config.seconds, calls=tally.calls, calls_per_s=round(tally.calls / elapsed, 1),
        ok=tally.ok, expected_errors=tally.expected_errors, unexpected=tally.unexpected, wrong=tally.wrong,
        by_rpc=dict(tally.by_rpc), by_status=dict(tally.by_status), pool=len(pool), invalid_kinds=len(invalid),
        latency_ms=dict(p50=round(lat[len(lat) // 2], 2), p99=round(lat[int(len(lat) * 0.99)], 2),
                        max=round(lat[-1], 2)) if lat else {},
        rss=_rss_summary(samples, config.warmup_seconds) if samples else {}, server_exit_code=exit_code,
        failures=tally.failures)
    if config.queue_probe:
        report["queue_probe"] = queue_probe()
    return report


def markdown(report: dict) -> str:
    rss, lat = report["rss"], report["latency_ms"]
    lines = [
        "| clients | seconds | calls | calls/s | OK (checked) | expected errors | unexpected | wrong | "
        "p50 / p99 ms | RSS warm -> end (MiB) | RSS slope (MiB/min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {report['clients']} | {report['seconds']:.0f} | {report['calls']} | {report['calls_per_s']} | "
        f"{report['ok']} | {report['expected_errors']} | {report['unexpected']} | {report['wrong']} | "
        f"{lat.get('p50')} / {lat.get('p99')} | {rss.get('warm_mib')} -> {rss.get('end_mib')} | "
        f"{rss.get('slope_mib_per_min')} |",
        "",
        "Calls by RPC: " + ", ".join(f"{k} {v}" for k, v in sorted(report["by_rpc"].items())),
        "Statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(report["by_status"].items())),
        "Server RSS (s: MiB): " + ", ".join(f"{t}: {m}" for t, m in rss.get("series_mib", [])),
    ]
    if "queue_probe" in report:
        q = report["queue_probe"]
        lines += ["", f"Queue probe: {q['calls']} calls at once, --max-queue {q['max_queue']}, "
                  f"{q['launch_delay_ms']:.0f} ms per launch: {q['served']} served (slowest {q['max_served_ms']} ms), "
                  f"{q['exhausted']} RESOURCE_EXHAUSTED (median {q['median_exhausted_ms']} ms, "
                  f"max {q['max_exhausted_ms']} ms), {q['unexpected']} other statuses, {q['wrong']} wrong."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup-seconds", type=float, default=10.0, help="RSS growth is measured after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--call-timeout", type=float, default=30.0)
    p.add_argument("--no-queue-probe", action="store_true")
    p.add_argument("--rss-growth-limit-mib", type=float, default=32.0)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 3600:
        p.error("--clients must be in [1, 256] and --seconds in (0, 3600]")
    config = LoadConfig(clients=args.clients, seconds=args.seconds, warmup_seconds=args.warmup_seconds,
                        seed=args.seed, call_timeout=args.call_timeout, queue_probe=not args.no_queue_probe)
    report = run(config)
    print(markdown(report))
    for failure in report["failures"][:20]:
        print("FAILURE:", failure)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = report["unexpected"] or report["wrong"] or report["server_exit_code"] != 0
    bad = bad or report["rss"].get("growth_after_warmup_mib", 0) > args.rss_growth_limit_mib
    bad = bad or report.get("queue_probe", {}).get("unexpected", 0) or report.get("queue_probe", {}).get("wrong", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
