"""``logitserve serve --devices``: the flag and its errors, the supervisor (a real process per
device, each answering the whole list in GetServerInfo and its device in /metrics; SIGTERM stops
all; one that fails stops the others), and the refusal of a CUDA region of another device.

The supervisor's processes run on the CPU here: :func:`run_devices` is given a resolved list of
CPU devices (the flag itself takes only GPUs, see ``resolve_devices``); what it starts, tells and
supervises is the same."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from logitserve.server import cli
from logitserve.server.config import ServerConfig, address
from logitserve.server.logs import get_logger
from logitserve.server.process import free_ports
from logitserve.server.regions import RegionRegistry
from logitserve.server.workers import supervise
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc


def parse(argv, environ=None) -> ServerConfig:
    command, config = cli.parse(["serve", *argv], environ or {})
    assert command == "serve"
    return config


def parse_error(argv, capsys, environ=None) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv, environ)
    assert info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------------------- the flag


def test_devices_flag_and_variable():
    c = parse(["--devices", "cuda:0,cuda:1", "--port", "6000", "--metrics-port", "9100"])
    assert c.devices == ("cuda:0", "cuda:1") and c.device is None  # each process gets its own --device
    assert parse(c.to_argv()) == c
    assert parse([], {"LOGITSERVE_DEVICES": "all"}).devices == ("all",)
    assert parse([]).devices == () and parse([]).device == "cpu"  # no flag: one process, as before
    endpoints = parse(["--device", "cuda:1", "--device-endpoints", "cuda:0=0.0.0.0:50051,cuda:1=0.0.0.0:50052"])
    assert endpoints.endpoints == [("cuda:0", "0.0.0.0:50051"), ("cuda:1", "0.0.0.0:50052")]


@pytest.mark.parametrize("argv, message", [
    (["--devices", "gpu0"], "--devices: must be 'all' or cuda:N entries"),
    (["--devices", "cuda:01"], "--devices: must be 'all' or cuda:N entries"),
    (["--devices", "cuda:0,cuda:0"], "--devices: each device once"),
    (["--devices", "all", "--device", "cuda:0"], "--devices: not with --device cuda:0"),
    (["--devices", "cuda:0,cuda:1", "--workers", "2"], "--devices: not with --workers 2"),
    (["--devices", "cuda:0,cuda:1", "--device-endpoints", "cuda:0=h:1"], "--devices: not with --device-endpoints"),
    (["--devices", "cuda:0,cuda:1", "--port", "65535"], "--port: 65535 + 1 (one port per device) is past 65535"),
    (["--devices", "cuda:0,cuda:1", "--metrics-port", "65535"], "--metrics-port: 65535 + 1"),
    (["--device-endpoints", "cuda:0"], "--device-endpoints: each must be device=host:port"),
])
def test_bad_devices_exit_with_usage_naming_the_flag(argv, message, capsys):
    assert message in parse_error(argv, capsys)


def test_a_device_given_in_the_environment_is_named_beside_devices(capsys):
    err = parse_error(["--devices", "all"], capsys, {"LOGITSERVE_DEVICE": "cuda:0"})
    assert "--devices: not with --device cuda:0" in err


@pytest.mark.parametrize("devices, message", [
    ("all", "--devices all: torch sees no CUDA device on this host"),
    ("cuda:0", "--devices: cuda:0 not among the CUDA devices torch sees here"),
])
def test_devices_torch_does_not_see_fail_at_error_level(devices, message, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a GPU host too: the host this test is about
    assert cli.main(["serve", "--devices", devices, "--host", "127.0.0.1", "--port", "0"]) == 2
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    failed = [r for r in lines if r["event"] == "failed to start"]
    assert failed and failed[0]["level"] == "error" and message in failed[0]["error"], lines


def test_an_address_names_an_ipv6_host_in_brackets():
    assert address("0.0.0.0", 50052) == "0.0.0.0:50052"
    assert address("::", 50052) == "[::]:50052" and address("[::1]", 7) == "[::1]:7"


# --------------------------------------------------------------------------- the supervisor


class Supervisor:
    """A supervisor in a child process, ``python ARGV``; its log lines and its processes' (they
    share its stderr) arrive on a queue."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.records: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                self.records.put(json.loads(line))
            except json.JSONDecodeError:
                pass

    def wait_for(self, event: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                record = self.records.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {event!r} event; exit code {self.proc.poll()}") from None
            if record.get("event") == event:
                return record

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cpu_supervisor(devices: list[str], **config) -> Supervisor:
    """``run_devices`` over ``devices`` (CPU ones: the flag takes GPUs only), on 127.0.0.1."""
    config = dict(host="127.0.0.1", port=0, backend="torch", warmup_dtypes=(), busy_poll_us=0, **config)
    return Supervisor("-c", "import sys\n"
                            "from logitserve.server.config import ServerConfig\n"
                            "from logitserve.server.devices import run_devices\n"
                            "from logitserve.server.logs import configure\n"
                            "configure('info', worker='supervisor')\n"
                            f"sys.exit(run_devices(ServerConfig(**{config!r}), {devices!r}))\n")


def _info(target: str) -> pb.GetServerInfoResponse:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.LogitServeStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=30)


