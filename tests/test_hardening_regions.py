"""Issue 32, items 3 and 6: shared memory its client shrinks under the server, and a Step whose
parts share memory. Each test fails on the code before the fix (4d75e10): the server died of
SIGBUS (exit -7) where a client truncated its object between a call's check and its launch, and a
Step answered OK with one part's output overwriting another part's input.

The objects are made here with ``os.open`` in /dev/shm and read and written through their
descriptors: this process never maps them, so shrinking them cannot fault it either."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import Client
from logitserve.server.process import ServerProcess
from logitserve.server.regions import RegionRegistry
from logitserve.server.engine.staging import Staging
from logitserve.server.tensors import HostTensor
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

PAGE = 4096
INVALID = grpc.StatusCode.INVALID_ARGUMENT
X = np.linspace(-3, 3, 4 * 64, dtype=np.float32).reshape(4, 64)


class ShmObject:
    """A POSIX shared-memory object of ``size`` bytes, written, read and shrunk through its descriptor."""

    def __init__(self, size: int = PAGE):
        self.key = f"ls_issue32_{uuid.uuid4().hex[:12]}"
        self.path = f"/dev/shm/{self.key}"
        self.size = size
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self.fd, size)

    def write(self, at: int, array: np.ndarray) -> None:
        os.pwrite(self.fd, np.ascontiguousarray(array).tobytes(), at)

    def read(self, at: int, dtype, shape) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer(os.pread(self.fd, nbytes, at), dtype).reshape(shape)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def ref(region: str, offset: int, nbytes: int) -> pb.RegionRef:
    return pb.RegionRef(region=region, offset=offset, byte_size=nbytes)


def f32(array: np.ndarray, region: str | None = None, offset: int = 0) -> pb.Tensor:
    """A float32 Tensor: its bytes, or a reference to them at ``offset`` of ``region``."""
    if region is None:
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(array.shape), data=array.tobytes())
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(array.shape), region=ref(region, offset, array.nbytes))


def softmax(x: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.from_numpy(x).double(), -1).numpy()


def silu(x: np.ndarray) -> np.ndarray:
    return torch.nn.functional.silu(torch.from_numpy(x).double()).numpy()


class Caller:
    """Raw stubs and a client (for the SharedMemory service) of one server."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.channel = grpc.insecure_channel(server.target)
        self.stub = pb_grpc.LogitServeStub(self.channel)
        self.client = Client(server.target, timeout=60)

    def code(self, rpc: str, request) -> tuple[grpc.StatusCode, str, object]:
        try:
            return grpc.StatusCode.OK, "", getattr(self.stub, rpc)(request, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), None

    def in_use(self, name: str) -> int:
        return self.client.shared_memory_status(name)[0].in_use

    def close(self) -> None:
        self.client.unregister()
        self.client.close()
        self.channel.close()


def _callers(server):
    caller = Caller(server)
    made = []

    def region(name: str, size: int = PAGE, obj: ShmObject | None = None, offset: int = 0) -> ShmObject:
        if obj is None:
            obj = ShmObject(size)
            made.append(obj)
        caller.client.register_system(name, obj.key, size, offset, global_name=True)  # raw refs name it
        return obj

    caller.region = region
    return caller, made


# LOGITSERVE_TEST_SERVER_DEVICE=cuda:0 runs these servers on a GPU (page-locked regions, which
# only the device's copies touch): the lent GPU machine's check that a shrink cannot fault there.
_DEVICE = os.environ.get("LOGITSERVE_TEST_SERVER_DEVICE", "cpu")
_ON = {"device": _DEVICE, "backend": "torch" if _DEVICE == "cpu" else "triton"}


@pytest.fixture(scope="module")
def slow_server():
    # Every launch waits 400 ms first (on the launch thread): a call is checked and queued, and
    # its client truncates the object before the launch reads or writes it.
    with ServerProcess("--warmup-dtypes", "none", "--busy-poll-us", "0", launch_delay_ms=400, **_ON) as server:
        yield server


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--warmup-dtypes", "none", "--busy-poll-us", "0", **_ON) as server:
        yield server


@pytest.fixture
def slow(slow_server):
    caller, made = _callers(slow_server)
    yield caller
    caller.close()
    for obj in made:
        obj.close()


@pytest.fixture
def caller(server):
    caller, made = _callers(server)
    yield caller
    caller.close()
    for obj in made:
        obj.close()


# ----------------------------------------------------------------- the registry, no server


