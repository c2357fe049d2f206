"""The client's side of shared memory and its byte path.

- The bytes: every RPC's request, every dtype, numpy and torch, as the client serializes it
  (each tensor's bytes copied once, client/wire.py) is byte for byte protobuf's serialization
  of the same message, and is what reaches the server; answers read in place decode as
  protobuf's do.
- References: a tensor inside a region registered through the client is sent as a RegionRef
  at the right offset (numpy and torch, at offsets, views), anything else as bytes; ``out=``
  validated client-side and sent as output_regions; regions unregistered on close, never
  raising.
- End to end against a real server process (this test process is the client): every RPC with
  its inputs and outputs in system shared memory gives what the byte path gives.
- CUDA (``cuda`` mark): a CUDA tensor at an offset inside a larger allocation, registered and
  used from this process, tokens equal to ``kernels.sample``; ``out=`` in device memory.
"""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import AsyncClient, Client, LogitServeError, SampleResult, client as client_module
from logitserve.client import codec, messages, regions, wire
from logitserve.v1 import logitserve_pb2 as pb

NP_DTYPES = ["float16", "float32", "float64"]
TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _inputs(lib: str, dtype, shape=(3, 40), seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal(shape).astype(np.float32)
    if lib == "numpy":
        return x.astype(dtype)
    return torch.from_numpy(x).to(dtype)


def _calls(lib, dtype):
    """(rpc, builder, kwargs) for every RPC's request, tensors of ``dtype``."""
    x = _inputs(lib, dtype)
    g = _inputs(lib, dtype, (5, 16), 1)
    up = _inputs(lib, dtype, (1, 40), 2)
    rows = np.array([0.5, 0.8, 1.0])
    return [
        ("Sample", messages.build_sample, dict(logits=x, temperature=0.7, top_k=50, top_p=0.9, seed=3)),
        ("Sample", messages.build_sample, dict(logits=x, temperature=rows, top_k=np.array([1, 5, 0]),
                                               top_p=torch.tensor([0.5, 0.9, 1.0]), seed=np.array([1, 2, 3]),
                                               step=np.array([4, 5, 6]), min_p=rows / 10, filter_order="joint")),
        ("Sample", messages.build_sample, dict(logits=x, random_val=rows / 2)),
        ("RouteExperts", messages.build_route_experts, dict(gate_logits=g, k=4, renormalize=True)),
        ("Softmax", messages.build_softmax, dict(x=x, dim=0)),
        ("CausalSoftmax", messages.build_causal_softmax, dict(x=x)),
        ("Silu", messages.build_silu, dict(x=x)),
        ("Silu", messages.build_swiglu, dict(gate=x, up=up)),
        ("Step", None, dict(id="s", sample={"logits": x, "seed": 1}, route_experts={"gate_logits": g, "k": 2},
                            softmax={"x": x}, causal_softmax={"x": x}, swiglu={"gate": x, "up": up})),
    ]


def _build(builder, kwargs, table=None):
    enc = messages.Encoder(table)
    if builder is None:
        return enc, messages.build_step(enc, **kwargs)
    return enc, builder(enc, (), **kwargs)


def _reference(builder, kwargs) -> bytes:
    """protobuf's own bytes of the complete message (data inside)."""
    enc, msg = _build(builder, kwargs)
    return enc.full(msg).SerializeToString()


def _plain_bytes(x) -> bytes:
    """A tensor's wire bytes, computed the plain way."""
    if codec.is_torch(x):
        return x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).tobytes()


# ------------------------------------------------------------------------------ the byte path


@pytest.mark.parametrize("lib,dtype", [("numpy", d) for d in NP_DTYPES] + [("torch", d) for d in TORCH_DTYPES])
def test_each_request_is_protobufs_bytes(lib, dtype):
    for rpc, builder, kwargs in _calls(lib, dtype):
        enc, msg = _build(builder, kwargs)
        assert enc.data, rpc  # the tensors' bytes are held apart
        assert all(not t.data for t in _tensors(msg)), rpc  # ... and not in the message
        raw = enc.serialize(msg)
        assert raw == _reference(builder, kwargs), rpc
        again = type(msg).FromString(raw)
        assert again == enc.full(msg), rpc


def _tensors(msg):
    for field, value in msg.ListFields():
        if isinstance(value, pb.Tensor):
            yield value
        elif hasattr(value, "ListFields"):
            yield from _tensors(value)


@pytest.mark.parametrize("lib,dtype", [("numpy", "float32"), ("torch", torch.bfloat16)])
def test_the_data_is_the_tensor_bytes_in_wire_layout(lib, dtype):
    x = _inputs(lib, dtype)
    msg = messages.sample_request(x, temperature=0.5)
    assert msg.logits.data == _plain_bytes(x) and list(msg.logits.shape) == [3, 40]


