"""`logitserve serve`: flags and LOGITSERVE_* variables, and a real process: JSON logs,
Prometheus metrics, SIGHUP token reload, SIGTERM drain with a call in flight, exit 0."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from logitserve.client import Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server import cli
from logitserve.server.cli import FLAGS, build_parsers, env_name, main


def parse(argv, environ=None) -> ServerConfig:
    command, config = cli.parse(["serve", *argv], environ or {})
    assert command == "serve"
    return config


def test_every_config_field_has_a_flag_and_a_variable():
    flags = {flag.lstrip("-").replace("-", "_") for flag, *_ in FLAGS}
    assert flags == {f.name for f in dataclasses.fields(ServerConfig)}
    assert env_name("--max-delay-us") == "LOGITSERVE_MAX_DELAY_US"
    text = build_parsers({})[1].format_help()
    for flag, *_ in FLAGS:
        assert flag in text and env_name(flag) in text


def test_defaults():
    c = parse([])
    assert c == ServerConfig(device="cpu")  # no GPU here: the default device is the CPU
    # main leaves the device to the server (ServerConfig.resolved_device): torch is not imported yet
    assert cli.parse(["serve"], {}, resolve_device=False)[1] == ServerConfig()
    assert c.port == 50051 and c.backend == "auto" and c.metrics_port == 0
    assert c.busy_poll_us == 2000  # polls while a lone client calls (server/engine/busy_poll.py)


def test_flags():
    c = parse(["--host", "127.0.0.1", "--port", "6000", "--device", "cpu", "--backend", "interpret",
               "--max-batch-rows", "8", "--max-delay-us", "0", "--max-queue", "5", "--max-message-bytes", "1024",
               "--max-vocab", "100", "--max-rows", "3", "--warmup-dtypes", "float32,bfloat16", "--warmup-widths", "64,100",
               "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem", "--auth-token-file", "t",
               "--metrics-port", "9100", "--busy-poll-us", "500", "--grace-period-s", "2.5", "--log-level", "debug"])
    assert c == ServerConfig(host="127.0.0.1", port=6000, device="cpu", backend="interpret", max_batch_rows=8,
                             max_delay_us=0, max_queue=5, max_message_bytes=1024, max_vocab=100, max_rows=3,
                             warmup_dtypes=("float32", "bfloat16"), warmup_widths=(64, 100), tls_cert="c.pem", tls_key="k.pem",
                             tls_client_ca="ca.pem", auth_token_file="t", metrics_port=9100, busy_poll_us=500,
                             grace_period_s=2.5, log_level="debug")


def test_environment_variables_and_flags_over_them():
    env = {"LOGITSERVE_PORT": "7000", "LOGITSERVE_MAX_DELAY_US": "15", "LOGITSERVE_WARMUP_DTYPES": "none",
           "LOGITSERVE_AUTH_TOKEN_FILE": "/run/tokens", "LOGITSERVE_GRACE_PERIOD_S": "1.5",
           "LOGITSERVE_DEVICE": "cpu", "LOGITSERVE_WARMUP_WIDTHS": "32768,256000"}
    c = parse([], env)
    assert (c.port, c.max_delay_us, c.warmup_dtypes, c.auth_token_file, c.grace_period_s, c.warmup_widths) == \
        (7000, 15, (), "/run/tokens", 1.5, (32768, 256000))
    assert parse(["--port", "7001"], env).port == 7001


@pytest.mark.parametrize("argv, env", [
    (["--port", "x"], {}),
    ([], {"LOGITSERVE_MAX_ROWS": "many"}),
    (["--backend", "cuda"], {}),
    (["--warmup-dtypes", "float8"], {}),
    (["--tls-cert", "c.pem"], {}),
    (["--port", "70000"], {}),
    (["--max-queue", "0"], {}),
    (["--warmup-widths", "wide"], {}),
    (["--busy-poll-us", "-1"], {}),
    ([], {"LOGITSERVE_BUSY_POLL_US": "soon"}),
    (["--warmup-widths", "0"], {}),
    (["--warmup-widths", "300000"], {}),  # over --max-vocab
])
def test_bad_values_exit_with_usage(argv, env, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv, env)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_a_kubernetes_service_link_is_named_with_the_fix(capsys):
    # A Service named logitserve puts LOGITSERVE_PORT=tcp://... into every pod of its namespace.
    with pytest.raises(SystemExit) as info:
        parse([], {"LOGITSERVE_PORT": "tcp://10.0.0.1:50051"})
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "LOGITSERVE_PORT (--port): 'tcp://10.0.0.1:50051' is not a valid value" in err and \
        "enableServiceLinks: false" in err, err
    with pytest.raises(SystemExit):
        parse([], {"LOGITSERVE_MAX_ROWS": "many"})
    assert "LOGITSERVE_MAX_ROWS (--max-rows): 'many'" in capsys.readouterr().err
    # The flag on the command line wins over the variable, whatever the variable holds.
    assert parse(["--port", "50051"], {"LOGITSERVE_PORT": "tcp://10.0.0.1:50051"}).port == 50051
    assert parse(["--port=50052"], {"LOGITSERVE_PORT": "tcp://10.0.0.1:50051"}).port == 50052


def test_defaults_keep_the_backends_warm_up_widths():
    assert parse([]).warmup_widths is None and parse(["--warmup-widths", "auto"]).warmup_widths is None


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip()


# ------------------------------------------------------------------------------- a real process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """``logitserve serve`` in a subprocess; its JSON log lines arrive on a queue."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "logitserve.server.cli", "serve", *argv],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, event: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # not ours (a library writing to stderr): keep it for the report
                self.events.append({"event": "(not json)", "line": line})
                continue
            self.events.append(record)
            if record["event"] == event:
                return record
        raise AssertionError(f"no {event!r} event; exit code {self.proc.poll()}; saw {self.events[-5:]}")


