"""The client's shared memory end to end against a real server process (this test process is
the client): every RPC with its inputs and outputs in system shared memory gives what the byte
path gives; a region a call names must be registered by the caller. CUDA (``cuda`` mark): a
CUDA tensor at an offset inside a larger allocation, registered and used from this process,
tokens equal to ``kernels.sample``; ``out=`` in device memory.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import AsyncClient, Client, LogitServeError
from logitserve.client import messages, regions
from logitserve.v1 import logitserve_pb2 as pb


@pytest.fixture(scope="module")
def server():
    from logitserve.server.process import ServerProcess

    with ServerProcess("--warmup-dtypes", "none") as s:
        yield s


@pytest.fixture(scope="module")
def shm():
    """Shared buffers for the end-to-end tests: inputs and outputs."""
    bufs = {
        "x": regions.shared_array((6, 64), "float32"),
        "gate": regions.shared_array((5, 16), "float32"),
        "up": regions.shared_array((1, 64), "float32"),
        "out": regions.shared_array((1 << 14,), "uint8"),
        "bf": regions.shared_tensor((4, 64), torch.bfloat16),
    }
    g = np.random.default_rng(5)
    bufs["x"].array[:] = g.standard_normal((6, 64)) * 3
    bufs["gate"].array[:] = g.standard_normal((5, 16))
    bufs["up"].array[:] = g.standard_normal((1, 64))
    bufs["bf"].tensor.copy_(torch.randn(4, 64))
    yield bufs
    for buf in bufs.values():
        buf.array = buf.tensor = None
        try:
            buf.shm.close()
        except BufferError:
            pass
        buf.unlink()


def _slot(out, offset, dtype, shape):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return out.array[offset:offset + n].view(dtype).reshape(shape)


def test_every_rpc_in_system_shared_memory_equals_the_byte_path(server, shm):
    x, gate, up, out, bf = (shm[k] for k in ("x", "gate", "up", "out", "bf"))
    with Client(server.target, timeout=120) as c, Client(server.target, timeout=120) as plain:
        for name in ("x", "gate", "up", "out", "bf"):
            c.register(name, shm[name])
        assert sorted(s.name for s in c.shared_memory_status()) == ["bf", "gate", "out", "up", "x"]
        logits = x.array[1:5]
        kw = dict(temperature=0.8, top_k=20, top_p=0.9, seed=np.arange(4) + 11)
        expect = plain.sample(np.array(logits), **kw)
        got = c.sample(logits, **kw)
        assert all(np.array_equal(getattr(got, f), getattr(expect, f)) for f in ("token_ids", "seeds", "valid"))
        tokens, seeds, valid = _slot(out, 0, np.int64, 4), _slot(out, 32, np.int64, 4), _slot(out, 64, np.bool_, 4)
        got = c.sample(logits, **kw, out={"token_ids": tokens, "seeds": seeds, "valid": valid})
        assert got.token_ids is tokens and np.array_equal(tokens, expect.token_ids)
        assert np.array_equal(seeds, expect.seeds) and np.array_equal(valid, expect.valid)

        expect_bf = plain.sample(bf.tensor.clone(), temperature=0)
        assert np.array_equal(c.sample(bf.tensor, temperature=0).token_ids, expect_bf.token_ids)

        w, i = _slot(out, 128, np.float32, (5, 3)), _slot(out, 256, np.int32, (5, 3))
        expect_w, expect_i = plain.route_experts(np.array(gate.array), 3, True)
        got_w, got_i = c.route_experts(gate.array, 3, True, out={"weights": w, "indices": i})
        assert got_w is w and np.array_equal(w, expect_w) and np.array_equal(i, expect_i)

        for method, args in (("softmax", (x.array,)), ("causal_softmax", (x.array,)), ("silu", (x.array,)),
                             ("swiglu", (x.array, up.array))):
            expect = getattr(plain, method)(*(np.array(a) for a in args))
            assert np.array_equal(getattr(c, method)(*args), expect), method
            dest = _slot(out, 1024, np.float32, expect.shape)
            assert getattr(c, method)(*args, out=dest) is dest and np.array_equal(dest, expect), method

        dest = _slot(out, 4096, np.float32, (6, 64))
        step = c.step(id="s", sample={"logits": logits, **kw, "out": {"token_ids": tokens}},
                      softmax={"x": x.array, "out": dest}, route_experts={"gate_logits": gate.array, "k": 3})
        assert step.sample.token_ids is tokens and step.softmax is dest
        assert np.array_equal(dest, plain.softmax(np.array(x.array)))
        assert np.array_equal(step.route_experts[1], plain.route_experts(np.array(gate.array), 3)[1])
        stream = list(c.stream_steps([{"id": str(n), "silu": {"x": x.array, "out": dest}} for n in range(3)]))
        assert [s.id for s in stream] == ["0", "1", "2"] and all(s.silu is dest for s in stream)
        assert np.array_equal(dest, plain.silu(np.array(x.array)))
    with Client(server.target, timeout=120) as c:
        assert c.shared_memory_status(all_of_caller=True) == []  # unregistered on close


def test_async_client_end_to_end(server, shm):
    x, out = shm["x"], shm["out"]

    async def main():
        async with AsyncClient(server.target, timeout=120) as ac:
            await ac.register("x", x)
            await ac.register("o", out)
            dest = _slot(out, 8192, np.float32, (6, 64))
            assert await ac.softmax(x.array, out=dest) is dest
            return np.array(dest), [s.name for s in await ac.shared_memory_status()]

    got, names = asyncio.run(main())
    assert names == ["o", "x"]
    with Client(server.target, timeout=120) as c:
        assert np.array_equal(got, c.softmax(np.array(x.array)))
        assert c.shared_memory_status(all_of_caller=True) == []


def test_a_region_named_by_a_call_must_be_registered_by_the_caller(server, shm):
    x = shm["x"]
    with Client(server.target, timeout=120) as c:
        with pytest.raises(LogitServeError) as info:
            c.softmax(regions.region_tensor("nobody", "float32", [6, 64]))
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        c.register("x", x)
        ref = regions.region_tensor("x", "float32", [2, 64], offset=64 * 4)  # a Tensor message given as is
        assert np.array_equal(c.softmax(ref), c.softmax(np.array(x.array[1:3])))


# ------------------------------------------------------------------------------------------ CUDA


@pytest.mark.cuda
def test_cuda_tensor_at_an_offset_used_from_this_process():
    pytest.importorskip("cuda.bindings")
    from logitserve.kernels import sample
    from logitserve.server.process import ServerProcess

    B, V = 8, 128256
    big = torch.zeros(B * V + (1 << 20), dtype=torch.float32, device="cuda:0")
    region = big[4096:4096 + B * V + 1024]  # a region starting inside the allocation
    logits = region[512:512 + B * V].view(B, V)  # a tensor inside the region, at an offset
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        logits.copy_(torch.randn(B, V, device="cuda:0") * 3)
    outs = torch.zeros(1024, dtype=torch.uint8, device="cuda:0")
    tokens = outs[64:64 + 8 * B].view(torch.int64)
    seeds = outs[256:256 + 8 * B].view(torch.int64)
    valid = outs[512:512 + B].view(torch.bool)
    kw = dict(temperature=0.8, top_k=50, top_p=0.9, seed=1234, step=3)
    with ServerProcess("--warmup-dtypes", "none", device="cuda:0", backend="triton") as server, \
            Client(server.target, timeout=300) as c:
        c.register("logits", region)
        c.register("outs", outs)
        [status] = c.shared_memory_status("logits")
        assert status.kind == "cuda" and status.offset == 4096 * 4 and status.byte_size == region.numel() * 4
        enc = messages.Encoder(c._regions)
        msg = messages.build_sample(enc, (), logits)
        assert msg.logits.region == pb.RegionRef(region=c.server_name("logits"), offset=512 * 4,
                                                 byte_size=B * V * 4)
        # The producing stream is passed: it is synchronized before the call.
        got = c.sample(logits, **kw, stream=stream)
        expect = sample(logits, **kw).cpu().numpy()
        assert np.array_equal(got.token_ids, expect)
        result = c.sample(logits, **kw, out={"token_ids": tokens, "seeds": seeds, "valid": valid})
        assert result.token_ids is tokens
        assert np.array_equal(tokens.cpu().numpy(), expect) and bool(valid.all())
        assert seeds.cpu().tolist() == [1234] * B
        # bfloat16 in the same allocation, every op with its output in device memory.
        x = region[:4 * 256].view(torch.bfloat16).view(8, 256)
        x.copy_(torch.randn(8, 256, device="cuda:0").to(torch.bfloat16))
        with pytest.raises(ValueError, match="not inside a region"):
            c.softmax(x, out=torch.empty(8, 256, dtype=torch.bfloat16, device="cuda:0"))
        dest = region[-1024:].view(torch.bfloat16)[:8 * 256].view(8, 256)
        assert c.softmax(x, out=dest) is dest
        torch.testing.assert_close(dest.float(), torch.softmax(x.float(), -1), atol=1e-2, rtol=1e-2)
    assert c.registered == []