def test_contiguous_inputs_are_not_copied_before_the_join():
    x = np.ones((4, 1000), np.float32)
    dtype, shape, data = codec.tensor_parts(x)
    assert np.shares_memory(np.frombuffer(data, np.uint8), x)
    t = torch.ones(4, 1000, dtype=torch.bfloat16)
    _, _, data = codec.tensor_parts(t)
    assert np.frombuffer(data, np.uint8).__array_interface__["data"][0] == t.data_ptr()


@pytest.mark.parametrize("x", [np.arange(24, dtype=">f4").reshape(4, 6), np.arange(48, dtype="<f8").reshape(6, 8)[::2, 1::3],
                               torch.arange(24, dtype=torch.float32).view(4, 6).t(), np.float32(3.5),
                               np.zeros((0, 5), np.float32), [[1.0, 2.0]]])
def test_strided_big_endian_scalar_and_empty_inputs(x):
    enc, msg = _build(messages.build_softmax, dict(x=x))
    assert enc.serialize(msg) == _reference(messages.build_softmax, dict(x=x))
    assert codec.decode(enc.full(msg).x).tolist() == np.asarray(x, dtype=np.float64).tolist()


def test_a_stream_step_request_given_as_a_message_is_serialized_by_protobuf():
    pending = __import__("collections").deque()
    step = messages.step_request("a", softmax={"x": np.ones(3, np.float32)})
    with Client("127.0.0.1:1") as c:
        assert c._step_bytes(step, pending) == step.SerializeToString() and pending.popleft() == {}
        raw = c._step_bytes({"id": "a", "softmax": {"x": np.ones(3, np.float32)}}, pending)
    assert raw == step.SerializeToString()


def test_a_large_request_reuses_a_buffer_nothing_references_any_more():
    recycler = wire.Recycler()
    x = np.random.default_rng(0).standard_normal((16, 128256)).astype(np.float32)  # 8 MB: recycled

    def serialize(scale):
        enc, msg = _build(messages.build_sample, dict(logits=x * scale, temperature=0.5))
        return enc.serialize(msg, recycler), enc.full(msg).SerializeToString()

    first, expect = serialize(1)
    recycler.give_back(first)
    address = id(first)
    del first
    second, expect2 = serialize(2)
    assert id(second) == address and second == expect2 and expect2 != expect  # written anew, protobuf's bytes
    recycler.give_back(second)
    held = second  # still referenced (as gRPC would while sending): never overwritten
    third, expect3 = serialize(3)
    assert third is not held and third == expect3 and held == expect2
    recycler.give_back(third)
    other, expect4 = _build(messages.build_sample, dict(logits=x[:8], temperature=0.5))
    assert other.serialize(expect4, recycler) == other.full(expect4).SerializeToString()  # under the threshold: joined
    small = _build(messages.build_softmax, dict(x=np.ones(4, np.float32)))
    recycler.give_back(small[0].serialize(small[1]))
    assert recycler._spare is not None and len(recycler._spare) > 1 << 20  # small requests are not kept


def _answers():
    t = lambda a: codec.encode(a)  # noqa: E731
    b = np.arange(3, dtype=np.int64)
    sample = pb.SampleResponse(token_ids=t(b), seeds=t(b + 7), valid=t(b > 0))
    route = pb.RouteExpertsResponse(weights=t(np.ones((3, 2), np.float32)), indices=t(np.ones((3, 2), np.int32)))
    out = pb.SoftmaxResponse(out=t(torch.randn(4, 5).to(torch.bfloat16)))
    step = pb.StepResponse(id="s", sample=sample, route_experts=route, softmax=out,
                           silu=pb.SiluResponse(out=t(np.ones(2, np.float16))))
    return [(pb.SampleResponse, sample, messages.sample_result), (pb.RouteExpertsResponse, route,
            messages.route_experts_result), (pb.SoftmaxResponse, out, messages.tensor_result),
            (pb.StepResponse, step, messages.step_result)]


@pytest.mark.parametrize("kind,msg,read", _answers())
def test_answers_are_read_where_they_arrived(kind, msg, read):
    raw = msg.SerializeToString()
    parsed, views = wire.split(raw, kind)
    assert views and all(v.obj is raw for v in views.values())  # views of the received bytes
    assert all(not t.data for t in _tensors(parsed))
    assert repr(read(parsed, views)) == repr(read(msg))  # the same values as through protobuf's copies
    result = messages.reader(kind, read)(raw)
    first = result if isinstance(result, np.ndarray) else (result[0] if isinstance(result, tuple) else None)
    if first is not None:
        assert first.flags.writeable


