"""Issue 25: memory a hostile client can pin, the answer-size check, drain, start-up and
operator defects. Each test fails on the code before the fix (figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from logitserve.server.api.guard import Guard, _GuardedGenericHandler
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
