"""``logitserve serve`` in a child process on 127.0.0.1, waited for until it serves, stopped cleanly.

For tests and benchmarks that need a real server process (signals, ports, exit codes, memory):

    with ServerProcess("--max-queue", "4", launch_delay_ms=200) as server:
        server.target            # "127.0.0.1:PORT"
        server.rss_kib()         # the server's resident memory, VmRSS of /proc/<pid>/status
        server.terminate()       # SIGTERM; waits and returns the exit code

``python -m logitserve.server.process [--launch-delay-ms N] -- <serve flags>`` runs ``logitserve
serve`` with the device handle's in-process fault-injection hook (``DeviceHandle.before_launch``) set to sleep N ms
before every launch: a slow batch, to fill the queue or to have calls in flight at SIGTERM. The
hook is an attribute set inside this process; nothing on the wire can set it.

The child's JSON log lines (stderr) are read by a thread into :attr:`ServerProcess.events`, so
the pipe never fills; :meth:`ServerProcess.wait_for` waits for an event such as ``"serving"``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now (a ``--devices`` server's,
    process i on the first + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


class ServerProcess:
    """A ``logitserve serve`` child on 127.0.0.1; ``port=0`` picks a free port."""

    def __init__(self, *serve_args: str, port: int = 0, launch_delay_ms: float = 0.0, device: str = "cpu",
                 backend: str = "torch", start_timeout: float = 180.0, env: dict | None = None):
        argv = [sys.executable, "-m", "logitserve.server.process", "--launch-delay-ms", str(launch_delay_ms), "--",
                "--host", "127.0.0.1", "--port", str(port), "--device", device, "--backend", backend, *serve_args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.pid = self.proc.pid
        self.events: list[dict] = []
        self.lines: list[str] = []  # every stderr line, JSON or not
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"server-{self.pid}-stderr", daemon=True)
        self._reader.start()
        try:
            self.port = int(self.wait_for("listening", start_timeout)["port"])
            self.wait_for("serving", start_timeout)
        except BaseException:
            self.kill()
            raise
        self.target = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                self.events.append(record)
                self._queue.put(record)
        self._queue.put(None)  # the child closed stderr (exited)

    def wait_for(self, event: str, timeout: float = 60.0) -> dict:
        """The next log record whose ``event`` is ``event`` (records before it are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                record = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise TimeoutError(f"no {event!r} log event within {timeout:.0f} s") from None
            if record is None:
                self._queue.put(None)
                raise RuntimeError(f"server exited ({self.proc.wait()}) before {event!r}; "
                                   f"last lines: {''.join(self.lines[-5:])}")
            if record.get("event") == event:
                return record

    def rss_kib(self) -> int | None:
        """Resident memory of the server process in KiB (VmRSS), None once it has exited."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain), then wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.kill()
        self._reader.join(timeout=10)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m logitserve.server.process",
                                     description="logitserve serve with a slow-launch test hook")
    parser.add_argument("--launch-delay-ms", type=float, default=0.0,
                        help="sleep this long on the device thread before every batched launch")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the flags of logitserve serve")
    args = parser.parse_args(argv)
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args

    from . import app, cli

    delay = args.launch_delay_ms / 1e3
    create_server = app.create_server

    def create_with_hook(config):
        service, port = create_server(config)
        if delay > 0:
            service.handle.before_launch = lambda calls: time.sleep(delay)
        return service, port

    app.create_server = create_with_hook  # cli.serve imports it from app when it runs
    return cli.main(["serve", *serve_args])


if __name__ == "__main__":
    sys.exit(main())
