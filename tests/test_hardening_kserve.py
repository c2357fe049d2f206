"""Issue 32 on the KServe v2 front: answers held for clients that never read them
(--max-held-answer-bytes and its per-connection bound, through the same accounting as
logitserve.v1), output slices past their region's end, an unparseable message inside
ModelStreamInfer, the unknown-model log line. Each test fails on the code before the fix
(figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import time
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from logitserve.server.process import ServerProcess
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
# A stream whose client left keeps the drain waiting its whole grace period: 1 s, not 10.
FLAGS = ("--warmup-dtypes", "none", "--busy-poll-us", "0", "--log-level", "debug", "--grace-period-s", "1")
BIG = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def _swiglu(rows: int, width: int) -> kpb.ModelInferRequest:
    """A small request whose answer is rows * width float32 (OUT = silu(GATE [rows, 1]) * UP [1, width])."""
    tensor = kpb.ModelInferRequest.InferInputTensor
    return kpb.ModelInferRequest(
        model_name="swiglu",
        inputs=[tensor(name="GATE", datatype="FP32", shape=[rows, 1]),
                tensor(name="UP", datatype="FP32", shape=[1, width])],
        raw_input_contents=[np.ones(rows, np.float32).tobytes(), np.ones(width, np.float32).tobytes()])


def _counts(target: str) -> tuple[int, int, int]:
    """swiglu's inferences answered and failed (ModelStatistics), and the server's launches."""
    with grpc.insecure_channel(target) as channel:
        stats = kpb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            kpb.ModelStatisticsRequest(name="swiglu"), timeout=10).model_stats[0].inference_stats
        launches = pb_grpc.LogitServeStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10).stats.launches
    return stats.success.count, stats.fail.count, launches


def _settled(target: str, before: tuple[int, int, int], calls: int, timeout: float = 60.0) -> tuple[int, int, int]:
    """How many more swiglu inferences were answered and failed, and launches made, than
    ``before`` (:func:`_counts`), once ``calls`` more have ended."""
    ok0, failed0, launches0 = before
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok, failed, launches = _counts(target)
        if ok + failed - ok0 - failed0 >= calls:
            return ok - ok0, failed - failed0, launches - launches0
        time.sleep(0.05)
    raise AssertionError(f"{ok + failed - ok0 - failed0} of {calls} inferences ended")


def _received(sock, wait: float = 0.3) -> bytes:
    """Every byte the server has sent on a stuck client's connection (reading them sends no
    WINDOW_UPDATE: the server still cannot send past its first 64 KiB)."""
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except TimeoutError:
        pass
    return data


def _infer_lines(server, n: int, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [e for e in server.events if e.get("event") == "rpc" and e.get("rpc") == "ModelInfer"]
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{len(lines)} ModelInfer log lines, wanted {n}")


# --- answers held for clients that do not read them ------------------------------------------

@pytest.mark.parametrize("method", [INFER, STREAM], ids=["ModelInfer", "ModelStreamInfer"])
def test_unread_answers_are_bounded_server_wide(method):
    """Four connections each send one swiglu inference with a 40 MiB answer and never read:
    with --max-held-answer-bytes 50 MiB one is answered and three are refused before the work
    (RESOURCE_EXHAUSTED naming the flag; in a stream, its error_message), and RSS grows by under
    110 MiB, the one answer's bytes and gRPC's copy of them (before: all four answered and held,
    +321 MiB through ModelInfer, +641 MiB through ModelStreamInfer). Once those clients leave,
    the bytes are free again."""
    from raw_h2 import StuckClient
    with ServerProcess("--max-held-answer-bytes", str(50 << 20), *FLAGS) as server:
        request = _swiglu(1024, 10240).SerializeToString()
        with grpc.insecure_channel(server.target) as channel:  # the first call's own memory first
            kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_swiglu(4, 4), timeout=30)
        time.sleep(0.5)
        server.events.clear()
        before = server.rss_kib()
        stuck = [StuckClient("127.0.0.1", server.port) for _ in range(4)]
        counts = _counts(server.target)
        for client in stuck:
            client.call(method, request)
        ok, failed, launches = _settled(server.target, counts, 4)
        time.sleep(1)
        grown = (server.rss_kib() - before) / 1024
        print(f"{method}: 4 unread 40 MiB answers: {ok} answered, {failed} refused, RSS +{grown:.1f} MiB")
        assert (ok, failed, launches) == (1, 3, 1)
        if method == INFER:
            refusals = [line for line in _infer_lines(server, 4) if line["status"] != "OK"]
            assert [line["status"] for line in refusals] == ["RESOURCE_EXHAUSTED"] * 3, refusals
            assert all("--max-held-answer-bytes" in line["reason"] for line in refusals)
        else:  # each refusal is a small error_message the client's window lets through
            named = [b"(--max-held-answer-bytes)" in _received(client.sock) for client in stuck]
            assert sorted(named) == [False, True, True, True], named
        assert grown < 110, f"RSS grew {grown:.1f} MiB"
        for client in stuck:
            client.close()
        time.sleep(1)
        with grpc.insecure_channel(server.target, options=BIG) as channel:
            stub = kpb_grpc.GRPCInferenceServiceStub(channel)
            if method == INFER:
                answer = stub.ModelInfer(_swiglu(1024, 10240), timeout=60)
            else:
                answer = next(iter(stub.ModelStreamInfer(iter([_swiglu(1024, 10240)]), timeout=60))).infer_response
        assert list(answer.outputs[0].shape) == [1024, 10240]


@pytest.mark.parametrize("method", [INFER, STREAM], ids=["ModelInfer", "ModelStreamInfer"])
def test_unread_answers_are_bounded_per_connection(method):
    """One connection sends three swiglu inferences with 4 MiB answers, each on its own stream,
    and reads none: with --max-held-answer-bytes-per-connection 10 MiB the third is refused
    before the work (before: all three answered); another connection is still served."""
    from raw_h2 import StuckClient
    with ServerProcess("--max-held-answer-bytes-per-connection", str(10 << 20), *FLAGS) as server:
        stuck = StuckClient("127.0.0.1", server.port)
        request = _swiglu(1024, 1024).SerializeToString()
        counts = _counts(server.target)
        for _ in range(3):
            stuck.call(method, request)
        ok, failed, launches = _settled(server.target, counts, 3)
        assert (ok, failed, launches) == (2, 1, 2)
        if method == INFER:
            refusals = [line for line in _infer_lines(server, 3) if line["status"] != "OK"]
            assert [line["status"] for line in refusals] == ["RESOURCE_EXHAUSTED"], refusals
            assert "--max-held-answer-bytes-per-connection" in refusals[0]["reason"]
        with grpc.insecure_channel(server.target, options=BIG) as channel:
            answer = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(_swiglu(1024, 1024), timeout=60)
        assert list(answer.outputs[0].shape) == [1024, 1024]
        stuck.close()


# --- bad requests: answered alone, with their reasons ----------------------------------------

@pytest.fixture(scope="module")
def server():
    with ServerProcess(*FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield kpb_grpc.GRPCInferenceServiceStub(channel)


def test_an_unparseable_message_mid_stream_is_answered_alone(server):
    """A message that is no ModelInferRequest between two good ones gets its error_message and
    the stream goes on, as any other bad request in it (before: the stream ended
    INVALID_ARGUMENT after the first answer)."""
    good = _swiglu(2, 3).SerializeToString()
    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_stream(STREAM)  # bytes in, bytes out
        answers = [kpb.ModelStreamInferResponse.FromString(a)
                   for a in call(iter([good, b"\x0a\x10short", good]), timeout=30)]
    assert [a.error_message for a in answers][::2] == ["", ""]
    assert [list(a.infer_response.outputs[0].shape) for a in answers[::2]] == [[2, 3], [2, 3]]
    assert answers[1].error_message.startswith("request: not a valid ModelInferRequest"), answers[1]


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata"])
def test_an_unknown_model_is_logged_with_its_reason(server, stub, method):
    """NOT_FOUND, and the call's log line says why (before: the line had no reason)."""
    request_id = f"unknown-model-{method}"
    request = (kpb.ModelInferRequest(model_name="nope") if method == "ModelInfer"
               else kpb.ModelMetadataRequest(name="nope"))
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(request, timeout=10, metadata=[("x-request-id", request_id)])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    deadline = time.monotonic() + 10
    while not (lines := [e for e in server.events if e.get("event") == "rpc" and e.get("request_id") == request_id]):
        assert time.monotonic() < deadline, "no log line"
        time.sleep(0.05)
    assert lines[0]["status"] == "NOT_FOUND"
    assert lines[0].get("reason", "").startswith("unknown model 'nope'"), lines[0]