def test_a_process_per_device_each_lists_all_and_sigterm_stops_all():
    metrics = free_ports(2)
    supervisor = cpu_supervisor(["cpu", "cpu"], metrics_port=metrics)
    try:
        started = supervisor.wait_for("devices started")
        endpoints = [tuple(e.split("=", 1)) for e in started["endpoints"]]
        assert [d for d, _ in endpoints] == ["cpu", "cpu"] and len(set(started["pids"])) == 2
        ports = [int(a.rsplit(":", 1)[1]) for _, a in endpoints]
        assert all(a == f"127.0.0.1:{p}" for (_, a), p in zip(endpoints, ports)) and ports[0] != ports[1]
        serving = {supervisor.wait_for("serving")["worker"], supervisor.wait_for("serving")["worker"]}
        assert serving == {"0", "1"}
        for _, target in endpoints:  # each process answers every process's address, in device order
            assert [(e.device, e.address) for e in _info(target).device_endpoints] == endpoints
        for i in range(2):  # process i serves its metrics on --metrics-port + i, its device named
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics + i}/metrics", timeout=10) as reply:
                assert 'logitserve_device_info{device="cpu"} 1.0' in reply.read().decode()
        supervisor.proc.send_signal(signal.SIGTERM)
        assert supervisor.proc.wait(timeout=60) == 0
        assert supervisor.wait_for("devices stopped")["codes"] == [0, 0]
    finally:
        supervisor.close()


def test_supervise_exits_with_the_code_of_the_process_that_failed():
    """The failed process's code, not the first nonzero in order: one stopped before it could
    drain ends -15 (before, that was the supervisor's code when it came first)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    stopped = subprocess.Popen(["sleep", "60"])
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    try:
        assert supervise([stopped, failing], get_logger("test"), "device") == 2
        assert stopped.returncode == -signal.SIGTERM
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for p in (stopped, failing):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_process_that_fails_stops_the_others_and_its_code_is_the_supervisors():
    # The second device does not exist: its process fails at start (2) and the first is stopped.
    supervisor = cpu_supervisor(["cpu", "cuda:3"])
    try:
        assert supervisor.wait_for("device exited, stopping the others")["code"] == 2
        assert supervisor.proc.wait(timeout=60) == 2
        codes = supervisor.wait_for("devices stopped")["codes"]
        assert codes[1] == 2 and codes[0] in (0, -signal.SIGTERM)  # stopped, drained or before it could
    finally:
        supervisor.close()


# -------------------------------------------------------------------- a region of another GPU


def test_a_cuda_region_of_another_device_is_refused_naming_both_and_the_remedy():
    registry = RegionRegistry(devices=(1,))
    with pytest.raises(ValueError) as info:
        registry.register_cuda("logits", b"\0" * 64, device_id=0, byte_size=8)
    message = str(info.value)
    assert message.startswith("device_id: 0 is not a device of this server (cuda:1)")
    assert "memory is on cuda:0" in message and "runs on cuda:1 (its --device)" in message
    assert "register it with the process of cuda:0" in message and "device_endpoints" in message
    with pytest.raises(ValueError, match=r"\(none\): it runs on the CPU; register host memory"):
        RegionRegistry(devices=()).register_cuda("logits", b"\0" * 64, device_id=0, byte_size=8)