# Tokens no log line could hold by chance (the logs are searched for them).
FIRST, SECOND = "tok-1f9c2a7e", "tok-2b8d3c6f"


def test_serve_process_metrics_sighup_and_sigterm_drain(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{FIRST}\n")
    metrics_port = _free_port()
    server = Process("--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--warmup-dtypes", "float32",
                     "--max-delay-us", "2000000", "--grace-period-s", "20", "--auth-token-file", str(tokens),
                     "--metrics-port", str(metrics_port), "--log-level", "debug", "--busy-poll-us", "1000")
    try:
        listening = server.wait_for("listening")
        target = f"127.0.0.1:{listening['port']}"
        assert listening["backend"] == "torch" and listening["auth"] is True and listening["busy_poll_us"] == 1000
        server.wait_for("serving")
        x = np.ones((1, 4), np.float32)
        with Client(target, token=FIRST, timeout=30) as c:
            np.testing.assert_allclose(c.softmax(x), 0.25)
        rpc = server.wait_for("rpc")
        assert rpc["rpc"] == "Softmax" and rpc["status"] == "OK" and rpc["rows"] == 1 and "latency_ms" in rpc
        assert rpc["request_id"] and FIRST not in json.dumps(server.events)

        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'logitserve_requests_total{rpc="Softmax"} 1.0' in text
        assert 'logitserve_launches_total{op="softmax"}' in text
        assert "logitserve_queue_time_seconds_bucket" in text and "logitserve_batch_rows_bucket" in text

        tokens.write_text(f"{SECOND}\n")
        server.proc.send_signal(signal.SIGHUP)
        server.wait_for("tokens reloaded")
        with Client(target, token=FIRST, timeout=30) as c, pytest.raises(LogitServeError) as info:
            c.softmax(x)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

        outcome = {}

        def in_flight():
            with Client(target, token=SECOND, timeout=30) as c:
                outcome["out"] = c.softmax(x)

        caller = threading.Thread(target=in_flight)
        caller.start()
        time.sleep(0.5)  # the call now waits in the batcher (2 s delay)
        server.proc.send_signal(signal.SIGTERM)
        draining = server.wait_for("draining")
        assert draining["queued"] == 1
        caller.join(30)
        np.testing.assert_allclose(outcome["out"], 0.25)
        assert server.proc.wait(timeout=30) == 0
        server.wait_for("stopped")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_serve_process_fails_cleanly_on_a_taken_port():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1",
                               "--port", str(port), "--device", "cpu", "--warmup-dtypes", "none"],
                              capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 2
    assert json.loads(proc.stderr.strip().splitlines()[-1])["event"] == "failed to start"


def test_workers_share_one_port_and_all_drain_on_sigterm():
    server = Process("--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--warmup-dtypes", "none",
                     "--workers", "2", "--grace-period-s", "5")
    try:
        port = server.wait_for("workers started")["port"]
        server.wait_for("serving")
        server.wait_for("serving")
        # Each worker names its request ids with its own prefix; new connections reach both.
        prefixes = set()
        for _ in range(200):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = channel.unary_unary("/logitserve.v1.LogitServe/GetServerInfo")
                _, call = info.with_call(b"", timeout=30)
                prefixes.add(dict(call.trailing_metadata())["x-request-id"][:8])
            if len(prefixes) == 2:
                break
        assert len(prefixes) == 2
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert server.wait_for("workers stopped")["codes"] == [0, 0]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_to_argv_parses_back_to_the_same_config():
    config = parse(["--device", "cpu", "--warmup-dtypes", "none", "--warmup-widths", "48,64", "--workers", "3",
                    "--cuda-graphs", "off",
                    "--tls-cert", "c.pem", "--tls-key", "k.pem", "--grace-period-s", "2.5"])
    assert parse(config.to_argv()) == config
