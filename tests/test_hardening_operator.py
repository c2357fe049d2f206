"""Issue 25, what a new operator trips over: start-up failures, config errors, log lines,
request ids, an open address, --help, --workers. Each test fails on the code before the fix
(figures in docs/RELIABILITY.md); the attacks are in test_hardening.py."""

from __future__ import annotations

import grpc
import pytest

from logitserve.server.process import ServerProcess


def _stub(channel):
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc
    return pb_grpc.LogitServeStub(channel)


# --- what an operator trips over ------------------------------------------------------------

def _parse_error(argv, environ=None, capsys=None):
    from logitserve.server import cli
    with pytest.raises(SystemExit) as info:
        cli.parse(["serve", *argv], environ=environ or {})
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_config_errors_name_the_flag_or_the_environment_variable(capsys):
    assert _parse_error(["--max-rows", "0"], capsys=capsys).endswith("--max-rows: must be >= 1, got 0")
    assert "LOGITSERVE_MAX_ROWS (--max-rows): must be >= 1" in _parse_error(
        [], {"LOGITSERVE_MAX_ROWS": "0"}, capsys=capsys)
    assert "--grace-period-s: must be a finite number >= 0, got nan" in _parse_error(
        ["--grace-period-s", "nan"], capsys=capsys)


def test_log_level_is_case_insensitive():
    from logitserve.server import cli
    assert cli.parse(["serve", "--log-level", "DEBUG", "--device", "cpu"], environ={})[1].log_level == "debug"


def _serve(*argv, timeout=120):
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--device", "cpu",
                           "--warmup-dtypes", "none", "--log-level", "warning", *argv],
                          capture_output=True, text=True, timeout=timeout)
    lines = []
    for line in proc.stderr.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass
    return proc.returncode, lines


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_a_taken_port_fails_at_error_level_naming_flag_and_port(which):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--host", "127.0.0.1"] + (["--port", str(port)] if which == "--port"
                                          else ["--port", "0", "--metrics-port", str(port)])
        code, lines = _serve(*argv)
    assert code == 2
    failed = [line for line in lines if line["event"] == "failed to start"]
    assert failed and failed[0]["level"] == "error", lines
    assert f"{which} {port}" in failed[0]["error"]


def test_a_missing_gpu_fails_at_error_level_naming_the_flag():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, lines = _serve("--host", "127.0.0.1", "--port", "0", "--device", "cuda:0")
    assert code == 2
    failed = [line for line in lines if line["event"] == "failed to start"]
    assert failed and failed[0]["level"] == "error" and "--device cuda:0" in failed[0]["error"], lines


def test_open_address_without_tls_or_tokens_warns_and_metrics_default_to_loopback():
    import io
    import json
    from logitserve.server import ServerConfig, cli
    from logitserve.server.logs import configure
    assert ServerConfig().metrics_host == "127.0.0.1"
    stream = io.StringIO()
    configure("warning", stream=stream, worker="3")
    try:
        cli._warn_if_open(ServerConfig(host="0.0.0.0"))
        cli._warn_if_open(ServerConfig(host="127.0.0.1"))
    finally:
        configure("info")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 1 and lines[0]["level"] == "warning" and lines[0]["host"] == "0.0.0.0"
    assert lines[0]["worker"] == "3"  # every line of a --workers process names its worker


@pytest.fixture(scope="module")
def thread_server():
    from logitserve.server import ServerConfig
    from logitserve.server.testing import ServerThread
    with ServerThread(ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                                   max_rows=4)) as server:
        yield server


def test_long_request_id_is_refused_before_the_work(thread_server):
    import torch
    from logitserve.server.tensors import from_torch
    from logitserve.v1 import logitserve_pb2 as pb
    request = pb.SoftmaxRequest(x=from_torch(torch.ones(1, 4)))
    with grpc.insecure_channel(thread_server.target) as channel:
        stub = _stub(channel)
        _, call = stub.Softmax.with_call(request, metadata=(("x-request-id", "a" * 128),), timeout=10)
        assert dict(call.trailing_metadata())["x-request-id"] == "a" * 128
        with pytest.raises(grpc.RpcError) as info:
            stub.Softmax(request, metadata=(("x-request-id", "a" * 15_000),), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-request-id: at most 128 characters, got 15000" in info.value.details()
    assert len(dict(info.value.trailing_metadata())["x-request-id"]) < 128


def test_failed_call_log_line_has_code_reason_and_rows(thread_server, caplog):
    import logging
    import time
    import torch
    from logitserve.server.tensors import from_torch
    from logitserve.v1 import logitserve_pb2 as pb
    logging.getLogger("logitserve").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="logitserve"):
            with grpc.insecure_channel(thread_server.target) as channel:
                with pytest.raises(grpc.RpcError):
                    _stub(channel).Softmax(pb.SoftmaxRequest(x=from_torch(torch.ones(6, 4))), timeout=10)
            time.sleep(0.2)
    finally:
        logging.getLogger("logitserve").removeHandler(caplog.handler)
    fields = [r.fields for r in caplog.records if r.getMessage() == "rpc"][-1]
    assert fields["status"] == "RESOURCE_EXHAUSTED" and fields["code"] == 8 and fields["rows"] == 6
    assert "--max-rows" in fields["reason"]


def test_help_imports_no_torch():
    """``logitserve serve --help`` answers without importing torch (it took 2-3 s)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom logitserve.server import cli\n"
                          "try:\n    cli.parse(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
                          "print('torch' in sys.modules, file=sys.stderr)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stderr.strip().splitlines()[-1] == "False", out.stderr


def test_every_log_line_names_its_worker():
    """Under --workers 2 every JSON line says which process wrote it (a worker's index, or the
    supervisor); before, none did."""
    import time
    with ServerProcess("--workers", "2", "--warmup-dtypes", "none", "--busy-poll-us", "0") as server:
        time.sleep(1)
        events = list(server.events)
    assert events and all("worker" in e for e in events), [e for e in events if "worker" not in e][:3]
    assert {e["worker"] for e in events} >= {"supervisor", "0"}