# -------------------------------------------------------------- a fake server that records bytes


class Recorder(grpc.GenericRpcHandler):
    """Every call's method and raw request bytes; answers each LogitServe call with outputs of
    the right shapes (zeros, or a region reference for each output_regions entry), and each
    SharedMemory call with an empty answer (``fail_unregister``: UNAVAILABLE instead)."""

    def __init__(self):
        self.calls: list[tuple[str, bytes]] = []
        self.fail_unregister = False

    def service(self, details):
        method = details.method.rsplit("/", 1)[1]

        def answer(raw, context):
            self.calls.append((method, raw))
            if method == "UnregisterSharedMemory":
                if self.fail_unregister:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "down")
                return pb.UnregisterSharedMemoryResponse(
                    names=[pb.UnregisterSharedMemoryRequest.FromString(raw).name]).SerializeToString()
            if method.startswith("Register"):
                return b""
            return _fake_answer(method, raw)

        if method == "StreamSteps":
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: (answer(r, ctx) for r in it))
        return grpc.unary_unary_rpc_method_handler(answer)

    def requests(self, method):
        return [raw for m, raw in self.calls if m == method]


def _filled(shape, dtype, ref=None):
    if ref is not None and ref.region:
        return pb.Tensor(dtype=dtype, shape=shape, region=ref)
    size = int(np.prod(shape)) * codec.ITEMSIZE[dtype]
    return pb.Tensor(dtype=dtype, shape=shape, data=b"\x01" * size if dtype == pb.DTYPE_BOOL else b"\0" * size)


def _fake_op(request):
    regions_ = request.output_regions
    if isinstance(request, pb.SampleRequest):
        b = [request.logits.shape[0]]
        return pb.SampleResponse(**{n: _filled(b, d, regions_.get(n)) for n, d in (
            ("token_ids", pb.DTYPE_INT64), ("seeds", pb.DTYPE_INT64), ("valid", pb.DTYPE_BOOL))})
    if isinstance(request, pb.RouteExpertsRequest):
        s = [request.gate_logits.shape[0], request.k]
        return pb.RouteExpertsResponse(weights=_filled(s, pb.DTYPE_FLOAT32, regions_.get("weights")),
                                       indices=_filled(s, pb.DTYPE_INT32, regions_.get("indices")))
    shape = list(np.broadcast_shapes(tuple(request.x.shape), tuple(request.up.shape))) \
        if isinstance(request, pb.SiluRequest) and request.HasField("up") else list(request.x.shape)
    response = {pb.SoftmaxRequest: pb.SoftmaxResponse, pb.CausalSoftmaxRequest: pb.CausalSoftmaxResponse,
                pb.SiluRequest: pb.SiluResponse}[type(request)]
    return response(out=_filled(shape, request.x.dtype, regions_.get("out")))


def _fake_answer(method, raw) -> bytes:
    if method in ("Step", "StreamSteps"):
        request = pb.StepRequest.FromString(raw)
        answer = pb.StepResponse(id=request.id)
        for slot in messages.STEP_OPS[:5]:
            if request.HasField(slot):
                getattr(answer, slot).CopyFrom(_fake_op(getattr(request, slot)))
        return answer.SerializeToString()
    kind = {"Sample": pb.SampleRequest, "RouteExperts": pb.RouteExpertsRequest, "Softmax": pb.SoftmaxRequest,
            "CausalSoftmax": pb.CausalSoftmaxRequest, "Silu": pb.SiluRequest}[method]
    return _fake_op(kind.FromString(raw)).SerializeToString()


@pytest.fixture
def recorder():
    handler = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    handler.target = f"127.0.0.1:{port}"
    yield handler
    server.stop(0)


_METHODS = {"sample": "Sample", "route_experts": "RouteExperts", "softmax": "Softmax",
            "causal_softmax": "CausalSoftmax", "silu": "Silu", "swiglu": "Silu", "step": "Step"}


def _client_call(c, builder, kwargs):
    name = "step" if builder is None else builder.__name__.removeprefix("build_")
    return getattr(c, name)(**kwargs), _METHODS[name]


