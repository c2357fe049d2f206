"""Service benchmark: latency and throughput of Sample and RouteExperts over gRPC, beside the floor.

    python -m bench.service --device cpu --out results.md
    python -m bench.service --device cuda:0 --calls 2000 --out results.md

Starts each server as a subprocess on 127.0.0.1 (an ephemeral port), waits for grpc.health.v1
SERVING, drives it from this process (the load generator: grpc.aio, ``--channels`` channels, N calls in
flight), stops it, and prints one Markdown table. Servers:

- ``echo``: ``bench.echo_server``, the transport floor: it receives the same request bytes and
  answers 8 bytes, doing no work;
- ``batch off``: ``logitserve serve --max-batch-rows 1`` (every request is its own launch);
- ``batch on``: ``logitserve serve --max-batch-rows 256 --max-delay-us 0`` (the server's
  defaults: launch at once when the device is free, calls arriving meanwhile share the next
  launch; 256 rows let four 64-row RouteExperts requests share a launch, where 64 would not).

Payloads: Sample 1x128256 in bfloat16 and float32 (a pool of requests whose temperature,
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
waiting in the batcher. ``bench/service_breakdown.py`` splits the rest.

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
import functools
import multiprocessing
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logitserve.v1 import logitserve_pb2 as pb

SERVICE = "/logitserve.v1.LogitServe/"
MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    # Each channel its own connection: channels of one process otherwise share one.
    ("grpc.use_local_subchannel_pool", 1),
]
CONCURRENCY = (1, 8, 64)
POOL = 16  # distinct requests per payload, cycled through


# ---------------------------------------------------------------------------------- payloads


def _bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def _tensor(x: np.ndarray, dtype: str) -> pb.Tensor:
    if dtype == "bf16":
        return pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=x.shape, data=_bf16_bytes(x))
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.astype("<f4").tobytes())


@dataclasses.dataclass
class Payload:
    name: str
    method: str  # full gRPC method path
    requests: list[bytes]  # serialized, cycled through
    response_type: type

    @property
    def request_bytes(self) -> int:
        return len(self.requests[0])


def sample_payload(vocab: int, dtype: str, rng: np.random.Generator) -> Payload:
    """Sample [1, vocab]: every request has its own logits, temperature, top_k, top_p and seed."""
    temperatures = (0.6, 0.7, 0.8, 1.0, 1.2)
    top_ks = (0, 20, 50, 100)
    top_ps = (0.8, 0.9, 0.95, 1.0)
    requests = []
    for i in range(POOL):
        logits = rng.standard_normal((1, vocab), dtype=np.float32) * 3.0
        request = pb.SampleRequest(
            logits=_tensor(logits, dtype),
            temperature=temperatures[i % len(temperatures)],
            top_k=top_ks[i % len(top_ks)],
            top_p=top_ps[(i // 2) % len(top_ps)],
            seed=1000 + i,
        )
        requests.append(request.SerializeToString())
    return Payload(f"Sample 1x{vocab} {dtype}", SERVICE + "Sample", requests, pb.SampleResponse)


def route_payload(tokens: int, experts: int, k: int, rng: np.random.Generator) -> Payload:
    requests = [
        pb.RouteExpertsRequest(
            gate_logits=_tensor(rng.standard_normal((tokens, experts), dtype=np.float32), "bf16"),
            k=k,
            renormalize=bool(i % 2),
        ).SerializeToString()
        for i in range(POOL)
    ]
    return Payload(f"RouteExperts {tokens}x{experts} bf16 k{k}", SERVICE + "RouteExperts", requests,
                   pb.RouteExpertsResponse)


def payloads(seed: int = 0) -> list[Payload]:
    rng = np.random.default_rng(seed)
    return [
        sample_payload(128256, "bf16", rng),
        sample_payload(128256, "f32", rng),
        route_payload(64, 256, 8, rng),
    ]


def check_response(payload: Payload, raw: bytes) -> None:
    """Parse one response and check its shape: a benchmark of failing calls measures nothing."""
    response = payload.response_type.FromString(raw)
    if payload.response_type is pb.SampleResponse:
        ids = np.frombuffer(response.token_ids.data, dtype="<i8")
        if list(response.token_ids.shape) != [1] or ids.size != 1 or not 0 <= ids[0]:
            raise RuntimeError(f"{payload.name}: unexpected response {response}")
    else:
        if list(response.indices.shape)[1:] != [8]:
            raise RuntimeError(f"{payload.name}: unexpected response shape {response.indices.shape}")


# ----------------------------------------------------------------------------------- servers


@dataclasses.dataclass
class ServerSpec:
    label: str
    argv: list[str]  # without the port
    is_echo: bool = False
    cpus: set[int] | None = None  # the CPUs it may run on (None: any)


def server_specs(device: str, backend: str, extra: Sequence[str]) -> list[ServerSpec]:
    serve = [sys.executable, "-c", "import sys; from logitserve.server.cli import main; sys.exit(main())",
             "serve", "--host", "127.0.0.1", "--device", device, "--backend", backend, *extra]
    return [
        ServerSpec("echo", [sys.executable, "-m", "bench.echo_server", "--host", "127.0.0.1"], is_echo=True),
        ServerSpec("batch off", serve + ["--max-batch-rows", "1", "--max-delay-us", "0"]),
        ServerSpec("batch on", serve + ["--max-batch-rows", "256", "--max-delay-us", "0"]),
    ]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll grpc.health.v1 until SERVING; raise if the process dies or the time runs out."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode} before SERVING")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.2)


@dataclasses.dataclass
class Running:
    target: str  # host:port of the gRPC server
    metrics_urls: list[str]  # its Prometheus /metrics, one per worker process (none for echo)
    pid: int  # the server process


@contextlib.contextmanager
def running(spec: ServerSpec, startup_timeout_s: float) -> Iterator[Running]:
    """Start ``spec`` on free loopback ports, yield it once SERVING, then stop it (SIGTERM)."""
    port = free_port()
    argv = spec.argv + ["--port", str(port)]
    metrics_urls = []
    if not spec.is_echo:
        metrics_port = free_port()
        argv += ["--metrics-port", str(metrics_port)]
        # Worker i of --workers serves its metrics on the port + i.
        metrics_urls = [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(_workers(argv))]
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-service-", suffix=".log", delete=False)
    print(f"# starting {spec.label}: {shlex.join(argv)} (log {log.name})", file=sys.stderr, flush=True)
    pin = None if spec.cpus is None else functools.partial(os.sched_setaffinity, 0, spec.cpus)
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin)
    target = f"127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        wait_serving(target, process, startup_timeout_s)
        print(f"# {spec.label} SERVING after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        yield Running(target, metrics_urls, process.pid)
    except BaseException:
        log.flush()
        with open(log.name) as f:
            print(f"# {spec.label} log (tail):\n" + "".join(f.readlines()[-30:]), file=sys.stderr)
        raise
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
        os.unlink(log.name)


def _workers(argv: list[str]) -> int:
    """The ``--workers`` a server's argv asks for (1 without it)."""
    for i, arg in enumerate(argv):
        if arg == "--workers" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--workers="):
            return int(arg.split("=", 1)[1])
    return 1


