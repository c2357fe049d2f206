"""Two leftovers of issue 32's hardening, on an in-process server (server/testing.py).

1. A failed launch's calls are freed by reference counting as their handlers return. The error a
   launch raised kept, in its traceback, the frames it came through: the batcher's, holding the
   batch (its calls and their futures), and the device's, holding the calls and the launch's
   future, which holds the error. When a batch of several calls failed (out of device memory,
   say) and its calls were retried alone, that error reached no handler and no one cut it loose
   (server/api/guard.py's ``let_go``): every call of the batch, with its request's bytes, stayed
   until the next full garbage collection, even the calls then answered OK.
2. A stream whose client leaves while an answer waits for it to read (a stuck client) ends by
   GeneratorExit, which the guard did not catch: its log line and metrics said OK, and the
   call's task stayed counted as running (a drain then waited out its whole grace period).

Launch failures are injected through ``DeviceHandle.before_launch`` (as tests/test_faults.py
does); no request can set it.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import weakref

import grpc
import pytest
import torch

from logitserve.server import ServerConfig
from logitserve.server.tensors import from_torch
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

OK = grpc.StatusCode.OK
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
QUEUED = 3  # calls queued behind a held launch: they launch together, as one batch


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          max_delay_us=0, max_batch_rows=64, max_queue=8)
    with ServerThread(config) as server:
        yield server


class FailingLaunches:
    """A before_launch hook: holds the first launch until :attr:`release` is set, so the calls
    queued meanwhile launch as one batch; launches of more than ``fits`` calls run out of device
    memory. Keeps a weak reference to every call it sees (a call holds its request's bytes)."""

    def __init__(self, fits: int):
        self.fits = fits
        self.calls: list[weakref.ref] = []
        self.launches: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, calls) -> None:
        self.calls += [weakref.ref(c) for c in calls]
        self.launches.append(len(calls))
        self.entered.set()
        assert self.release.wait(30), "the held launch was never released"
        if len(calls) > self.fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected, a launch of {len(calls)} calls)")

    def alive(self) -> int:
        """How many of the calls seen are still alive (a call retried alone is seen twice)."""
        return len({id(call) for ref in self.calls if (call := ref()) is not None})


def _softmax(i: int) -> pb.SoftmaxRequest:
    return pb.SoftmaxRequest(x=from_torch(torch.full((1, 64), float(i))))


def _code(future) -> grpc.StatusCode:
    try:
        future.result()
    except grpc.RpcError as exc:
        return exc.code()
    return OK


@pytest.mark.parametrize("fits, codes", [(1, [OK] * (1 + QUEUED)), (0, [RESOURCE_EXHAUSTED] * (1 + QUEUED))],
                         ids=["batch out of memory, each call alone served",
                              "batch out of memory, each call alone out of memory too"])
def test_a_failed_launch_frees_its_calls_without_garbage_collection(server, fits, codes):
    hook = FailingLaunches(fits)
    server.service.handle.before_launch = hook
    gc.collect()
    gc.disable()  # a call still alive below is held by a reference cycle
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.LogitServeStub(channel)
            futures = [stub.Softmax.future(_softmax(0), timeout=30)]
            assert hook.entered.wait(10)
            futures += [stub.Softmax.future(_softmax(i), timeout=30) for i in range(1, 1 + QUEUED)]
            deadline = time.monotonic() + 10
            while server.service.batcher.queue_depth < QUEUED and time.monotonic() < deadline:
                time.sleep(0.005)
            hook.release.set()
            assert [_code(f) for f in futures] == codes
        # The launch of 1, the batch of QUEUED (out of memory), then each of them alone.
        assert hook.launches == [1, QUEUED] + [1] * QUEUED
        deadline = time.monotonic() + 5  # the handlers return just after their status is sent
        while hook.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        alive = hook.alive()
    finally:
        gc.enable()
        server.service.handle.before_launch = None
    assert alive == 0, f"{alive} of the {1 + QUEUED} calls are held until a garbage collection"


class Lines(logging.Handler):
    """Keeps the fields of every ``rpc`` line of one method (server/api/guard.py), whatever the
    logging configuration (propagation to the root's handlers included)."""

    def __init__(self, rpc: str):
        super().__init__(logging.DEBUG)
        self.rpc, self.fields = rpc, []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if record.getMessage() == "rpc" and fields.get("rpc") == self.rpc:
            self.fields.append(fields)


def test_a_stream_whose_stuck_client_leaves_is_cancelled(server):
    """The client reads one answer, stops reading while the next ones wait to be sent (its
    receive window is the default 64 KiB, not grown: a 256 KiB answer fills it), then cancels."""
    failures = server.service.metrics.failures.labels("StreamSteps", "CANCELLED")
    before = failures._value.get()
    step = pb.StepRequest(id="s", softmax=pb.SoftmaxRequest(x=from_torch(torch.zeros(1, 65536))))
    requests: queue.Queue = queue.Queue()

    def sent():
        while (request := requests.get()) is not None:
            yield request

    logger, lines = logging.getLogger("logitserve.rpc"), Lines("StreamSteps")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)  # a cancelled call's line is at debug
    try:
        with grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            call = pb_grpc.LogitServeStub(channel).StreamSteps(sent(), timeout=30)
            for _ in range(4):
                requests.put(step)
            assert next(call).id == "s"
            time.sleep(0.3)  # the server answers the rest; the second answer waits to be sent
            call.cancel()
            requests.put(None)
            deadline = time.monotonic() + 10
            while server.service.guard.running and time.monotonic() < deadline:
                time.sleep(0.01)
            running = server.service.guard.running
            time.sleep(0.1)  # the log line and metrics follow on the loop's next turn
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert [line["status"] for line in lines.fields] == ["CANCELLED"], lines.fields
    assert failures._value.get() == before + 1
    assert running == 0, "the cancelled stream's call is still counted as running"
