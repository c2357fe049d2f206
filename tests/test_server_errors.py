"""Bad requests, limits, deadlines, cancellation, a full queue and a device fault: each answered
with its status code and a message naming the field, and the server answering correctly after.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import AsyncClient, Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.tensors import from_torch
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
MAX_MESSAGE = 1 << 20


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          max_delay_us=0, max_rows=16, max_vocab=4096, max_message_bytes=MAX_MESSAGE)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.LogitServeStub(channel)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def T(x) -> pb.Tensor:
    return from_torch(torch.as_tensor(x))


LOGITS = torch.randn(2, 6)
GOOD = dict(logits=T(LOGITS))


def raw(dtype=pb.DTYPE_FLOAT32, shape=(2, 300), nbytes=2400) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape, data=b"\0" * nbytes)


# (rpc, request, status, text the message must contain)
BAD_REQUESTS = {
    "data shorter than shape": ("Sample", pb.SampleRequest(logits=raw(nbytes=1000)), INVALID,
                                "logits.data: 1000 bytes, but shape [2, 300] of float32 needs 2400"),
    "data longer than shape": ("Sample", pb.SampleRequest(logits=raw(nbytes=2404)), INVALID, "logits.data: 2404"),
    "unknown dtype": ("Sample", pb.SampleRequest(logits=raw(dtype=99)), INVALID, "logits.dtype: unknown value 99"),
    "dtype not set": ("Softmax", pb.SoftmaxRequest(x=raw(dtype=pb.DTYPE_UNSPECIFIED)), INVALID, "x.dtype: not set"),
    "integer logits": ("Sample", pb.SampleRequest(logits=raw(pb.DTYPE_INT32)), INVALID,
                       "logits.dtype: must be one of float16, bfloat16, float32, float64, got int32"),
    "float64 gate logits": ("RouteExperts", pb.RouteExpertsRequest(gate_logits=raw(pb.DTYPE_FLOAT64, nbytes=4800), k=1),
                            INVALID, "gate_logits.dtype"),
    "logits of rank 1": ("Sample", pb.SampleRequest(logits=raw(shape=(600,))), INVALID,
                         "logits.shape: rank must be 2, got 1"),
    "scores of rank 4": ("CausalSoftmax", pb.CausalSoftmaxRequest(x=raw(shape=(1, 2, 2, 150))), INVALID,
                         "x.shape: rank must be 2 or 3"),
    "empty tensor": ("Sample", pb.SampleRequest(logits=raw(shape=(0, 300), nbytes=0)), INVALID,
                     "logits.shape: dimension 0 is 0"),
    "missing tensor": ("Sample", pb.SampleRequest(temperature=0.5), INVALID, "logits: required"),
    "T < S": ("CausalSoftmax", pb.CausalSoftmaxRequest(x=T(torch.randn(5, 3))), INVALID,
              "x.shape: needs T >= S"),
    "k > E": ("RouteExperts", pb.RouteExpertsRequest(gate_logits=T(torch.randn(2, 8)), k=9), INVALID,
              "k: must be in [1, E] with E = 8"),
    "k = 0": ("RouteExperts", pb.RouteExpertsRequest(gate_logits=T(torch.randn(2, 8)), k=0), INVALID, "k: must be"),
    "top_p 0": ("Sample", pb.SampleRequest(**GOOD, top_p=0.0), INVALID, "top_p: must be in (0, 1], got 0.0"),
    "top_p above 1": ("Sample", pb.SampleRequest(**GOOD, top_p=1.5), INVALID, "top_p: must be in (0, 1]"),
    "per-row top_p": ("Sample", pb.SampleRequest(**GOOD, top_p_rows=T(torch.tensor([0.5, 1.01]))), INVALID,
                      "top_p_rows[1]: must be in (0, 1]"),
    "negative temperature": ("Sample", pb.SampleRequest(**GOOD, temperature=-0.1), INVALID,
                             "temperature: must be finite and >= 0, got -0.1"),
    "NaN temperature": ("Sample", pb.SampleRequest(**GOOD, temperature_rows=T(torch.tensor([1.0, float("nan")]))),
                        INVALID, "temperature_rows[1]"),
    "negative top_k": ("Sample", pb.SampleRequest(**GOOD, top_k=-1), INVALID, "top_k: must be >= 0"),
    "min_p above 1": ("Sample", pb.SampleRequest(**GOOD, min_p=2.0), INVALID, "min_p: must be in [0, 1]"),
    "negative seed": ("Sample", pb.SampleRequest(**GOOD, seed_rows=T(torch.tensor([3, -4]))), INVALID,
                      "seed_rows[1]: must be >= 0, got -4"),
    "random_val of 1": ("Sample", pb.SampleRequest(**GOOD, random_val=1.0), INVALID, "random_val: must be in [0, 1)"),
    "random_val with min_p": ("Sample", pb.SampleRequest(**GOOD, random_val=0.5, min_p=0.1), INVALID,
                              "min_p: must be 0 with random_val"),
    "per-row length": ("Sample", pb.SampleRequest(**GOOD, temperature_rows=T(torch.ones(3))), INVALID,
                       "temperature_rows.shape: must be [2] (one value per row), got [3]"),
    "per-row rank": ("Sample", pb.SampleRequest(**GOOD, top_k_rows=T(torch.ones(2, 1, dtype=torch.int64))), INVALID,
                     "top_k_rows.shape: rank must be 1"),
    "per-row dtype": ("Sample", pb.SampleRequest(**GOOD, top_k_rows=T(torch.ones(2))), INVALID,
                      "top_k_rows.dtype: must be one of int32, int64, got float32"),
    "unknown filter order": ("Sample", pb.SampleRequest(**GOOD, filter_order=7), INVALID,
                             "filter_order: unknown value 7"),
    "softmax dim": ("Softmax", pb.SoftmaxRequest(x=T(torch.randn(2, 3)), dim=2), INVALID,
                    "dim: must be in [-2, 2) for a rank-2 x, got 2"),
    "swiglu dtypes": ("Silu", pb.SiluRequest(x=T(torch.randn(2, 3)), up=T(torch.randn(2, 3).double())), INVALID,
                      "up.dtype: must match x.dtype (float32), got float64"),
    "swiglu shapes": ("Silu", pb.SiluRequest(x=T(torch.randn(2, 3)), up=T(torch.randn(2, 4))), INVALID,
                      "up.shape: [2, 4] does not broadcast with x.shape [2, 3]"),
    "empty step": ("Step", pb.StepRequest(id="s"), INVALID, "step: sets none of"),
    "bad op in a step": ("Step", pb.StepRequest(softmax=pb.SoftmaxRequest(x=T(torch.randn(2))),
                                                sample=pb.SampleRequest(logits=raw(nbytes=8))), INVALID,
                         "sample.logits.data: 8 bytes"),
    "too many rows": ("Sample", pb.SampleRequest(logits=T(torch.randn(17, 4))), EXHAUSTED,
                      "logits: 17 rows, over this server's limit of 16 (--max-rows)"),
    "too wide": ("Softmax", pb.SoftmaxRequest(x=T(torch.randn(1, 4097))), EXHAUSTED,
                 "x: rows of 4097 elements, over this server's limit of 4096 (--max-vocab)"),
    "too many experts": ("RouteExperts", pb.RouteExpertsRequest(gate_logits=T(torch.randn(1, 4097)), k=1),
                         EXHAUSTED, "--max-vocab"),
    "message over the limit": ("Softmax", pb.SoftmaxRequest(x=raw(shape=(1, MAX_MESSAGE // 4 + 8),
                                                                    nbytes=MAX_MESSAGE + 32)), EXHAUSTED, ""),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_rejected_with_its_field(server, stub, client, case):
    rpc, request, code, text = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, rpc)(request, timeout=30)
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()
    # ... and the server goes on answering correctly.
    x = torch.randn(2, 5)
    np.testing.assert_array_equal(client.softmax(x), kernels.softmax(x, backend="torch").numpy())


def test_client_raises_logitserve_error(client):
    with pytest.raises(LogitServeError) as info:
        client.sample(np.zeros((2, 4), np.float32), top_p=[0.5, 0.0])
    assert info.value.code == INVALID and "top_p_rows[1]" in info.value.details
    assert str(info.value).startswith("INVALID_ARGUMENT: top_p_rows[1]")


def test_device_fault_fails_the_call_and_the_server_goes_on(client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")

    monkeypatch.setattr(kernels, "silu", broken)
    with pytest.raises(LogitServeError) as info:
        client.silu(np.ones(3, np.float32))
    assert info.value.code == grpc.StatusCode.INTERNAL and "illegal memory access" in info.value.details
    monkeypatch.undo()
    np.testing.assert_array_equal(client.silu(np.zeros(3, np.float32)), np.zeros(3, np.float32))


# --------------------------------------------------- deadlines, cancellation and the full queue


@pytest.fixture
def slow_server():
    """Calls wait 2 s in the batcher for company: time enough to expire, cancel or fill up."""
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          max_delay_us=2_000_000, max_queue=2)
    with ServerThread(config) as s:
        yield s


def test_expired_deadline(slow_server):
    batcher = slow_server.service.batcher
    with Client(slow_server.target, retries=0) as c:
        t0 = time.monotonic()
        with pytest.raises(LogitServeError) as info:
            c.softmax(np.ones((1, 4), np.float32), timeout=0.3)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.5
    # The server dropped the expired call before launching it.
    slow_server.run(asyncio.sleep(0.1))
    assert batcher.queue_depth == 0 and batcher.launches == 0


def test_client_cancelling_mid_call(slow_server):
    batcher = slow_server.service.batcher

    async def main():
        async with AsyncClient(slow_server.target) as c:
            task = asyncio.ensure_future(c.softmax(np.ones((1, 4), np.float32)))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)

    asyncio.run(main())
    assert batcher.queue_depth == 0 and batcher.launches == 0
    with Client(slow_server.target) as c:  # and it still serves (after its 2 s batching delay)
        np.testing.assert_allclose(c.softmax(np.ones((1, 4), np.float32)), 0.25)


def test_full_queue_answers_resource_exhausted_at_once(slow_server):
    async def main():
        async with AsyncClient(slow_server.target, retries=0) as c:
            x = np.ones((1, 4), np.float32)
            waiting = [asyncio.ensure_future(c.softmax(x)) for _ in range(2)]
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            with pytest.raises(LogitServeError) as info:
                await c.softmax(x)
            elapsed = time.monotonic() - t0
            return info.value, elapsed, await asyncio.gather(*waiting)

    error, elapsed, served = asyncio.run(main())
    assert error.code == EXHAUSTED and "max-queue 2" in error.details
    assert elapsed < 1.0
    for out in served:  # the queued calls are still served
        np.testing.assert_allclose(out, 0.25)
