"""The client's side of shared memory: a tensor inside a region registered through the client
is sent as a RegionRef at the right offset (numpy and torch, at offsets, views), anything else
as bytes; ``out=`` validated client-side and sent as output_regions; regions unregistered on
close, never raising; CUDA streams synchronized only for calls that name CUDA memory.

The byte path is tests/test_client_bytes.py's; end to end against a real server process,
and CUDA, tests/test_client_regions_server.py's.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from recording_server import recording_server

from logitserve.client import AsyncClient, Client, LogitServeError, SampleResult
from logitserve.client import codec, messages, regions, results
from logitserve.client.region_table import RegionTable
from logitserve.client.transport import synchronize
from logitserve.v1 import logitserve_pb2 as pb


@pytest.fixture
def recorder():
    with recording_server() as handler:
        yield handler


@pytest.fixture
def host():
    """Two SharedHostBuffers, cleaned up after the test."""
    made = []

    def make(shape, dtype="float32", torch_=False):
        buf = regions.shared_tensor(shape, dtype) if torch_ else regions.shared_array(shape, dtype)
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.array = buf.tensor = None
        try:
            buf.shm.close()
        except BufferError:
            pass
        buf.unlink()


def test_a_tensor_inside_a_registered_region_is_sent_by_reference(host):
    buf = host((8, 100))
    table = RegionTable()
    table.add_system("whole", buf, 0, buf.byte_size)
    enc = messages.Encoder(table)
    msg = messages.build_sample(enc, (), buf.array[2:5], temperature=0.5)
    assert not enc.data and msg.logits.region == pb.RegionRef(region="whole", offset=2 * 400, byte_size=3 * 400)
    assert (msg.logits.dtype, list(msg.logits.shape), msg.logits.data) == (pb.DTYPE_FLOAT32, [3, 100], b"")
    assert enc.serialize(msg) == msg.SerializeToString()  # nothing framed in

    # A region registered from an offset of the buffer: offsets count from the region's start.
    table.add_system("tail", buf, 400 * 4, 400 * 4)
    enc = messages.Encoder(RegionTable())
    enc.table.add_system("tail", buf, 400 * 4, 400 * 4)
    msg = messages.build_softmax(enc, (), buf.array[5])
    assert msg.x.region == pb.RegionRef(region="tail", offset=100 * 4, byte_size=400)
    # Not inside it (starts before the region): bytes.
    enc = messages.Encoder(enc.table)
    msg = messages.build_softmax(enc, (), buf.array[3])
    assert not msg.x.HasField("region") and msg.x.data == b"" and ("x",) in enc.data


def test_what_is_not_inside_a_region_goes_as_bytes(host):
    buf, other = host((4, 10)), host((4, 10))
    table = RegionTable()
    table.add_system("r", buf, 0, buf.byte_size)
    for x in (buf.array[:, ::2],          # strided
              buf.array.T,                # not C-contiguous
              other.array,                # another object, not registered
              np.array(buf.array),        # a copy
              buf.array.view(">f4"),      # big-endian view: converted
              buf.array[:0]):             # empty
        enc = messages.Encoder(table)
        msg = messages.build_softmax(enc, (), x)
        assert not msg.x.HasField("region") and ("x",) in enc.data


def test_torch_host_tensors_and_integer_rows_are_found_too(host):
    buf = host((6, 8), torch.bfloat16, torch_=True)
    rows = host((6,), "int64")
    table = RegionTable()
    table.add_system("t", buf, 0, buf.byte_size)
    table.add_system("rows", rows, 0, rows.byte_size)
    enc = messages.Encoder(table)
    msg = messages.build_sample(enc, (), buf.tensor[3:], seed=rows.array[3:], top_k=rows.array[:3])
    assert msg.logits.region == pb.RegionRef(region="t", offset=3 * 16, byte_size=3 * 16)
    assert msg.logits.dtype == pb.DTYPE_BFLOAT16
    assert msg.seed_rows.region == pb.RegionRef(region="rows", offset=24, byte_size=24)
    assert msg.top_k_rows.region.offset == 0 and not enc.data


def test_out_is_validated_and_sent_as_output_regions(host):
    buf = host((4, 16))
    outs = host((64,), "uint8")
    ints = outs.array[:32].view(np.int64)
    flags = outs.array[32:36].view(np.bool_)
    table = RegionTable()
    table.add_system("in", buf, 0, buf.byte_size)
    table.add_system("out", outs, 0, outs.byte_size)
    enc = messages.Encoder(table)
    msg = messages.build_sample(enc, (), buf.array, out={"token_ids": ints, "valid": flags})
    assert dict(msg.output_regions) == {"token_ids": pb.RegionRef(region="out", offset=0, byte_size=32),
                                        "valid": pb.RegionRef(region="out", offset=32, byte_size=4)}
    assert enc.outputs == {("token_ids",): ints, ("valid",): flags}
    # An object with the attributes (a SampleResult of registered arrays), and a tuple for routes.
    enc = messages.Encoder(table)
    msg = messages.build_sample(enc, (), buf.array, out=SampleResult(ints, None, flags))
    assert sorted(msg.output_regions) == ["token_ids", "valid"]
    enc = messages.Encoder(table)
    w = outs.array[:32].view(np.float32).reshape(4, 2)
    i = outs.array[32:64].view(np.int32).reshape(4, 2)
    msg = messages.build_route_experts(enc, ("route_experts",), buf.array, 2, out=(w, i))
    assert msg.output_regions["indices"].offset == 32 and enc.outputs[("route_experts", "weights")] is w

    def error(call, match, kind=ValueError):
        with pytest.raises(kind, match=match):
            call(messages.Encoder(table))

    error(lambda e: messages.build_sample(e, (), buf.array, out={"token_ids": outs.array[:16].view(np.int32)}),
          r"out\['token_ids'\]: must be int64 of shape \[4\], got int32 of shape \[4\]")
    error(lambda e: messages.build_sample(e, (), buf.array, out={"seeds": outs.array[:24].view(np.int64)}),
          r"out\['seeds'\]: must be int64 of shape \[4\], got int64 of shape \[3\]")
    error(lambda e: messages.build_sample(e, (), buf.array, out={"token_ids": np.zeros(4, np.int64)}),
          r"out\['token_ids'\]: not inside a region registered through this client")
    error(lambda e: messages.build_sample(e, (), buf.array, out={"tokens": ints}), r"out: \['tokens'\] are not outputs")
    error(lambda e: messages.build_softmax(e, (), buf.array, out=buf.array[:2]),
          r"out: must be float32 of shape \[4, 16\], got float32 of shape \[2, 16\]")
    error(lambda e: messages.build_softmax(e, (), buf.array, out=[1.0]), "out: give a dict", TypeError)
    error(lambda e: messages.build_softmax(e, (), buf.array, out={"out": [1.0]}), "out: a numpy array or torch",
          TypeError)
    error(lambda e: messages.build_swiglu(e, (), buf.array, buf.array[:, :3], out=buf.array), "do not broadcast")
    # No table (the message builders' complete requests): out= has nowhere to go.
    with pytest.raises(ValueError, match="not inside a region"):
        messages.Encoder().outputs_into(pb.SoftmaxRequest(), (), buf.array, {"out": (pb.DTYPE_FLOAT32, (4, 16))})


def test_the_client_sends_references_returns_out_and_unregisters_on_close(recorder, host):
    buf = host((4, 16))
    outs = host((8,), "int64")
    plain = host((2,))
    buf.array[:] = 1
    with Client(recorder.target, timeout=30) as c:
        c.register("logits", buf)
        c.register_system("out", outs)
        c.register_system("plain", plain.key, 8)  # a key: registered, but no address known here
        assert c.registered == ["logits", "out", "plain"]
        result = c.sample(buf.array[1:3], seed=1, out={"token_ids": outs.array[2:4]})
        sent = pb.SampleRequest.FromString(recorder.requests("Sample")[-1])
        # The server knows each region by the client's scoped name; the caller never writes it.
        scoped = {name: f"{c.region_scope}.{name}" for name in ("logits", "out", "plain")}
        assert c.server_name("logits") == scoped["logits"]
        assert sent.logits.region == pb.RegionRef(region=scoped["logits"], offset=64, byte_size=128)
        assert sent.output_regions["token_ids"] == pb.RegionRef(region=scoped["out"], offset=16, byte_size=16)
        assert result.token_ids is not None and np.shares_memory(result.token_ids, outs.array)
        assert result.seeds.tolist() == [0, 0] and result.valid.tolist() == [True, True]  # as bytes
        y = c.softmax(buf.array, out=buf.array)  # in place
        assert y is buf.array
        step = c.step(softmax={"x": buf.array[:2], "out": buf.array[2:]}, sample={"logits": buf.array})
        assert step.softmax is not None and np.shares_memory(step.softmax, buf.array)
        assert step.sample.token_ids.shape == (4,)
        assert c.unregister("plain") == ["plain"] and c.registered == ["logits", "out"]
        with pytest.raises(ValueError, match="not inside a region"):
            c.softmax(buf.array[0, :2], out=plain.array)  # registered by key: no address known
        with pytest.raises(TypeError, match="register: 'x': give a SharedHostBuffer"):
            c.register("x", np.zeros(3))
    unregistered = [pb.UnregisterSharedMemoryRequest.FromString(r).name for r in recorder.requests("UnregisterSharedMemory")]
    assert unregistered == [scoped["plain"], scoped["logits"], scoped["out"]]
    assert c.registered == []
    c.close()  # twice: nothing left, nothing raised


def test_unregister_names_this_clients_regions_and_all_of_caller_is_the_empty_name(recorder, host):
    """Issue 37: ``unregister()`` sends one request per region registered through the client,
    under the server's names; only ``all_of_caller=True`` sends the empty name (every region of
    the caller, other clients' included)."""
    buf = host((2, 2))
    with Client(recorder.target, timeout=30, unregister_on_close=False) as c:
        c.register("a", buf)
        c.register_system("b", buf.key, 8)
        n = len(recorder.requests("UnregisterSharedMemory"))
        assert c.unregister() == ["a", "b"] and c.registered == []
        sent = [pb.UnregisterSharedMemoryRequest.FromString(r) for r in recorder.requests("UnregisterSharedMemory")[n:]]
        assert sent == [pb.UnregisterSharedMemoryRequest(name=c.server_name(x)) for x in ("a", "b")]
        c.unregister(all_of_caller=True, kind="system")
        assert recorder.requests("UnregisterSharedMemory")[-1] == pb.UnregisterSharedMemoryRequest(
            kind=pb.REGION_KIND_SYSTEM).SerializeToString()


