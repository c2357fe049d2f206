"""Issue 25: memory a hostile client can pin, the answer-size check, drain, start-up and
operator defects. Each test fails on the code before the fix (figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from logitserve.server.guard import Guard, _GuardedGenericHandler
from logitserve.server.process import ServerProcess


def _echo(request, context):
    return request


def test_unknown_methods_are_not_cached():
    """A path the service does not know leaves nothing in the guard's method cache."""
    inner = grpc.method_handlers_generic_handler(
        "t.S", {"Known": grpc.unary_unary_rpc_method_handler(_echo)})
    handler = _GuardedGenericHandler(inner, Guard(), {})

    class Details:
        def __init__(self, method):
            self.method = method

    for _ in range(1000):
        assert handler.service(Details(f"/t.S/{secrets.token_hex(64)}")) is None
    assert handler.service(Details("/t.S/Known")) is not None
    assert len(handler._by_method) == 1


def test_unknown_method_paths_do_not_pin_memory():
    """3,000 calls to random 8 KB method paths with no token: UNIMPLEMENTED each, and the
    server's RSS grows by less than 12 MiB (it grew by ~24 MiB, one path kept per call)."""
    with ServerProcess("--warmup-dtypes", "none", "--busy-poll-us", "0") as server:
        with grpc.insecure_channel(server.target) as channel:
            def call(path):
                try:
                    channel.unary_unary(path)(b"", timeout=10)
                except grpc.RpcError as exc:
                    return exc.code()
            for _ in range(200):  # warm gRPC's own per-connection state first
                call("/x/" + secrets.token_hex(4000))
            before = server.rss_kib()
            codes = {call("/x/" + secrets.token_hex(4000)) for _ in range(3000)}
            grown = (server.rss_kib() - before) / 1024
    print(f"unknown paths: RSS +{grown:.1f} MiB")
    assert codes == {grpc.StatusCode.UNIMPLEMENTED}
    assert grown < 12, f"RSS grew {grown:.1f} MiB over 3,000 unknown 8 KB paths"


# --- the answer-size check (--max-message-bytes) -------------------------------------------

def _stub(channel):
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc
    return pb_grpc.LogitServeStub(channel)


def test_answer_bytes_is_the_serialized_size():
    """limits.answer_bytes is exactly what the answer serializes to (gRPC's count)."""
    import torch
    from logitserve.server.ops.limits import answer_bytes
    from logitserve.server.tensors import from_torch
    from logitserve.v1 import logitserve_pb2 as pb
    for shape in ((256, 1024), (3,), (1, 1, 200), (0, 5)):
        out = torch.zeros(shape)
        assert answer_bytes(pb.SiluResponse, {"out": (out.dtype, shape)}) == pb.SiluResponse(
            out=from_torch(out)).ByteSize()
    w, i = torch.zeros(512, 256), torch.zeros(512, 256, dtype=torch.int32)
    assert answer_bytes(pb.RouteExpertsResponse, {"weights": (w.dtype, w.shape), "indices": (i.dtype, i.shape)}) \
        == pb.RouteExpertsResponse(weights=from_torch(w), indices=from_torch(i)).ByteSize()


@pytest.fixture(scope="module")
def small_server():
    with ServerProcess("--max-message-bytes", "1048576", "--warmup-dtypes", "none", "--busy-poll-us", "0") as server:
        yield server


def _refused(server, method, request):
    """The call's status code, and the server's log line of it."""
    import time
    with grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 1 << 30)]) as channel:
        try:
            getattr(_stub(channel), method)(request, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [e for e in server.events if e.get("event") == "rpc" and e.get("rpc") == method]
        if lines:
            server.events.remove(lines[-1])
            return code, lines[-1]
        time.sleep(0.05)
    return code, None


@pytest.mark.parametrize("case", ["swiglu", "route_experts", "step"])
def test_answer_over_the_message_limit_is_refused_before_the_work(small_server, case):
    """Answers just over 1 MiB once framed, and a Step whose parts pass the limit together only:
    RESOURCE_EXHAUSTED before any launch, logged and counted as such (they failed at send after
    the work, logged as OK)."""
    import torch
    from logitserve.server.tensors import from_torch
    from logitserve.v1 import logitserve_pb2 as pb
    if case == "swiglu":
        method, request = "Silu", pb.SiluRequest(x=from_torch(torch.ones(256, 1)), up=from_torch(torch.ones(1, 1024)))
    elif case == "route_experts":
        method = "RouteExperts"
        request = pb.RouteExpertsRequest(gate_logits=from_torch(torch.zeros(512, 256, dtype=torch.float16)), k=256)
    else:
        method = "Step"
        request = pb.StepRequest(  # two answers of 614 KB each
            id="s", route_experts=pb.RouteExpertsRequest(gate_logits=from_torch(torch.zeros(300, 256)), k=256),
            silu=pb.SiluRequest(x=from_torch(torch.ones(256, 1)), up=from_torch(torch.ones(1, 600))))
    launches = _launches(small_server)
    code, line = _refused(small_server, method, request)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert line is not None and line["status"] == "RESOURCE_EXHAUSTED", line
    assert "--max-message-bytes" in line["reason"]
    assert _launches(small_server) == launches, "the work was done before the refusal"


def _launches(server) -> int:
    from logitserve.v1 import logitserve_pb2 as pb
    with grpc.insecure_channel(server.target) as channel:
        return _stub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10).stats.launches


