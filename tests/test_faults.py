"""Faults the service must survive: a device fault inside a batch's launch, clients leaving
mid-batch, a full queue, SIGTERM with calls in flight and a restart on the same port, and a
short mixed load with every answer checked (tests/load_run.py).

Faults are injected through ``DeviceHandle.before_launch``, the in-process fault-injection
hook the device calls on its launch thread just before each launch of a batch (no request can
set it). A hook that blocks on
an event holds one launch open, which makes the order of events deterministic: calls submitted
meanwhile wait in one group and launch together once it is released.
"""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logitserve.server.process import ServerProcess
from logitserve import kernels
from logitserve.client import Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.tensors import from_torch
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

OK = grpc.StatusCode.OK
INTERNAL = grpc.StatusCode.INTERNAL
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
POISON = 777.0  # a softmax input whose first element is this fails every launch it is part of


def _x(i: int, width: int = 6) -> torch.Tensor:
    return torch.arange(width, dtype=torch.float32).reshape(1, width) / (i + 1)


def _expected(x: torch.Tensor) -> np.ndarray:
    return kernels.softmax(x, backend="torch").numpy()


class Gate:
    """A before_launch hook: records each launch's size, holds launches, raises on demand.

    Launch ``n`` (1-based) passes once ``allowed >= n``; :meth:`hold` stops the next one,
    :meth:`allow` lets a number through, :meth:`open` lets all through.
    """

    def __init__(self):
        self.launches: list[int] = []
        self.allowed = float("inf")
        self.fail_all = False
        self.out_of_memory_over = float("inf")  # launches of more calls than this run out of device memory
        self._cond = threading.Condition()

    def __call__(self, calls) -> None:
        with self._cond:
            self.launches.append(len(calls))
            n = len(self.launches)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self.allowed >= n, timeout=60):
                raise RuntimeError("test gate never opened")
        if len(calls) > self.out_of_memory_over:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected, a launch of {len(calls)} calls)")
        if self.fail_all:
            raise RuntimeError("injected device fault (all launches)")
        if any(float(c.x.torch().reshape(-1)[0]) == POISON for c in calls):
            raise RuntimeError("injected device fault (poisoned launch)")

    def _set(self, allowed: float) -> None:
        with self._cond:
            self.allowed = allowed
            self._cond.notify_all()

    def hold(self) -> None:
        with self._cond:
            self.allowed = len(self.launches)

    def allow(self, n: int) -> None:
        self._set(self.allowed + n)

    def open(self) -> None:
        self._set(float("inf"))

    def wait_launches(self, n: int, timeout: float = 10.0) -> None:
        """Until ``n`` launches have reached the hook."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.launches) >= n, timeout=timeout), self.launches


@pytest.fixture
def gated():
    """An in-process server whose launches pass through a fresh :class:`Gate`."""
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          max_delay_us=0, max_batch_rows=64, max_queue=8)
    with ServerThread(config) as server:
        gate = Gate()
        server.service.handle.before_launch = gate
        try:
            with grpc.insecure_channel(server.target) as channel:
                yield server, gate, pb_grpc.LogitServeStub(channel)
        finally:
            gate.open()  # a failed test must not leave a launch held


def _request(x: torch.Tensor) -> pb.SoftmaxRequest:
    return pb.SoftmaxRequest(x=from_torch(x))


def _outcome(future) -> tuple[grpc.StatusCode, np.ndarray | None]:
    """(status, output) of a finished Softmax future."""
    try:
        reply = future.result()
    except grpc.FutureCancelledError:  # cancelled by this side
        return grpc.StatusCode.CANCELLED, None
    except grpc.RpcError as exc:
        return exc.code(), None
    return OK, np.frombuffer(reply.out.data, dtype="<f4").reshape(tuple(reply.out.shape))


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@contextlib.contextmanager
def _held_launch(server, gate: Gate, stub):
    """Hold the next launch, start one call and wait until its launch is inside the hook."""
    gate.hold()
    n = len(gate.launches) + 1
    first = stub.Softmax.future(_request(_x(100)), timeout=60)
    gate.wait_launches(n)
    try:
        yield first
    finally:
        gate.open()
    assert _outcome(first)[0] == OK


def _queue(server, stub, xs, timeout: float = 60):
    futures = [stub.Softmax.future(_request(x), timeout=timeout) for x in xs]
    _wait_until(lambda: server.service.batcher.queue_depth == len(xs))
    return futures


# ------------------------------------------------------------------------------ device faults


def test_fault_in_a_batch_fails_only_the_faulty_call_and_the_next_batch_is_served(gated):
    server, gate, stub = gated
    xs = [_x(i) for i in range(4)]
    xs[2] = torch.full((1, 6), POISON)
    with _held_launch(server, gate, stub):
        futures = _queue(server, stub, xs)
    outcomes = [_outcome(f) for f in futures]
    # Launch 1 (held), the 4 calls together (fails: a poisoned member), then each call alone.
    assert gate.launches[:2] == [1, 4] and sorted(gate.launches[2:]) == [1, 1, 1, 1]
    assert [code for code, _ in outcomes] == [OK, OK, INTERNAL, OK]
    for (code, out), x in zip(outcomes, xs):
        if code == OK:
            np.testing.assert_array_equal(out, _expected(x))
    code, out = _outcome(stub.Softmax.future(_request(_x(7)), timeout=30))
    assert code == OK
    np.testing.assert_array_equal(out, _expected(_x(7)))


def test_device_fault_during_a_batch_fails_its_calls_with_internal_then_service_resumes(gated):
    server, gate, stub = gated
    gate.hold()
    first = stub.Softmax.future(_request(_x(100)), timeout=60)
    gate.wait_launches(1)
    futures = _queue(server, stub, [_x(i) for i in range(3)])
    gate.fail_all = True  # the device breaks: the held launch and the batch of 3 behind it fail
    gate.open()
    errors = []
    for f in [first, *futures]:
        with pytest.raises(grpc.RpcError) as info:
            f.result()
        errors.append(info.value)
    assert {e.code() for e in errors} == {INTERNAL}
    assert gate.launches[:2] == [1, 3]  # then each of the 3 retried alone, failing again
    assert all("injected device fault" in e.details() for e in errors)
    gate.fail_all = False  # the fault passes: the very next batch is served
    futures = [stub.Softmax.future(_request(_x(i)), timeout=30) for i in range(3)]
    for f, i in zip(futures, range(3)):
        code, out = _outcome(f)
        assert code == OK
        np.testing.assert_array_equal(out, _expected(_x(i)))
    with grpc.insecure_channel(server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_batcher_sees_how_many_calls_the_server_holds(gated):
    """The occupancy the guard counts, which decides how a batch launches (server/engine/batcher.py)."""
    server, gate, stub = gated
    occupancy = server.service.occupancy

    def calls_in_server():
        return occupancy.calls
    with _held_launch(server, gate, stub):
        futures = _queue(server, stub, [_x(i) for i in range(3)])
        assert calls_in_server() == 4  # the held call and the three queued
    assert [_outcome(f)[0] for f in futures] == [OK] * 3
    _wait_until(lambda: calls_in_server() == 0)


def test_out_of_device_memory_is_resource_exhausted_and_a_batch_retries_its_calls_alone(gated):
    server, gate, stub = gated
    xs = [_x(i) for i in range(3)]
    gate.out_of_memory_over = 1
    with _held_launch(server, gate, stub):
        futures = _queue(server, stub, xs)
    for f, x in zip(futures, xs):
        code, out = _outcome(f)
        assert code == OK
        np.testing.assert_array_equal(out, _expected(x))
    assert gate.launches[-4:] == [3, 1, 1, 1]  # the batch of 3 ran out of memory; alone, each fits
    gate.out_of_memory_over = 0  # now not even one call fits
    with pytest.raises(grpc.RpcError) as info:
        stub.Softmax(_request(_x(5)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "out of memory" in info.value.details()
    gate.out_of_memory_over = float("inf")
    code, out = _outcome(stub.Softmax.future(_request(_x(6)), timeout=30))
    assert code == OK


def _health(server) -> int:
    with grpc.insecure_channel(server.target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_a_fault_that_leaves_the_device_unusable_turns_health_not_serving(gated):
    server, gate, stub = gated

    def device_gone():
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    server.service.handle.check = device_gone  # what the device check meets after a sticky CUDA error
    with pytest.raises(grpc.RpcError) as info:
        stub.Softmax(_request(torch.full((1, 6), POISON)), timeout=30)
    assert info.value.code() == INTERNAL
    _wait_until(lambda: _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING)


# ------------------------------------------------------------------------- clients that leave


def test_client_leaving_mid_launch_does_not_disturb_its_batch(gated):
    server, gate, stub = gated
    xs = [_x(i) for i in range(4)]
    gate.hold()
    first = stub.Softmax.future(_request(_x(100)), timeout=60)
    gate.wait_launches(1)
    futures = _queue(server, stub, xs)
    gate.allow(1)  # launch 1 finishes; launch 2, the four calls together, is held inside the device
    gate.wait_launches(2)
    assert gate.launches == [1, 4]
    futures[1].cancel()  # one client leaves in the middle of its batch's launch
    assert _outcome(futures[1])[0] == grpc.StatusCode.CANCELLED
    gate.open()
    assert _outcome(first)[0] == OK
    for i in (0, 2, 3):
        code, out = _outcome(futures[i])
        assert code == OK
        np.testing.assert_array_equal(out, _expected(xs[i]))
    assert gate.launches == [1, 4]  # the batch was not re-run
    code, out = _outcome(stub.Softmax.future(_request(_x(9)), timeout=30))
    assert code == OK and server.service.batcher.queue_depth == 0
    np.testing.assert_array_equal(out, _expected(_x(9)))


def test_client_leaving_while_queued_never_launches(gated):
    server, gate, stub = gated
    xs = [_x(i) for i in range(3)]
    with _held_launch(server, gate, stub):
        futures = _queue(server, stub, xs)
        futures[0].cancel()
        _wait_until(lambda: server.service.batcher.queue_depth == 2)
    assert _outcome(futures[0])[0] == grpc.StatusCode.CANCELLED
    for f, x in zip(futures[1:], xs[1:]):
        code, out = _outcome(f)
        assert code == OK
        np.testing.assert_array_equal(out, _expected(x))
    assert gate.launches == [1, 2]  # the held call, then the two that stayed


# --------------------------------------------------------------------------------- full queue


def test_full_queue_answers_resource_exhausted_at_once_while_the_device_is_stuck(gated):
    server, gate, stub = gated  # max_queue 8
    with _held_launch(server, gate, stub):
        futures = _queue(server, stub, [_x(i) for i in range(8)])
        times = []
        for i in range(5):  # the launch is held: only a refusal can answer now
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                stub.Softmax(_request(_x(i)), timeout=30)
            times.append(time.perf_counter() - t0)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queue 8" in info.value.details()
        assert max(times) < 1.0, times
        print(f"\nfull queue: 5 refusals while the device is stuck, slowest {max(times) * 1e3:.1f} ms")
    for f, i in zip(futures, range(8)):
        code, out = _outcome(f)
        assert code == OK
        np.testing.assert_array_equal(out, _expected(_x(i)))


# ---------------------------------------------------------------------- SIGTERM and restarting


def test_sigterm_with_calls_in_flight_then_restart_on_the_same_port():
    # Every launch takes 0.3 s and holds one call: 12 calls need 3.6 s, the grace period is 1 s.
    args = ("--max-batch-rows", "1", "--max-delay-us", "0", "--grace-period-s", "1", "--warmup-dtypes", "none",
            "--log-level", "debug")  # debug: a line per answered call
    server = ServerProcess(*args, launch_delay_ms=300)
    outcomes: dict[int, tuple] = {}
    try:
        def call(i: int) -> None:
            with Client(server.target, retries=0, timeout=60) as c:
                try:
                    outcomes[i] = (OK, c.softmax(_x(i).numpy()))
                except LogitServeError as exc:
                    outcomes[i] = (exc.code, exc.details)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        server.wait_for("rpc", timeout=30)  # the first call has been answered: the rest are in flight
        server.proc.send_signal(15)
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
        server.wait_for("stopped", timeout=10)
    finally:
        server.close()
    assert sorted(outcomes) == list(range(12)), "a call never ended"
    answered = [i for i, (code, _) in outcomes.items() if code == OK]
    refused = [i for i, (code, _) in outcomes.items() if code == UNAVAILABLE]
    assert len(answered) + len(refused) == 12, outcomes  # each: its answer or UNAVAILABLE, none lost
    assert answered and refused  # the grace period let some finish, not all
    print(f"\nSIGTERM with 12 calls in flight: {len(answered)} answered (checked), {len(refused)} UNAVAILABLE, "
          f"0 lost, exit 0")
    for i in answered:
        np.testing.assert_array_equal(outcomes[i][1], _expected(_x(i)))

    # The same port is free again at once: a new server binds it and serves.
    with ServerProcess("--warmup-dtypes", "none", port=server.port) as again:
        assert again.port == server.port
        with Client(again.target, timeout=30) as c:
            np.testing.assert_array_equal(c.softmax(_x(3).numpy()), _expected(_x(3)))


# ------------------------------------------------------------------------------ load, briefly


def test_short_load_run_has_no_unexpected_errors_no_wrong_answers():
    import load_run

    report = load_run.run(load_run.LoadConfig(clients=4, seconds=6.0, queue_probe=True))
    assert report["calls"] > 50, report
    assert report["unexpected"] == 0 and report["wrong"] == 0, report["failures"][:5]
    assert report["expected_errors"] > 0  # the invalid requests of the mix were sent and refused
    assert set(report["by_rpc"]) >= {"Sample", "RouteExperts", "Softmax", "CausalSoftmax", "Silu", "Step",
                                     "StreamSteps", "GetServerInfo", "Health"}
    probe = report["queue_probe"]
    assert probe["exhausted"] > 0 and probe["max_exhausted_ms"] < 1000, probe
    assert probe["unexpected"] == 0, probe
