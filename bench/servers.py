"""Servers for the service benchmarks: start one on free loopback ports, wait until it serves, stop it.

A :class:`ServerSpec` is a command line (without ``--port``), run as a subprocess in a session
of its own, with its output in a temporary log (its tail is printed if it fails to start).
Readiness is grpc.health.v1 SERVING, which both ``logitserve serve`` and ``bench.echo_server``
answer. A real server also gets a ``--metrics-port``: :func:`scrape` reads its Prometheus
counters, summed over labels and worker processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVE = ("-c", "import sys; from logitserve.server.cli import main; sys.exit(main())", "serve")
# Set to a file name, every real server a bench starts samples its threads into it (bench.stack_profile;
# `python -m bench.stack_profile FILE` summarizes): a profile of any bench's server, its figures aside.
PROFILE_ENV = "BENCH_SERVER_STACK_SAMPLES"


@dataclasses.dataclass
class ServerSpec:
    label: str
    argv: list[str]  # without the port
    is_echo: bool = False
    cpus: set[int] | None = None  # the CPUs it may run on (None: any)
    env: dict[str, str] | None = None  # its environment (None: this process's)
    cwd: str | None = None  # its working directory (None: this process's)


def serve_argv(*flags: str) -> list[str]:
    """``logitserve serve FLAGS`` on 127.0.0.1, run by this interpreter (the console script may
    not be installed for the tree under test)."""
    return [sys.executable, *SERVE, "--host", "127.0.0.1", *flags]


def echo_argv(*flags: str) -> list[str]:
    """The transport floor, ``bench.echo_server``, on 127.0.0.1."""
    return [sys.executable, "-m", "bench.echo_server", "--host", "127.0.0.1", *flags]


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


class _Child:
    """``spec`` started on free loopback ports, its output in a temporary log."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        port = free_port()
        argv = spec.argv + ["--port", str(port)]
        self.metrics_urls: list[str] = []
        if not spec.is_echo:
            metrics_port = free_port()
            argv += ["--metrics-port", str(metrics_port)]
            # Worker i of --workers serves its metrics on the port + i.
            self.metrics_urls = [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(_workers(argv))]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-service-", suffix=".log", delete=False)
        print(f"# starting {spec.label}: {shlex.join(argv)} (log {self.log.name})", file=sys.stderr, flush=True)
        pin = None if spec.cpus is None else functools.partial(os.sched_setaffinity, 0, spec.cpus)
        env = spec.env
        if os.environ.get(PROFILE_ENV) and not spec.is_echo:
            from .stack_profile import profiled_env
            env = profiled_env(env, os.environ[PROFILE_ENV])
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=pin, env=env, cwd=spec.cwd)
        self.target = f"127.0.0.1:{port}"
        self.t0 = time.monotonic()

    def wait(self, startup_timeout_s: float) -> Running:
        try:
            wait_serving(self.target, self.process, max(startup_timeout_s - (time.monotonic() - self.t0), 1.0))
        except BaseException:
            self.log.flush()
            with open(self.log.name) as f:
                print(f"# {self.spec.label} log (tail):\n" + "".join(f.readlines()[-30:]), file=sys.stderr)
            raise
        print(f"# {self.spec.label} SERVING after {time.monotonic() - self.t0:.1f} s", file=sys.stderr, flush=True)
        return Running(self.target, self.metrics_urls, self.process.pid)

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL after 30 s; the log goes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


@contextlib.contextmanager
def running(spec: ServerSpec, startup_timeout_s: float) -> Iterator[Running]:
    """Start ``spec`` on free loopback ports, yield it once SERVING, then stop it (SIGTERM)."""
    with running_all([spec], startup_timeout_s) as (server,):
        yield server


@contextlib.contextmanager
def running_all(specs: Sequence[ServerSpec], startup_timeout_s: float) -> Iterator[list[Running]]:
    """Start every spec at once (their warm-ups overlap), yield them once all are SERVING, then
    stop them all."""
    children: list[_Child] = []
    try:
        for spec in specs:
            children.append(_Child(spec))
        yield [child.wait(startup_timeout_s) for child in children]
    finally:
        for child in children:
            child.stop()


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


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def mean_delta(before: dict[str, float], after: dict[str, float], histogram: str) -> float | None:
    count = delta(before, after, histogram + "_count")
    return delta(before, after, histogram + "_sum") / count if count > 0 else None