@pytest.mark.parametrize("lib,dtype", [("numpy", "float32"), ("torch", torch.bfloat16), ("torch", torch.float16)])
def test_the_server_receives_those_bytes(recorder, lib, dtype):
    with Client(recorder.target, timeout=30) as c:
        for _, builder, kwargs in _calls(lib, dtype):
            _, method = _client_call(c, builder, kwargs)
            assert recorder.requests(method)[-1] == _reference(builder, kwargs), method
        steps = [dict(id=str(i), softmax={"x": _inputs(lib, dtype)}) for i in range(3)]
        assert [r.id for r in c.stream_steps(iter(steps))] == ["0", "1", "2"]
        assert recorder.requests("StreamSteps") == [messages.step_request(**s).SerializeToString() for s in steps]

    async def main():
        async with AsyncClient(recorder.target, timeout=30) as ac:
            for _, builder, kwargs in _calls(lib, dtype)[:4]:
                name = builder.__name__.removeprefix("build_")
                await getattr(ac, name)(**kwargs)
                assert recorder.requests(_METHODS[name])[-1] == _reference(builder, kwargs)
            got = [r.id async for r in ac.stream_steps(steps)]
            assert got == ["0", "1", "2"]

    asyncio.run(main())


# ------------------------------------------------------------------------------- references


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
    table = regions.RegionTable()
    table.add_system("whole", buf, 0, buf.byte_size)
    enc = messages.Encoder(table)
    msg = messages.build_sample(enc, (), buf.array[2:5], temperature=0.5)
    assert not enc.data and msg.logits.region == pb.RegionRef(region="whole", offset=2 * 400, byte_size=3 * 400)
    assert (msg.logits.dtype, list(msg.logits.shape), msg.logits.data) == (pb.DTYPE_FLOAT32, [3, 100], b"")
    assert enc.serialize(msg) == msg.SerializeToString()  # nothing framed in

    # A region registered from an offset of the buffer: offsets count from the region's start.
    table.add_system("tail", buf, 400 * 4, 400 * 4)
    enc = messages.Encoder(regions.RegionTable())
    enc.table.add_system("tail", buf, 400 * 4, 400 * 4)
    msg = messages.build_softmax(enc, (), buf.array[5])
    assert msg.x.region == pb.RegionRef(region="tail", offset=100 * 4, byte_size=400)
    # Not inside it (starts before the region): bytes.
    enc = messages.Encoder(enc.table)
    msg = messages.build_softmax(enc, (), buf.array[3])
    assert not msg.x.HasField("region") and msg.x.data == b"" and ("x",) in enc.data


def test_what_is_not_inside_a_region_goes_as_bytes(host):
    buf, other = host((4, 10)), host((4, 10))
    table = regions.RegionTable()
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
    table = regions.RegionTable()
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
    table = regions.RegionTable()
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
        assert sent.logits.region == pb.RegionRef(region="logits", offset=64, byte_size=128)
        assert sent.output_regions["token_ids"] == pb.RegionRef(region="out", offset=16, byte_size=16)
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
    assert unregistered == ["plain", "logits", "out"]
    assert c.registered == []
    c.close()  # twice: nothing left, nothing raised


def test_close_never_raises_and_can_keep_regions(recorder, host):
    buf = host((2, 2))
    recorder.fail_unregister = True
    c = Client(recorder.target, timeout=30, retries=5)
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
    assert recorder.requests("UnregisterSharedMemory")[-1] == pb.UnregisterSharedMemoryRequest(name="c").SerializeToString()
    assert ac.registered == []


def test_a_server_that_answers_bytes_for_an_out_region_is_an_error(host):
    buf = host((2, 4))
    table = regions.RegionTable()
    table.add_system("r", buf, 0, buf.byte_size)
    enc = messages.Encoder(table)
    messages.build_softmax(enc, (), buf.array, out=buf.array)
    raw = pb.SoftmaxResponse(out=codec.encode(np.zeros((2, 4), np.float32))).SerializeToString()
    with pytest.raises(LogitServeError, match="asked for in a region, but the server answered bytes"):
        messages.reader(pb.SoftmaxResponse, messages.tensor_result, enc.outputs)(raw)


def test_cuda_streams_are_synchronized_only_for_calls_naming_cuda_memory(monkeypatch):
    synced = []

    class Stream:
        def synchronize(self):
            synced.append("given")

    client_module._synchronize(set(), Stream())
    assert synced == []
    client_module._synchronize({0}, Stream())
    assert synced == ["given"]
    fake_cuda = type("C", (), {"current_stream": staticmethod(lambda d: type("S", (), {
        "synchronize": lambda self: synced.append(d)})())})
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    client_module._synchronize({1, 0}, None)
    assert synced == ["given", 0, 1]


# ------------------------------------------------------------------------ a real server process


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
        assert c.shared_memory_status() == []  # unregistered on close


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
        assert c.shared_memory_status() == []


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
        assert msg.logits.region == pb.RegionRef(region="logits", offset=512 * 4, byte_size=B * V * 4)
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