def test_a_lease_reads_and_writes_nothing_past_a_shrunk_object():
    obj = ShmObject(2 * PAGE)
    registry = RegionRegistry()
    try:
        registry.register_system("r", obj.key, PAGE, PAGE)
        obj.write(PAGE, X[:1])
        with registry.resolve(ref("r", 0, 256), torch.float32, (1, 64), field="logits") as lease:
            assert np.array_equal(lease.copy_out().numpy(), X[:1])
            obj.truncate(PAGE + 100)  # after the check, before the read: what a launch meets
            shrank = (r"logits.region: the shared-memory object '.*' of region 'r' shrank to 4196 bytes, under the "
                      r"8192 the region needs")
            with pytest.raises(ValueError, match=shrank):
                lease.copy_out()
            with pytest.raises(ValueError, match=shrank):  # the staging path (a CUDA server's pageable region)
                _staged(HostTensor(lease.view, torch.float32, (1, 64), True))
            with pytest.raises(ValueError, match=shrank):  # a per-row parameter, read at validation
                HostTensor(lease.view, torch.float32, (1, 64), True).tolist()
            with pytest.raises(ValueError, match=shrank):
                lease.write_from(torch.zeros(1, 64))
            assert os.fstat(obj.fd).st_size == PAGE + 100  # the write did not grow it back
        with pytest.raises(ValueError, match=r"x.region: the shared-memory object .* shrank to 4196 bytes"):
            registry.resolve(ref("r", 0, 256), torch.float32, (1, 64), field="x")
    finally:
        registry.close()
        obj.close()


def _staged(t: HostTensor) -> None:
    stage = Staging()
    stage.add([t])
    stage.to(torch.device("cpu"))


def test_a_cpu_registry_keeps_no_mapping_of_the_object():
    """Nothing to fault on: the server's process maps no system region (it reads and writes
    through the descriptor); only a CUDA server maps one, page-locked, for the device."""
    obj = ShmObject()
    registry = RegionRegistry()
    try:
        registry.register_system("r", obj.key, 0, PAGE)
        with registry.resolve(ref("r", 0, 256), torch.float32, (64,)):
            with open("/proc/self/maps") as maps:
                assert obj.path not in maps.read()
    finally:
        registry.close()
        obj.close()


# ------------------------------------------------- item 3: an object shrunk under the server


def _requests(where: str):
    """``(rpc, request, check)`` of one call with its input (``where="input"``) or output in
    region 'r' (the object's first page), and ``check(answer, obj)`` of a good answer."""
    out = ref("r", 2048, X.nbytes)
    if where == "softmax input":
        def check(answer, obj):
            assert np.allclose(np.frombuffer(answer.out.data, np.float32).reshape(X.shape), softmax(X), atol=1e-6)
        return "Softmax", pb.SoftmaxRequest(x=f32(X, "r")), check
    if where == "softmax output":
        def check(answer, obj):
            assert np.allclose(obj.read(2048, np.float32, X.shape), softmax(X), atol=1e-6)
        return "Softmax", pb.SoftmaxRequest(x=f32(X), output_regions={"out": out}), check
    if where == "sample input":
        def check(answer, obj):
            assert list(np.frombuffer(answer.token_ids.data, np.int64)) == list(X.argmax(1))
        return "Sample", pb.SampleRequest(logits=f32(X, "r"), temperature=0.0), check
    token_ids = ref("r", 2048, 4 * 8)

    def check(answer, obj):
        assert list(obj.read(2048, np.int64, (4,))) == list(X.argmax(1))
    return "Sample", pb.SampleRequest(logits=f32(X), temperature=0.0, output_regions={"token_ids": token_ids}), check


WHERE = ("softmax input", "softmax output", "sample input", "sample output")
FIELDS = {"softmax input": "x", "softmax output": "output_regions[out]", "sample input": "logits",
          "sample output": "output_regions[token_ids]"}


def _restored_and_answered(caller, obj, rpc, request, check) -> None:
    """The object back at its size and contents, the call answers right again: on a CPU server at
    once (it reads the object as it is now, through its descriptor); on a GPU server, whose
    page-locked region was cut off the object (the device keeps the pages the object lost), only
    once the region is registered again, and until then it is refused so."""
    obj.truncate(PAGE)
    obj.write(0, X)
    if _DEVICE != "cpu":
        code, details, _ = caller.code(rpc, request)
        assert code == INVALID and details.endswith("unregister it and register it again"), (code, details)
        caller.client.unregister("r")
        caller.region("r", obj=obj)
    check(caller.code(rpc, request)[2], obj)


