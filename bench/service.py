"""Service benchmark: latency and throughput of Sample and RouteExperts over gRPC, beside the floor.

    python -m bench.service --device cpu --out results.md
    python -m bench.service --device cuda:0 --calls 2000 --out results.md

Starts each server as a subprocess on 127.0.0.1 (an ephemeral port; ``bench/servers.py``), waits
for grpc.health.v1 SERVING, drives it from this process (``bench/driver.py``) (the load generator: grpc.aio, ``--channels`` channels, N calls in
flight), stops it, and prints one Markdown table. Servers:

- ``echo``: ``bench.echo_server``, the transport floor: it receives the same request bytes and
  answers 8 bytes, doing no work;
- ``batch off``: ``logitserve serve --max-batch-rows 1`` (every request is its own launch);
- ``batch on``: ``logitserve serve --max-batch-rows 256 --max-delay-us 0`` (the server's
  defaults: launch at once when the device is free, calls arriving meanwhile share the next
  launch; 256 rows let four 64-row RouteExperts requests share a launch, where 64 would not).

Payloads (``bench/payloads.py``): Sample 1x128256 in bfloat16 and float32 (a pool of requests whose temperature,
top_k, top_p and seed vary from call to call, so batched rows carry mixed parameters) and
RouteExperts 64x256 bfloat16, k=8. Each case runs at concurrency 1, 8 and 64 for ``--calls``
calls or ``--max-seconds``, whichever ends first, after ``--warmup`` calls. Requests are
serialized before timing and sent as raw bytes (responses are not parsed while timing), so the
numbers are the server plus the transport, not the client's protobuf work; the first
response of every case is parsed and checked.

For the service, the server's own Prometheus metrics (``--metrics-port``, scraped after the
warm-up and after the timed calls) add: ``requests/launch``, the mean batch the server formed;
``server mean us``, the mean time from a call's arrival in the server to its answer (parse,
queue, copy, kernel, reply; not the transport); ``queue mean us``, the part of that spent
waiting in the batcher.

``other load`` is the CPU that processes other than the server and the load generator used
during the case, as a share of the whole machine: on a shared machine a case beside other
work measures that work too. ``--retries N`` runs such a case again (over
``--max-other-load``) and keeps the least disturbed run.

Needs grpcio, grpcio-health-checking, protobuf and numpy here (not grpcio-tools: the
generated code is checked in); the server needs what ``logitserve serve`` needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import os
import platform
import shlex
import signal
import sys
from typing import Sequence

import grpc

from .driver import OtherLoad, drive, drive_processes, percentile, process_tree
from .payloads import Payload, payloads
from .servers import Running, ServerSpec, delta, echo_argv, mean_delta, running, scrape, serve_argv

CONCURRENCY = (1, 8, 64)


def server_specs(device: str, backend: str, extra: Sequence[str]) -> list[ServerSpec]:
    serve = serve_argv("--device", device, "--backend", backend, *extra)
    return [
        ServerSpec("echo", echo_argv(), is_echo=True),
        ServerSpec("batch off", serve + ["--max-batch-rows", "1", "--max-delay-us", "0"]),
        ServerSpec("batch on", serve + ["--max-batch-rows", "256", "--max-delay-us", "0"]),
    ]


@dataclasses.dataclass
class Result:
    server: str
    payload: str
    request_bytes: int
    concurrency: int
    calls: int
    errors: dict[str, int]
    p50_us: float
    p99_us: float
    calls_per_s: float
    requests_per_launch: float | None = None
    server_mean_us: float | None = None  # arrival to answer, measured inside the server
    queue_mean_us: float | None = None  # of that, waiting in the batcher
    other_load: float | None = None  # CPU other processes used meanwhile (OtherLoad)


def run_case(spec: ServerSpec, server: Running, payload: Payload, concurrency: int, args) -> Result:
    monitor: OtherLoad | None = None

    def snapshot() -> dict:
        nonlocal monitor
        if monitor is None:  # after the warm-up: the timed part starts
            monitor = OtherLoad([*process_tree(server.pid), os.getpid()])
        return scrape(server.metrics_urls)

    if args.load_processes > 1:
        before = snapshot()
        latencies, errors, wall = drive_processes(server.target, payload, concurrency, args.calls, args.warmup,
                                                  args.max_seconds, args.channels, args.load_processes)
        after = snapshot()
    else:
        latencies, errors, wall, before, after = asyncio.run(
            drive(server.target, payload, concurrency, args.calls, args.warmup, args.max_seconds, not spec.is_echo,
                  snapshot, channels=args.channels))
    latencies.sort()
    result = Result(spec.label, payload.name, payload.request_bytes, concurrency, len(latencies), errors,
                    percentile(latencies, 50), percentile(latencies, 99),
                    len(latencies) / wall if wall > 0 else float("nan"))
    result.other_load = monitor.fraction() if monitor is not None else None
    if server.metrics_urls:
        launches = delta(before, after, "logitserve_launches_total")
        if launches > 0:
            result.requests_per_launch = delta(before, after, "logitserve_batch_requests_sum") / launches
        server_s = mean_delta(before, after, "logitserve_request_latency_seconds")
        queue_s = mean_delta(before, after, "logitserve_queue_time_seconds")
        result.server_mean_us = None if server_s is None else server_s * 1e6
        result.queue_mean_us = None if queue_s is None else queue_s * 1e6
    return result




# ------------------------------------------------------------------------------------ report


def machine_line(args) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    return (f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {cpu}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, grpcio {grpc.__version__}, "
            f"server device {args.device} (backend {args.backend}), "
            f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start")


def _opt(value: float | None, fmt: str = "{:.0f}") -> str:
    return "" if value is None else fmt.format(value)


def table(results: Sequence[Result]) -> list[str]:
    lines = [
        "| payload | request bytes | concurrency | server | calls | p50 us | p99 us | calls/s "
        "| requests/launch | server mean us | queue mean us | other load | errors |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = {"echo": 0, "batch off": 1, "batch on": 2}
    payload_order = {name: i for i, name in enumerate(dict.fromkeys(r.payload for r in results))}
    for r in sorted(results, key=lambda r: (payload_order[r.payload], r.concurrency, order.get(r.server, 9))):
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "0"
        lines.append(f"| {r.payload} | {r.request_bytes} | {r.concurrency} | {r.server} | {r.calls} "
                     f"| {r.p50_us:.0f} | {r.p99_us:.0f} | {r.calls_per_s:.0f} "
                     f"| {_opt(r.requests_per_launch, '{:.1f}')} | {_opt(r.server_mean_us)} "
                     f"| {_opt(r.queue_mean_us)} | {_opt(r.other_load, '{:.0%}')} | {errors} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the server's --device (cpu, cuda:0, ...)")
    parser.add_argument("--backend", default="auto", help="the server's --backend")
    parser.add_argument("--calls", type=int, default=500, help="timed calls per case (default 500)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls before each case")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="time bound per case")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="comma-separated calls in flight (default 1,8,64)")
    parser.add_argument("--servers", default="echo,batch off,batch on",
                        help="comma-separated subset of: echo, batch off, batch on")
    parser.add_argument("--payloads", default="",
                        help="comma-separated substrings selecting payloads (default all)")
    parser.add_argument("--channels", type=int, default=1,
                        help="channels (connections) the calls are spread over (default 1)")
    parser.add_argument("--load-processes", type=int, default=1,
                        help="load-generator processes the calls and channels are split over (default 1); the "
                             "server's metrics then include their warm-up calls")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for `logitserve serve` (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for SERVING (warm-up compiles kernels)")
    parser.add_argument("--retries", type=int, default=0,
                        help="run a case again, up to this many times, while other processes used more than "
                             "--max-other-load of the CPUs during it; the least disturbed run is kept")
    parser.add_argument("--max-other-load", type=float, default=0.1,
                        help="fraction of all CPUs (default 0.1)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)

    # SIGTERM stops the servers too (the `finally` in running() runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    wanted = [s.strip() for s in args.servers.split(",")]
    specs = [s for s in server_specs(args.device, args.backend, args.server_arg) if s.label in wanted]
    cases = [p for p in payloads()
             if not args.payloads or any(sel.strip() in p.name for sel in args.payloads.split(","))]
    header = [
        f"Service benchmark: {machine_line(args)}.",
        f"Command: `python -m bench.service {shlex.join(argv if argv is not None else sys.argv[1:])}`; "
        f"{args.calls} calls per case (or {args.max_seconds:.0f} s), {args.warmup} warm-up calls, "
        f"load generator: {args.load_processes} process{'es' if args.load_processes > 1 else ''} of its own "
        f"(grpc.aio, {args.channels} channel{'s' if args.channels > 1 else ''} in all).",
        "",
    ]
    results: list[Result] = []
    for spec in specs:
        with running(spec, args.startup_timeout) as server:
            for payload in cases:
                for c in concurrency:
                    result = run_case(spec, server, payload, c, args)
                    for _ in range(args.retries):
                        if result.other_load is None or result.other_load <= args.max_other_load:
                            break
                        print(f"# other processes used {result.other_load:.0%} of the CPUs: running again",
                              file=sys.stderr, flush=True)
                        again = run_case(spec, server, payload, c, args)
                        if again.other_load is not None and again.other_load < result.other_load:
                            result = again
                    results.append(result)
                    print(table([result])[-1], file=sys.stderr, flush=True)
    text = "\n".join(header + table(results))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = sum(sum(r.errors.values()) for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
