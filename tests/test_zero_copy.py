"""Zero-copy tensors on the request path, CPU: a `logitserve serve` process (the server) and this
test process (the client) sharing POSIX shared memory. Every RPC with its inputs and outputs in
regions answers what the byte path answers; the server reads the client's bytes in place; many
clients at once. Bad input and lease lifetimes: test_zero_copy_errors.py."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from logitserve.client import Client
from logitserve.client import regions as client_regions
from logitserve.client.keys import scoped_key
from logitserve.server.cli import parse
from logitserve.server.process import ServerProcess
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

TOKENS = ("alice", "bob", "carol", "dave", "eve")
NP = {pb.DTYPE_FLOAT16: np.float16, pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_FLOAT64: np.float64,
      pb.DTYPE_INT32: np.int32, pb.DTYPE_INT64: np.int64, pb.DTYPE_BOOL: np.bool_}
WIRE = {np.dtype(v): k for k, v in NP.items()}


def start_server(tmp_path, *args, **kwargs) -> ServerProcess:
    tokens = tmp_path / "tokens"
    tokens.write_text("\n".join(TOKENS) + "\n")
    return ServerProcess("--auth-token-file", str(tokens), "--warmup-dtypes", "none", "--max-regions", "32",
                         "--max-region-bytes", str(8 << 20), *args, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A batching delay so that concurrent calls meet in one launch (the gathered path).
    with start_server(tmp_path_factory.mktemp("zc"), "--max-delay-us", "20000") as s:
        yield s


class Caller:
    """Raw LogitServe stubs of one bearer token, and its client for the SharedMemory service."""

    def __init__(self, target: str, token: str):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.LogitServeStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.token = token
        # region_scope=None: the raw stubs name the regions by the names the client registered.
        self.client = Client(target, token=token, timeout=300, region_scope=None)

    def __getattr__(self, rpc: str):
        method = getattr(self.stub, rpc)
        return lambda request, **kw: method(request, metadata=self.metadata, timeout=kw.pop("timeout", 300), **kw)

    def in_use(self) -> dict[str, int]:
        return {s.name: s.in_use for s in self.client.shared_memory_status()}

    def close(self) -> None:
        self.client.close()
        self.channel.close()


@pytest.fixture
def alice(server):
    c = Caller(server.target, "alice")
    yield c
    c.client.unregister()
    c.close()


class Arena:
    """A shared-memory object this process made, registered as one region; tensors and output
    slices are carved out of it at 64-byte boundaries (plus ``skew`` bytes: misaligned on purpose)."""

    def __init__(self, caller: Caller, name: str, nbytes: int = 1 << 20):
        # The server scopes keys to tokens (its default with --auth-token-file).
        self.buf = client_regions.shared_array((nbytes,), "uint8", key=scoped_key(caller.token))
        self.bytes = self.buf.array
        self.name = name
        self.used = 0
        caller.client.register_system(name, self.buf)

    def alloc(self, nbytes: int) -> int:
        offset = self.used
        self.used = -(-(offset + nbytes) // 64) * 64
        assert self.used <= len(self.bytes)
        return offset

    def put(self, array: np.ndarray) -> pb.Tensor:
        """``array`` written into the arena: a Tensor naming it."""
        array = np.ascontiguousarray(array)
        offset = self.alloc(array.nbytes)
        self.bytes[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        return pb.Tensor(dtype=WIRE[array.dtype], shape=list(array.shape),
                         region=pb.RegionRef(region=self.name, offset=offset, byte_size=array.nbytes))

    def rewrite(self, tensor: pb.Tensor, array: np.ndarray) -> None:
        at = tensor.region.offset
        self.bytes[at:at + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def out(self, dtype, shape) -> pb.RegionRef:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return pb.RegionRef(region=self.name, offset=self.alloc(nbytes), byte_size=nbytes)

    def read(self, ref: pb.RegionRef, dtype, shape) -> np.ndarray:
        return self.bytes[ref.offset:ref.offset + ref.byte_size].view(dtype).reshape(shape).copy()

    def close(self) -> None:
        self.bytes = None
        self.buf.close()
        self.buf.unlink()


@pytest.fixture
def arenas(alice):
    made = [Arena(alice, "in"), Arena(alice, "out")]
    yield made
    alice.client.unregister()
    for a in made:
        a.close()


def data(array: np.ndarray) -> pb.Tensor:
    array = np.ascontiguousarray(array)
    return pb.Tensor(dtype=WIRE[array.dtype], shape=list(array.shape), data=array.tobytes())


def value(t: pb.Tensor) -> np.ndarray:
    assert not t.HasField("region") and t.data
    return np.frombuffer(t.data, NP[t.dtype]).reshape(tuple(t.shape))


def in_region(answer: pb.Tensor, ref: pb.RegionRef, arena: Arena) -> np.ndarray:
    """An output the server wrote into ``ref``: the answer names it, with no data."""
    assert answer.region == ref and not answer.data
    return arena.read(ref, NP[answer.dtype], tuple(answer.shape))


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- every RPC


def test_sample_in_regions_equals_the_byte_path(alice, arenas):
    inn, out = arenas
    logits = rng(1).standard_normal((4, 300)).astype(np.float32) * 3
    temps, top_k, seeds = np.array([0.8, 1.0, 0.0, 1.2]), np.array([5, 0, 0, 40]), np.array([7, 8, 9, 2**40])
    by_bytes = alice.Sample(pb.SampleRequest(logits=data(logits), temperature_rows=data(temps),
                                             top_k_rows=data(top_k), seed_rows=data(seeds), top_p=0.9, step=3))
    refs = {"token_ids": out.out(np.int64, (4,)), "seeds": out.out(np.int64, (4,)), "valid": out.out(np.bool_, (4,))}
    request = pb.SampleRequest(logits=inn.put(logits), temperature_rows=inn.put(temps), top_k_rows=inn.put(top_k),
                               seed_rows=inn.put(seeds), top_p=0.9, step=3, output_regions=refs)
    by_regions = alice.Sample(request)
    np.testing.assert_array_equal(in_region(by_regions.token_ids, refs["token_ids"], out), value(by_bytes.token_ids))
    np.testing.assert_array_equal(in_region(by_regions.seeds, refs["seeds"], out), seeds)
    assert in_region(by_regions.valid, refs["valid"], out).all()
    assert value(by_bytes.token_ids)[2] == logits[2].argmax()
    # Only some outputs in regions: the others come back as bytes.
    partly = alice.Sample(pb.SampleRequest(logits=inn.put(logits), seed=5, output_regions={"valid": refs["valid"]}))
    assert value(partly.token_ids).shape == (4,) and value(partly.seeds).tolist() == [5] * 4
    assert in_region(partly.valid, refs["valid"], out).all()
    # Logits as bytes, outputs into regions (written from the host after the launch).
    mixed = alice.Sample(pb.SampleRequest(logits=data(logits), temperature_rows=data(temps), top_k_rows=data(top_k),
                                          seed_rows=data(seeds), top_p=0.9, step=3, output_regions=refs))
    np.testing.assert_array_equal(in_region(mixed.token_ids, refs["token_ids"], out), value(by_bytes.token_ids))
    np.testing.assert_array_equal(in_region(mixed.seeds, refs["seeds"], out), seeds)
    assert alice.in_use() == {"in": 0, "out": 0}


def test_route_experts_in_regions_equals_the_byte_path(alice, arenas):
    inn, out = arenas
    gate = rng(2).standard_normal((6, 16)).astype(np.float16)
    by_bytes = alice.RouteExperts(pb.RouteExpertsRequest(gate_logits=data(gate), k=3, renormalize=True))
    refs = {"weights": out.out(np.float32, (6, 3)), "indices": out.out(np.int32, (6, 3))}
    answer = alice.RouteExperts(pb.RouteExpertsRequest(gate_logits=inn.put(gate), k=3, renormalize=True,
                                                       output_regions=refs))
    np.testing.assert_array_equal(in_region(answer.weights, refs["weights"], out), value(by_bytes.weights))
    np.testing.assert_array_equal(in_region(answer.indices, refs["indices"], out), value(by_bytes.indices))
    out.bytes[refs["weights"].offset:refs["weights"].offset + 72] = 0
    mixed = alice.RouteExperts(pb.RouteExpertsRequest(gate_logits=data(gate), k=3, renormalize=True,
                                                      output_regions={"weights": refs["weights"]}))
    np.testing.assert_array_equal(in_region(mixed.weights, refs["weights"], out), value(by_bytes.weights))
    np.testing.assert_array_equal(value(mixed.indices), value(by_bytes.indices))


@pytest.mark.parametrize("rpc", ["Softmax", "Softmax dim 0", "CausalSoftmax", "Silu", "SwiGLU", "SwiGLU broadcast"])
def test_tensor_ops_in_regions_equal_the_byte_path(alice, arenas, rpc):
    inn, out = arenas
    x = rng(3).standard_normal((3, 5, 24)).astype(np.float64 if "dim 0" in rpc else np.float32)
    up = rng(4).standard_normal((1, 5, 24) if "broadcast" in rpc else x.shape).astype(x.dtype)

    def request(tensor, up_tensor=None, **kw):
        if rpc.startswith("Softmax"):
            return "Softmax", pb.SoftmaxRequest(x=tensor, dim=0 if "dim 0" in rpc else -1, **kw)
        if rpc == "CausalSoftmax":
            return "CausalSoftmax", pb.CausalSoftmaxRequest(x=tensor, **kw)
        return "Silu", pb.SiluRequest(x=tensor, up=up_tensor, **kw)

    name, by_bytes = request(data(x), data(up) if rpc.startswith("SwiGLU") else None)
    expect = value(getattr(alice, name)(by_bytes).out)
    ref = out.out(x.dtype, x.shape)
    name, by_regions = request(inn.put(x), inn.put(up) if rpc.startswith("SwiGLU") else None,
                               output_regions={"out": ref})
    np.testing.assert_array_equal(in_region(getattr(alice, name)(by_regions).out, ref, out), expect)
    # Inputs in a region, the output as bytes.
    name, half = request(inn.put(x), inn.put(up) if rpc.startswith("SwiGLU") else None)
    np.testing.assert_array_equal(value(getattr(alice, name)(half).out), expect)


def test_step_and_stream_steps_in_regions(alice, arenas):
    inn, out = arenas
    logits = rng(5).standard_normal((2, 64)).astype(np.float32)
    x = rng(6).standard_normal((2, 8)).astype(np.float32)

    def step(i: int, regions: bool) -> pb.StepRequest:
        if not regions:
            return pb.StepRequest(id=f"s{i}", sample=pb.SampleRequest(logits=data(logits), seed=i),
                                  softmax=pb.SoftmaxRequest(x=data(x)), silu=pb.SiluRequest(x=data(x)))
        refs = {"token_ids": out.out(np.int64, (2,))}
        return pb.StepRequest(id=f"s{i}", sample=pb.SampleRequest(logits=inn.put(logits), seed=i, output_regions=refs),
                              softmax=pb.SoftmaxRequest(x=inn.put(x), output_regions={"out": out.out(np.float32, (2, 8))}),
                              silu=pb.SiluRequest(x=inn.put(x)))

    expect = alice.Step(step(1, False))
    got_request = step(1, True)
    got = alice.Step(got_request)
    assert got.id == "s1"
    np.testing.assert_array_equal(in_region(got.sample.token_ids, got_request.sample.output_regions["token_ids"], out),
                                  value(expect.sample.token_ids))
    np.testing.assert_array_equal(in_region(got.softmax.out, got_request.softmax.output_regions["out"], out),
                                  value(expect.softmax.out))
    np.testing.assert_array_equal(value(got.silu.out), value(expect.silu.out))

    requests = [step(i, True) for i in range(3)]
    answers = list(alice.StreamSteps(iter(requests)))
    for i, (request, answer) in enumerate(zip(requests, answers)):
        expect = alice.Step(step(i, False))
        np.testing.assert_array_equal(
            in_region(answer.sample.token_ids, request.sample.output_regions["token_ids"], out),
            value(expect.sample.token_ids))
    assert alice.in_use() == {"in": 0, "out": 0}


# ----------------------------------------------------------------------------- in place


def test_the_server_reads_the_region_in_place(alice, arenas):
    """The client rewrites its region between calls: the next call sees the new values, with no
    new registration."""
    inn, out = arenas
    x = np.zeros((2, 50), np.float32)
    x[:, 7] = 10
    tensor = inn.put(x)
    ref = out.out(np.int64, (2,))
    request = pb.SampleRequest(logits=tensor, temperature=0.0, output_regions={"token_ids": ref})
    first = alice.Sample(request)
    assert in_region(first.token_ids, ref, out).tolist() == [7, 7]
    x[0, 7], x[0, 31], x[1, 7], x[1, 3] = 0, 10, 0, 10
    inn.rewrite(tensor, x)
    alice.Sample(request)
    assert out.read(ref, np.int64, (2,)).tolist() == [31, 3]
    softmax = pb.SoftmaxRequest(x=tensor)
    np.testing.assert_allclose(value(alice.Softmax(softmax).out).argmax(1), [31, 3])


# ----------------------------------------------------------------------------- concurrency


def test_concurrent_clients_each_with_their_own_regions(server):
    """Four clients (four tokens), each its region named "logits", calling at once: every answer is
    its own client's (their calls batched and gathered), and no lease is left."""
    with Client(server.target, token="eve") as eve:
        before = eve.server_info().stats
    errors, rounds = [], 12

    def client(token: str, column: int) -> None:
        caller = Caller(server.target, token)
        arena = Arena(caller, "logits", 4096)
        try:
            x = np.zeros((3, 40), np.float32)
            tensor = arena.put(x)
            ref = arena.out(np.int64, (3,))
            for i in range(rounds):
                x[:] = 0
                x[:, (column + i) % 40] = 5
                arena.rewrite(tensor, x)
                answer = caller.Sample(pb.SampleRequest(logits=tensor, temperature=0.0,
                                                        output_regions={"token_ids": ref}))
                got = in_region(answer.token_ids, ref, arena).tolist()
                if got != [(column + i) % 40] * 3:
                    errors.append((token, i, got))
            assert caller.in_use() == {"logits": 0}
            assert caller.client.unregister() == ["logits"]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((token, repr(exc)))
        finally:
            arena.close()
            caller.close()

    threads = [threading.Thread(target=client, args=(token, 9 * i)) for i, token in enumerate(TOKENS[:4])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    with Client(server.target, token="eve") as eve:
        after = eve.server_info().stats
    # Batches formed: fewer launches than calls.
    assert after["launches"] - before["launches"] < after["batched_requests"] - before["batched_requests"]


# ----------------------------------------------------------------------------- wiring


def test_flags_and_environment():
    _, config = parse(["serve", "--max-regions", "3", "--max-region-bytes", "4096"], environ={})
    assert (config.max_regions, config.max_region_bytes) == (3, 4096)
    _, config = parse(["serve"], environ={"LOGITSERVE_MAX_REGIONS": "7", "LOGITSERVE_MAX_REGION_BYTES": "99"})
    assert (config.max_regions, config.max_region_bytes) == (7, 99)
    _, config = parse(["serve"], environ={})
    assert (config.max_regions, config.max_region_bytes) == (256, 16 << 30)


def test_reflection_lists_the_shared_memory_service(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        [answer] = list(stub.ServerReflectionInfo(iter([request]), metadata=(("authorization", "Bearer alice"),)))
    names = {s.name for s in answer.list_services_response.service}
    assert {"logitserve.v1.LogitServe", "logitserve.v1.SharedMemory"} <= names


def test_regions_are_unmapped_at_shutdown(tmp_path):
    with start_server(tmp_path) as server:
        caller = Caller(server.target, "bob")
        arena = Arena(caller, "r", 4096)
        caller.Softmax(pb.SoftmaxRequest(x=arena.put(np.ones((2, 4), np.float32))))
        caller.close()
        assert server.terminate() == 0
        stopped = next(e for e in server.events if e.get("event") == "stopped")
        assert stopped["regions_mapped"] == 0
        arena.close()