# --- answers held for clients that do not read them ------------------------------------------

def _rpc_lines(server, n, timeout=60.0):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [e for e in server.events if e.get("event") == "rpc" and e.get("rpc") in ("Silu", "Step")]
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{len(lines)} rpc lines, wanted {n}")


def _swiglu_request(rows=1024, width=1024) -> bytes:
    """A 128 KB request whose answer is rows * width float32 (4 MiB by default)."""
    import torch
    from logitserve.server.tensors import from_torch
    from logitserve.v1 import logitserve_pb2 as pb
    return pb.SiluRequest(x=from_torch(torch.ones(rows, 1)), up=from_torch(torch.ones(1, width))).SerializeToString()


SILU = "/logitserve.v1.LogitServe/Silu"


def test_unread_answers_are_bounded_server_wide():
    """Four connections each send one call with a 40 MiB answer and never read: with
    --max-held-answer-bytes 50 MiB one is answered, three get RESOURCE_EXHAUSTED before the
    work, and RSS grows by under 150 MiB (before: each answer held about three times and nothing
    bounded them, +510 MiB). Once those clients leave, the bytes are free again."""
    from raw_h2 import StuckClient
    import time
    import torch
    from logitserve.client import Client
    with ServerProcess("--max-held-answer-bytes", str(50 << 20), "--warmup-dtypes", "none",
                       "--busy-poll-us", "0", "--log-level", "debug") as server:
        request = _swiglu_request(1024, 10240)
        with Client(server.target) as client:  # the first call's own memory (torch's code paths) first
            client.swiglu(torch.ones(4, 1), torch.ones(1, 4))
        server.events.clear()
        time.sleep(0.5)
        before = server.rss_kib()
        stuck = [StuckClient("127.0.0.1", server.port) for _ in range(4)]
        for client in stuck:
            client.call(SILU, request)
        lines = _rpc_lines(server, 4)
        time.sleep(1)
        grown = (server.rss_kib() - before) / 1024
        print(f"4 unread 40 MiB answers: RSS +{grown:.1f} MiB")
        codes = sorted(line["status"] for line in lines)
        assert codes == ["OK"] + ["RESOURCE_EXHAUSTED"] * 3, codes
        assert all("--max-held-answer-bytes" in l["reason"] for l in lines if l["status"] != "OK")
        assert grown < 150, f"RSS grew {grown:.1f} MiB"
        for client in stuck:
            client.close()
        time.sleep(1)
        with Client(server.target) as client:
            out = client.swiglu(torch.ones(1024, 1), torch.ones(1, 10240))
        assert out.shape == (1024, 10240)


def test_unread_answers_are_bounded_per_connection():
    """One connection sends three calls with 4 MiB answers and reads none: with
    --max-held-answer-bytes-per-connection 10 MiB the third is RESOURCE_EXHAUSTED before the
    work; another connection is still served."""
    from raw_h2 import StuckClient
    with ServerProcess("--max-held-answer-bytes-per-connection", str(10 << 20), "--warmup-dtypes", "none",
                       "--busy-poll-us", "0", "--log-level", "debug") as server:
        stuck = StuckClient("127.0.0.1", server.port)
        for _ in range(3):
            stuck.call(SILU, _swiglu_request())
        lines = _rpc_lines(server, 3)
        assert sorted(line["status"] for line in lines) == ["OK", "OK", "RESOURCE_EXHAUSTED"]
        assert any("--max-held-answer-bytes-per-connection" in line.get("reason", "") for line in lines)
        import torch
        from logitserve.client import Client
        with Client(server.target) as client:
            assert client.swiglu(torch.ones(1024, 1), torch.ones(1, 1024)).shape == (1024, 1024)
        stuck.close()