# --- shared-memory slices past their region's end --------------------------------------------

REGION = 4096


@pytest.fixture(scope="module")
def region(stub):
    """A 4 KiB system region of this test's process, registered as "r4k"."""
    shm = shared_memory.SharedMemory(create=True, size=REGION)
    try:
        stub.SystemSharedMemoryRegister(kpb.SystemSharedMemoryRegisterRequest(
            name="r4k", key=shm.name, offset=0, byte_size=REGION), timeout=10)
        yield shm
        stub.SystemSharedMemoryUnregister(kpb.SystemSharedMemoryUnregisterRequest(name="r4k"), timeout=10)
    finally:
        shm.close()
        shm.unlink()


def _slice(parameters, offset: int, byte_size: int) -> None:
    parameters["shared_memory_region"].string_param = "r4k"
    parameters["shared_memory_offset"].int64_param = offset
    parameters["shared_memory_byte_size"].int64_param = byte_size


X = np.arange(8, dtype=np.float32).reshape(2, 4)


def _softmax(out=None, x=None) -> kpb.ModelInferRequest:
    """softmax of X [2, 4] (32 bytes in, 32 out); ``out`` / ``x``: (offset, byte_size) in "r4k"."""
    request = kpb.ModelInferRequest(model_name="softmax")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[2, 4])
    if x is None:
        request.raw_input_contents.append(X.tobytes())
    else:
        _slice(tensor.parameters, *x)
    if out is not None:
        _slice(request.outputs.add(name="OUT").parameters, *out)
    return request


