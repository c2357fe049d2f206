"""The client on its own: the tensor codec, request building, retries of UNAVAILABLE only,
per-call timeouts, and importing without torch."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import AsyncClient, Client, LogitServeError
from logitserve.client import codec, messages
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

# ---------------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "bool"])
def test_numpy_round_trip(dtype):
    x = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    msg = codec.encode(x)
    assert list(msg.shape) == [2, 3, 4] and len(msg.data) == x.nbytes
    y = codec.decode(msg)
    assert y.dtype == x.dtype and y.flags.writeable
    np.testing.assert_array_equal(y, x)


def test_numpy_views_and_byte_order_are_normalised():
    x = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]  # big-endian, strided
    msg = codec.encode(x)
    assert msg.dtype == pb.DTYPE_FLOAT32 and msg.data == np.ascontiguousarray(x, dtype="<f4").tobytes()
    np.testing.assert_array_equal(codec.decode(msg), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
                                   torch.int64, torch.bool])
def test_torch_round_trip(dtype):
    x = (torch.randn(4, 6) * 4).to(dtype).t()  # a transposed view
    msg = codec.encode(x)
    back = codec.decode_torch(msg)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(back, x)
    arr = codec.decode(msg)
    if dtype == torch.bfloat16:  # numpy has no bfloat16: widened to float32, exactly
        assert arr.dtype == np.float32
        np.testing.assert_array_equal(arr, x.float().numpy())
    else:
        np.testing.assert_array_equal(arr, x.numpy())


def test_bfloat16_bits_are_the_upper_half_of_float32():
    x = torch.tensor([1.0, -2.5, float("inf"), 3.140625], dtype=torch.bfloat16)
    msg = codec.encode(x)
    assert msg.dtype == pb.DTYPE_BFLOAT16
    expect = (np.array([1.0, -2.5, np.inf, 3.140625], np.float32).view(np.uint32) >> 16).astype("<u2")
    assert msg.data == expect.tobytes()


def test_codec_errors_name_the_field():
    with pytest.raises(TypeError, match="logits: dtype complex64 has no wire dtype"):
        codec.encode(np.zeros(3, np.complex64), "logits")
    with pytest.raises(TypeError, match="x: dtype torch.uint8"):
        codec.encode(torch.zeros(3, dtype=torch.uint8), "x")
    bad = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(ValueError, match=r"out.data: 20 bytes, but shape \[2, 3\] of float32 needs 24"):
        codec.decode(bad, "out")
    with pytest.raises(ValueError, match="unknown value 42"):
        codec.decode(pb.Tensor(dtype=42), "out")


def test_client_imports_and_encodes_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np\n"
            "from logitserve.client import Client, codec, messages\n"
            "m = messages.sample_request(np.zeros((2, 3), np.float32), temperature=[0.5, 1.0], seed=3)\n"
            "assert m.HasField('temperature_rows') and m.seed == 3\n"
            "print(codec.decode(m.logits).shape)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(2, 3)"


# ------------------------------------------------------------------------------------- requests


def test_sample_request_scalars_and_rows():
    m = messages.sample_request(np.zeros((3, 5), np.float32), temperature=0.5, top_k=np.array([1, 2, 3]),
                                top_p=[0.9, 1, 1], min_p=np.float32(0.1), seed=None, step=torch.tensor(4),
                                filter_order="joint", random_val=None)
    assert m.temperature == 0.5 and not m.HasField("temperature_rows")
    assert codec.decode(m.top_k_rows).tolist() == [1, 2, 3]
    assert codec.decode(m.top_p_rows).dtype == np.float64  # integers given for a float: widened
    assert m.min_p == pytest.approx(0.1) and m.step == 4
    assert not m.HasField("seed") and not m.HasField("seed_rows") and not m.HasField("random_val")
    assert m.filter_order == pb.FILTER_ORDER_JOINT
    with pytest.raises(ValueError, match="filter_order: must be one of top_k_first, joint"):
        messages.sample_request(np.zeros((1, 2)), filter_order="vllm")


def test_step_request():
    m = messages.step_request("s1", sample={"logits": np.zeros((1, 2))}, swiglu={"gate": np.ones(2), "up": np.ones(2)})
    assert m.id == "s1" and m.HasField("sample") and m.silu.HasField("up") and not m.HasField("softmax")
    with pytest.raises(ValueError, match="silu or swiglu"):
        messages.step_request(silu={"x": np.ones(2)}, swiglu={"gate": np.ones(2), "up": np.ones(2)})
    with pytest.raises(TypeError, match="unknown operator"):
        messages.step_request(topk={"x": 1})


# ---------------------------------------------------------------------- retries and timeouts


class FlakyServicer(pb_grpc.LogitServeServicer):
    """GetServerInfo fails with ``code`` the first ``failures`` times; Softmax sleeps."""

    def __init__(self, failures: int, code: grpc.StatusCode):
        self.failures, self.code, self.calls = failures, code, 0
        self.lock = threading.Lock()

    def GetServerInfo(self, request, context):
        with self.lock:
            self.calls += 1
            failing = self.calls <= self.failures
        if failing:
            context.abort(self.code, f"attempt {self.calls} fails")
        return pb.GetServerInfoResponse(version="fake", backend="torch", dtypes=[pb.DTYPE_FLOAT32])

    def Softmax(self, request, context):
        time.sleep(1.0)
        return pb.SoftmaxResponse(out=request.x)


@pytest.fixture
def flaky():
    def start(failures: int, code=grpc.StatusCode.UNAVAILABLE):
        servicer = FlakyServicer(failures, code)
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_LogitServeServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append(server)
        return servicer, f"127.0.0.1:{port}"

    started: list = []
    yield start
    for server in started:
        server.stop(0)


def test_unavailable_is_retried(flaky):
    servicer, target = flaky(2)
    with Client(target, retries=3) as c:
        assert c.server_info().version == "fake"
    assert servicer.calls == 3


def test_retries_run_out(flaky):
    servicer, target = flaky(5)
    with Client(target, retries=1) as c, pytest.raises(LogitServeError) as info:
        c.server_info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.details == "attempt 2 fails"
    assert servicer.calls == 2


def test_other_codes_are_not_retried(flaky):
    servicer, target = flaky(1, grpc.StatusCode.INVALID_ARGUMENT)
    with Client(target, retries=3) as c, pytest.raises(LogitServeError) as info:
        c.server_info()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and servicer.calls == 1


def test_async_client_retries(flaky):
    import asyncio

    servicer, target = flaky(2)

    async def main():
        async with AsyncClient(target, retries=2) as c:
            return await c.server_info()

    assert asyncio.run(main()).version == "fake" and servicer.calls == 3


def test_per_call_timeout_overrides_the_client_default(flaky):
    _, target = flaky(0)
    with Client(target, timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(LogitServeError) as info:
            c.softmax(np.ones(2, np.float32), timeout=0.2)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 0.9
        np.testing.assert_array_equal(c.softmax(np.ones(2, np.float32)), np.ones(2))  # echoed by the fake


def test_unreachable_server_gives_unavailable_after_retries():
    with socketless_port() as port, Client(f"127.0.0.1:{port}", retries=2, timeout=20) as c:
        t0 = time.monotonic()
        with pytest.raises(LogitServeError) as info:
            c.server_info()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t0 >= 0.05  # it waited between attempts (backoff 50 ms, then 100 ms)


class socketless_port:
    """A port nothing listens on (bound, not listening, for the duration)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
