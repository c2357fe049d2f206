"""The in-place launch paths of server/ops/resident.py on the CPU, in process: a registry whose
"CUDA" leases view CPU tensors stands in for the client's device memory, so the code paths of
CUDA regions (DeviceTensor inputs gathered into one launch, batches mixing them with
bytes, per-row parameters read from device memory, outputs put or written by ``out=``) run here
exactly as on a GPU, against the kernels called directly. The real thing: test_zero_copy_cuda.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.server import ops
from logitserve.server.engine.device import DeviceHandle
from logitserve.server.regions import CUDA, CallRegions
from logitserve.server.tensors import DeviceTensor, from_torch
from logitserve.v1 import logitserve_pb2 as pb

LIMITS = ops.Limits(max_rows=4096, max_vocab=262144)


class FakeLease:
    kind = CUDA
    pinned = False

    def __init__(self, view):
        self.view = view
        self.released = False

    def tensor(self):
        return self.view

    def release(self):
        self.released = True


class DeviceMemory:
    """One region "dev" whose bytes are a CPU tensor, leased as if it were CUDA memory."""

    def __init__(self, nbytes: int = 1 << 20):
        self.bytes = torch.zeros(nbytes, dtype=torch.uint8)
        self.used = 0
        self.leases: list[FakeLease] = []

    def resolve(self, ref, dtype, shape, owner, field, *, writable=False, sizes=None):
        assert ref.region == "dev", field
        view = self.bytes[ref.offset:ref.offset + ref.byte_size].view(dtype).view(tuple(shape))
        lease = FakeLease(view)
        self.leases.append(lease)
        return lease

    def put(self, t: torch.Tensor) -> pb.Tensor:
        at = self.alloc(t.nbytes)
        self.bytes[at:at + t.nbytes].view(t.dtype).copy_(t.reshape(-1))
        return pb.Tensor(dtype=from_torch(t[:0]).dtype, shape=list(t.shape),
                         region=pb.RegionRef(region="dev", offset=at, byte_size=t.nbytes))

    def out(self, dtype, shape) -> pb.RegionRef:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return pb.RegionRef(region="dev", offset=self.alloc(nbytes), byte_size=nbytes)

    def alloc(self, nbytes: int) -> int:
        at = self.used
        self.used = -(-(at + nbytes) // 64) * 64
        return at

    def read(self, ref: pb.RegionRef, dtype, shape) -> torch.Tensor:
        return self.bytes[ref.offset:ref.offset + ref.byte_size].view(dtype).view(tuple(shape)).clone()


@pytest.fixture
def handle():
    h = DeviceHandle("cpu", "torch")
    yield h
    h.close()


def run(handle, calls):
    async def main():
        for call in calls:  # as the batcher does before it queues a call
            checked = getattr(call, "checked", None)
            if checked is not None:
                await checked()
        return await handle.run_batch(calls)
    return asyncio.run(main())


def test_sample_batches_mixing_device_memory_and_bytes(handle):
    mem = DeviceMemory()
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(n, 97, generator=g) * 3 for n in (3, 1, 2)]
    seeds = [torch.arange(n, dtype=torch.int64) + 10 * i for i, n in enumerate((3, 1, 2))]
    refs, calls, held = [], [], []
    for i, (x, s) in enumerate(zip(logits, seeds)):
        regions = CallRegions(mem)
        held.append(regions)
        if i == 1:  # bytes, outputs as bytes
            msg = pb.SampleRequest(logits=from_torch(x), seed_rows=from_torch(s), top_k=7)
            refs.append(None)
        else:
            out = {"token_ids": mem.out(torch.int64, (len(s),)), "valid": mem.out(torch.bool, (len(s),)),
                   "seeds": mem.out(torch.int64, (len(s),))}
            refs.append(out)
            msg = pb.SampleRequest(logits=mem.put(x), seed_rows=mem.put(s), top_k=7, output_regions=out)
        calls.append(ops.SampleCall.from_pb(msg, LIMITS, regions=regions))
    results = run(handle, calls)
    assert type(calls[0].logits) is DeviceTensor and calls[0].seeds() == seeds[0].tolist()
    for x, s, ref, result in zip(logits, seeds, refs, results):
        expect = kernels.sample(x, seed=s, top_k=7, backend="torch")
        answer = result.to_pb()
        if ref is None:
            assert np.frombuffer(answer.token_ids.data, np.int64).tolist() == expect.tolist()
            continue
        assert answer.token_ids.region == ref["token_ids"] and not answer.token_ids.data
        assert torch.equal(mem.read(ref["token_ids"], torch.int64, (len(s),)), expect)
        assert torch.equal(mem.read(ref["seeds"], torch.int64, (len(s),)), s)
        assert mem.read(ref["valid"], torch.bool, (len(s),)).all()
    for regions in held:
        regions.finish()
    assert mem.leases and all(lease.released for lease in mem.leases)


def test_route_experts_in_device_memory(handle):
    mem = DeviceMemory()
    gates = [torch.randn(n, 16) for n in (2, 5)]
    calls, refs = [], []
    for g in gates:
        out = {"indices": mem.out(torch.int32, (len(g), 3))}
        refs.append(out)
        calls.append(ops.RouteExpertsCall.from_pb(pb.RouteExpertsRequest(gate_logits=mem.put(g), k=3,
                                                                         output_regions=out), LIMITS,
                                                  regions=CallRegions(mem)))
    for g, out, result in zip(gates, refs, run(handle, calls)):
        weights, indices = kernels.topk_softmax(g, 3, backend="torch")
        answer = result.to_pb()
        assert torch.equal(mem.read(out["indices"], torch.int32, (len(g), 3)), indices)
        assert np.array_equal(np.frombuffer(answer.weights.data, np.float32).reshape(len(g), 3), weights.numpy())


@pytest.mark.parametrize("op", ["softmax", "causal_softmax", "silu", "swiglu"])
def test_tensor_ops_write_out_into_device_memory(handle, op):
    mem = DeviceMemory()
    xs = [torch.randn(2, 3, 8), torch.randn(1, 3, 8)]
    ups = [torch.randn(x.shape) for x in xs]
    calls, refs = [], []
    for x, up in zip(xs, ups):
        ref = mem.out(torch.float32, x.shape)
        refs.append(ref)
        fields = dict(x=mem.put(x), output_regions={"out": ref})
        if op == "swiglu":
            msg = pb.SiluRequest(up=mem.put(up), **fields)
        else:
            msg = getattr(pb, {"softmax": "SoftmaxRequest", "causal_softmax": "CausalSoftmaxRequest",
                               "silu": "SiluRequest"}[op])(**fields)
        call_type = {"softmax": ops.SoftmaxCall, "causal_softmax": ops.CausalSoftmaxCall}.get(op, ops.SiluCall)
        calls.append(call_type.from_pb(msg, LIMITS, regions=CallRegions(mem)))
    results = run(handle, calls)
    for x, up, ref, result in zip(xs, ups, refs, results):
        expect = kernels.swiglu(x, up, backend="torch") if op == "swiglu" else getattr(kernels, op)(x, backend="torch")
        assert result.to_pb().out.region == ref
        torch.testing.assert_close(mem.read(ref, torch.float32, x.shape), expect, rtol=0, atol=0)


def test_graph_keys_follow_the_client_addresses_and_capture_on_second_use():
    from types import SimpleNamespace

    from logitserve.server.engine.graphs import LaunchGraphs
    from logitserve.server.ops.resident import graph_key

    mem = DeviceMemory()
    handle = SimpleNamespace(device=torch.device("cpu"), graphs=LaunchGraphs(torch.device("cpu"), None))
    x = torch.randn(2, 50)
    logits = mem.put(x)
    out = {"token_ids": mem.out(torch.int64, (2,))}

    def key(**fields):
        return graph_key(ops.SampleCall.from_pb(pb.SampleRequest(**fields), LIMITS, regions=CallRegions(mem)), handle)

    first = key(logits=logits, output_regions=out, seed=1)
    assert first == key(logits=logits, output_regions=out, seed=2, temperature=0.3)  # parameters are staged
    assert first != key(logits=logits, seed=1)  # other outputs
    assert first != key(logits=mem.put(x), output_regions=out, seed=1)  # another address
    assert not handle.graphs.seen_again(first) and handle.graphs.seen_again(first)
    assert key(logits=logits, output_regions=out, seed=1, logprobs=1) is None  # processors: eager, a launch of its own
    handle.device = torch.device("cuda", 0)  # the client's memory on another device than the server's
    assert key(logits=logits, seed=1) is None and key(logits=from_torch(x), output_regions=out, seed=1) is None
    handle.graphs = None
    assert key(logits=logits, seed=1) is None