def scrape(metrics_urls: list[str]) -> dict[str, float]:
    """The server's Prometheus samples, each summed over its labels (one op runs per case) and
    over its worker processes."""
    totals: dict[str, float] = {}
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            _add_samples(reply.read().decode(), totals)
    return totals


def _add_samples(text: str, totals: dict[str, float]) -> None:
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            totals[name] = totals.get(name, 0.0) + float(value)


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _mean_delta(before: dict[str, float], after: dict[str, float], histogram: str) -> float | None:
    count = _delta(before, after, histogram + "_count")
    return _delta(before, after, histogram + "_sum") / count if count > 0 else None


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


# -------------------------------------------------------------------------------------- load


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


def _drive_in_process(target: str, payload_name: str, concurrency: int, calls: int, warmup: int,
                      max_seconds: float, channels: int):
    """:func:`drive` in a load-generator process of its own (see ``--load-processes``)."""
    payload = next(p for p in payloads() if p.name == payload_name)
    latencies, errors, wall, _, _ = asyncio.run(drive(target, payload, concurrency, calls, warmup, max_seconds,
                                                      False, channels=channels))
    return latencies, errors, wall


def drive_processes(target: str, payload: Payload, concurrency: int, calls: int, warmup: int, max_seconds: float,
                    channels: int, processes: int):
    """The calls, the concurrency and the channels split over ``processes`` load generators
    (one Python process tops out near 3,000 calls/s of 256 KB requests); their latencies
    merged, their errors summed, the longest wall time."""
    share = [(concurrency * (i + 1)) // processes - (concurrency * i) // processes for i in range(processes)]
    args = [(target, payload.name, c, max(calls * c // concurrency, 1), warmup, max_seconds, max(channels // processes, 1))
            for c in share if c > 0]
    with multiprocessing.get_context("spawn").Pool(len(args)) as pool:
        parts = pool.starmap(_drive_in_process, args)
    errors: dict[str, int] = {}
    for _, e, _ in parts:
        for code, n in e.items():
            errors[code] = errors.get(code, 0) + n
    return [t for lat, _, _ in parts for t in lat], errors, max(w for _, _, w in parts)


def _process_tree(pid: int) -> list[int]:
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


def run_case(spec: ServerSpec, server: Running, payload: Payload, concurrency: int, args) -> Result:
    monitor: OtherLoad | None = None

    def snapshot() -> dict:
        nonlocal monitor
        if monitor is None:  # after the warm-up: the timed part starts
            monitor = OtherLoad([*_process_tree(server.pid), os.getpid()])
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
        launches = _delta(before, after, "logitserve_launches_total")
        if launches > 0:
            result.requests_per_launch = _delta(before, after, "logitserve_batch_requests_sum") / launches
        server_s = _mean_delta(before, after, "logitserve_request_latency_seconds")
        queue_s = _mean_delta(before, after, "logitserve_queue_time_seconds")
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