def test_streams_per_connection_and_connections_are_bounded():
    """--max-streams-per-connection is the SETTINGS_MAX_CONCURRENT_STREAMS the server announces
    (before: none, unbounded); past --max-connections a new connection is closed at once."""
    import socket
    import time
    from raw_h2 import StuckClient
    with ServerProcess("--max-streams-per-connection", "7", "--max-connections", "3", "--warmup-dtypes", "none",
                       "--busy-poll-us", "0") as server:
        first = StuckClient("127.0.0.1", server.port)
        assert first.settings().get(0x3) == 7
        others = [StuckClient("127.0.0.1", server.port) for _ in range(2)]
        time.sleep(0.2)
        refused = 0
        for _ in range(3):
            try:
                extra = StuckClient("127.0.0.1", server.port)
                refused += extra.first == b""
                extra.close()
            except (ConnectionError, socket.timeout):
                refused += 1
        assert refused == 3
        for client in (first, *others):
            client.close()


# --- drain --------------------------------------------------------------------------------

def test_drain_keeps_health_answering_ends_calls_unavailable_and_exits_in_bound():
    """SIGTERM with --grace-period-s 1 while a launch takes 20 s and three calls wait behind it:
    an open channel's Health/Check answers NOT_SERVING during the grace period (before: SERVING,
    then UNAVAILABLE), every call ends UNAVAILABLE (before: CANCELLED), and the process exits 0
    within grace + 4 s (before: after the 20 s launch)."""
    import threading
    import time
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from logitserve.client import Client, LogitServeError
    server = ServerProcess("--max-batch-rows", "1", "--grace-period-s", "1", "--warmup-dtypes", "none",
                           "--busy-poll-us", "0", launch_delay_ms=20_000)
    outcomes = {}
    try:
        def call(i):
            with Client(server.target, retries=0, timeout=60) as c:
                try:
                    c.softmax(np.ones((1, 4), np.float32))
                    outcomes[i] = "OK"
                except LogitServeError as exc:
                    outcomes[i] = exc.code.name
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # one launching (20 s), three waiting
        with grpc.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            t0 = time.monotonic()
            server.proc.send_signal(15)
            statuses = []
            while time.monotonic() - t0 < 0.8:
                try:
                    statuses.append(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                except grpc.RpcError as exc:
                    statuses.append(exc.code().name)
                time.sleep(0.1)
        code = server.proc.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        server.close()
    print([(e["ts"], e["event"]) for e in server.events if e["event"] != "rpc"][-6:])
    assert code == 0
    print(f"drain: exit {took:.1f} s after SIGTERM (grace 1 s), calls {sorted(outcomes.values())}, health {statuses}")
    assert statuses and all(s == health_pb2.HealthCheckResponse.NOT_SERVING for s in statuses), statuses
    assert sorted(outcomes.values()) == ["UNAVAILABLE"] * 4, outcomes
    assert took < 1 + 4, f"exited {took:.1f} s after SIGTERM"


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


def test_header_only_streams_do_not_pin_memory():
    """30,000 header-only streams (no body, never ended) on one connection, no token: RSS grows
    under 30 MiB (before: +90 MiB, every stream accepted and kept); the default
    --max-streams-per-connection (100) refuses the rest."""
    import time
    from raw_h2 import END_HEADERS, HEADERS, StuckClient, _frame, _header
    with ServerProcess("--warmup-dtypes", "none", "--busy-poll-us", "0") as server:
        time.sleep(0.5)
        before = server.rss_kib()
        client = StuckClient("127.0.0.1", server.port)
        block = b"".join(_header(k, v) for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", "/logitserve.v1.LogitServe/Softmax"),
            (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")))
        for start in range(0, 30_000, 1000):
            client.sock.sendall(b"".join(_frame(HEADERS, END_HEADERS, 1 + 2 * i, block)
                                         for i in range(start, start + 1000)))
        time.sleep(3)
        grown = (server.rss_kib() - before) / 1024
        client.close()
    print(f"30,000 header-only streams: RSS +{grown:.1f} MiB")
    assert grown < 30, f"RSS grew {grown:.1f} MiB"