@pytest.mark.parametrize("where", WHERE)
def test_an_object_shrunk_before_the_call_is_refused(caller, where):
    obj = caller.region("r")
    obj.write(0, X)
    rpc, request, check = _requests(where)
    obj.truncate(1024)
    code, details, _ = caller.code(rpc, request)
    assert code == INVALID and details.startswith(
        f"{FIELDS[where]}.region: the shared-memory object '{obj.key}' of region 'r' shrank to 1024 bytes, under "
        f"the 4096 the region needs"), details
    _restored_and_answered(caller, obj, rpc, request, check)


@pytest.mark.parametrize("where", WHERE)
def test_an_object_shrunk_between_the_check_and_the_launch_fails_the_call_not_the_server(slow, where):
    """The call is checked (it holds its lease) and waits for its launch; its client truncates
    the object to nothing. Before: SIGBUS, the server gone (exit -7). Now: that call answers
    INVALID_ARGUMENT naming the field, the region and the rule; the next answers as ever."""
    obj = slow.region("r")
    obj.write(0, X)
    rpc, request, check = _requests(where)
    answered = []
    thread = threading.Thread(target=lambda: answered.append(slow.code(rpc, request)))
    thread.start()
    deadline = time.monotonic() + 30
    while slow.in_use("r") == 0:  # checked, queued: the launch sleeps its 400 ms
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    obj.truncate(0)
    thread.join(60)
    assert slow.server.proc.poll() is None, f"the server died ({slow.server.proc.poll()})"
    [(code, details, _)] = answered
    # A page-locked region (GPU server) is read and written by the device alone, on the pages it
    # had: that launch cannot fault and goes on, unseen by the object; the next call is refused.
    if not (_DEVICE != "cpu" and code == grpc.StatusCode.OK):
        assert code == INVALID and details.startswith(
            f"{FIELDS[where]}.region: the shared-memory object '{obj.key}' of region 'r' shrank to 0 bytes, under "
            f"the 4096 the region needs"), (code, details)
    _restored_and_answered(slow, obj, rpc, request, check)
    assert slow.in_use("r") == 0


TRUNCATE_LOOP = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
size, end = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    os.ftruncate(fd, 0)
    time.sleep(0.0002)
    os.ftruncate(fd, size)
    time.sleep(0.0002)
os.ftruncate(fd, size)
"""


def test_calls_race_a_client_that_keeps_truncating(caller):
    """Another process truncates the object to nothing and back, again and again, while calls
    with their inputs and outputs in it run: each answers OK or the shrink's INVALID_ARGUMENT,
    the server stays up, and a call after the storm answers correctly."""
    obj = caller.region("r")
    softmax_call = pb.SoftmaxRequest(x=f32(X, "r"), output_regions={"out": ref("r", 2048, X.nbytes)})
    sample_call = pb.SampleRequest(logits=f32(X, "r"), temperature=0.0,
                                   output_regions={"token_ids": ref("r", 3072, 32)})
    storm = subprocess.Popen([sys.executable, "-c", TRUNCATE_LOOP, obj.path, str(PAGE), "2.5"])
    answers: list[tuple] = []

    def loop(rpc, request):
        while storm.poll() is None:
            answers.append(caller.code(rpc, request)[:2])

    threads = [threading.Thread(target=loop, args=call) for call in
               (("Softmax", softmax_call), ("Sample", sample_call), ("Softmax", softmax_call))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert storm.wait(60) == 0
    assert caller.server.proc.poll() is None, \
        f"the server died ({caller.server.proc.poll()}): {''.join(caller.server.lines[-40:])}"
    codes = {code for code, _ in answers}
    refused = [details for code, details in answers if code == INVALID]
    print(f"{len(answers)} calls: {len(answers) - len(refused)} OK, {len(refused)} refused as shrunk")
    assert codes <= {grpc.StatusCode.OK, INVALID} and len(answers) > 10, codes
    assert all(("shrank to" in d or "register it again" in d) and "of region 'r'" in d for d in refused), refused[:3]

    def check(answer, obj):
        assert answer.out.region == softmax_call.output_regions["out"]
        assert np.allclose(obj.read(2048, np.float32, X.shape), softmax(X), atol=1e-6)
    _restored_and_answered(caller, obj, "Softmax", softmax_call, check)