PAST_END = "past the end of region 'r4k' (4096 bytes)"


@pytest.mark.parametrize("case, says", [
    # were answered OK, the output written into the slice's first 32 bytes:
    ({"out": (0, 1 << 40)}, ("OUT shared_memory_region: shared_memory_offset 0 + shared_memory_byte_size "
                             "1099511627776", PAST_END)),
    ({"out": (4000, 200)}, ("OUT shared_memory_region: shared_memory_offset 4000 + shared_memory_byte_size 200 "
                            "= 4200", PAST_END)),
    ({"out": (4080, 32)}, ("OUT shared_memory_region:", PAST_END)),
    ({"x": (0, 1 << 40)}, ("X shared_memory_byte_size: 1099511627776, but shape [2, 4] of FP32 needs 32 bytes",)),
    ({"x": (4080, 32)}, ("X shared_memory_region:", PAST_END)),
], ids=["output-2^40", "output-offset-plus-capacity", "output-offset", "input-2^40", "input-offset"])
def test_a_slice_past_its_regions_end_is_invalid(stub, region, case, says):
    """Triton's rule and docs/SERVICE.md's: an input's or output's shared_memory_offset +
    shared_memory_byte_size past its region's end is INVALID_ARGUMENT, an output's byte_size
    being a capacity the output need not fill (an input's must be its tensor's size)."""
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(_softmax(**case), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert all(part in err.value.details() for part in says), err.value.details()


def test_an_output_slice_within_its_region_takes_its_first_bytes(stub, region):
    """The whole region as OUT's capacity: OK, the 32 bytes written at its start."""
    region.buf[:REGION] = b"\xff" * REGION
    answer = stub.ModelInfer(_softmax(out=(0, REGION)), timeout=30)
    assert answer.outputs[0].parameters["shared_memory_byte_size"].uint64_param == 32
    got = np.frombuffer(region.buf[:32], np.float32).reshape(2, 4)
    want = np.exp(X - X.max(1, keepdims=True))
    np.testing.assert_allclose(got, want / want.sum(1, keepdims=True), rtol=1e-6)
    assert bytes(region.buf[32:64]) == b"\xff" * 32