def test_close_never_raises_and_can_keep_regions(recorder, host):
    buf = host((2, 2))
    recorder.fail_unregister = True
    c = Client(recorder.target, timeout=30, retries=4)
    c.register("a", buf)
    c.close()  # the unregister fails: close goes on
    assert c.registered == []
    recorder.fail_unregister = False
    n = len(recorder.requests("UnregisterSharedMemory"))
    with Client(recorder.target, timeout=30, unregister_on_close=False) as keep:
        keep.register("b", buf)
    assert len(recorder.requests("UnregisterSharedMemory")) == n

    async def main():
        async with AsyncClient(recorder.target, timeout=30) as ac:
            await ac.register("c", buf)
            sent = await ac.softmax(buf.array, out=buf.array)
            assert sent is buf.array
        return ac

    ac = asyncio.run(main())
    assert recorder.requests("UnregisterSharedMemory")[-1] == \
        pb.UnregisterSharedMemoryRequest(name=f"{ac.region_scope}.c").SerializeToString()
    assert ac.registered == []


def test_a_server_that_answers_bytes_for_an_out_region_is_an_error(host):
    buf = host((2, 4))
    table = RegionTable()
    table.add_system("r", buf, 0, buf.byte_size)
    enc = messages.Encoder(table)
    messages.build_softmax(enc, (), buf.array, out=buf.array)
    raw = pb.SoftmaxResponse(out=codec.encode(np.zeros((2, 4), np.float32))).SerializeToString()
    with pytest.raises(LogitServeError, match="asked for in a region, but the server answered bytes"):
        results.reader(pb.SoftmaxResponse, results.tensor_result, enc.outputs)(raw)


def test_cuda_streams_are_synchronized_only_for_calls_naming_cuda_memory(monkeypatch):
    synced = []

    class Stream:
        def synchronize(self):
            synced.append("given")

    synchronize(set(), Stream())
    assert synced == []
    synchronize({0}, Stream())
    assert synced == ["given"]
    fake_cuda = type("C", (), {"current_stream": staticmethod(lambda d: type("S", (), {
        "synchronize": lambda self: synced.append(d)})())})
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    synchronize({1, 0}, None)
    assert synced == ["given", 0, 1]
