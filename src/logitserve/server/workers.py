"""``logitserve serve --workers N``: N server processes on one port; and the supervision every
multi-process server shares (``--devices``, server/devices.py, starts its processes with it too).

One Python process serves gRPC from one event loop, and that loop, not the GPU, limits its
throughput. This supervisor starts N ordinary ``logitserve serve`` processes with
``--reuse-port on``; the kernel spreads incoming connections over them (SO_REUSEPORT). Each has
its own event loop, batcher, CUDA context and warm-up, and batches only its own calls; worker i
serves metrics on ``--metrics-port`` + i. With ``--port 0`` the supervisor picks the port and holds it (bound,
not listening) so every worker gets the same one.

Supervision (:func:`supervise`): SIGTERM, SIGINT and SIGHUP are passed on to every process. The
supervisor exits when they have: 0 when all exited 0. A process that exits on its own (a crash,
a failed warm-up) stops the others, and the supervisor exits with its code, for the orchestrator
to restart the whole.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

from .config import ServerConfig
from .logs import WORKER_ENV, get_logger, log_event

log = get_logger("workers")


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to ``host:port`` with SO_REUSEPORT; port 0 picks one."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


def start_server(config: ServerConfig, index: int) -> subprocess.Popen:
    """An ordinary ``logitserve serve`` process of ``config``; ``index`` names it in its log lines."""
    return subprocess.Popen([sys.executable, "-m", "logitserve.server.cli", "serve", *config.to_argv()],
                            env={**os.environ, WORKER_ENV: str(index)})


def supervise(processes: list[subprocess.Popen], logger: logging.Logger, name: str) -> int:
    """Pass SIGTERM, SIGINT and SIGHUP on to ``processes`` until all have exited; one that exits on
    its own stops the others. Logs ``"<name> exited, stopping the others"`` and ``"<name>s
    stopped"`` (with every exit code); returns the code of the one that exited on its own, else
    the first that is not 0, else 0 (the others' codes are those of being stopped: -15 for one
    stopped before it could drain)."""
    stopping = False
    failed = None

    def forward(signum, _frame):
        nonlocal stopping
        if signum != signal.SIGHUP:
            stopping = True
        for p in processes:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        codes = [p.poll() for p in processes]
        if all(c is not None for c in codes):
            break
        if not stopping:
            failed = next((c for c in codes if c is not None), None)
            if failed is not None:
                log_event(logger, f"{name} exited, stopping the others", code=failed)
                forward(signal.SIGTERM, None)
        time.sleep(0.1)
    codes = [p.returncode for p in processes]
    log_event(logger, f"{name}s stopped", codes=codes)
    return failed if failed is not None else next((c for c in codes if c != 0), 0)


def run_workers(config: ServerConfig) -> int:
    try:
        reserved = reserve_port(config.host, config.port)
    except OSError as exc:
        log_event(log, "failed to start", error=f"port {config.port}: {exc}")
        return 2
    port = reserved.getsockname()[1]
    workers = []
    try:
        for i in range(config.workers):
            worker = config.replace(workers=1, reuse_port=True, port=port,
                                    metrics_port=config.metrics_port + i if config.metrics_port else 0)
            workers.append(start_server(worker, i))
        log_event(log, "workers started", port=port, pids=[w.pid for w in workers])
        return supervise(workers, log, "worker")
    finally:
        reserved.close()
