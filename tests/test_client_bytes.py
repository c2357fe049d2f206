"""The client's byte path: every RPC's request, every dtype, numpy and torch, as the client
serializes it (each tensor's bytes copied once, client/wire.py) is byte for byte protobuf's
serialization of the same message, and is what reaches the server; answers read in place decode
as protobuf's do.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from recording_server import recording_server

from logitserve.client import AsyncClient, Client
from logitserve.client import codec, messages, results, wire
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
        assert c._step_bytes(step, pending) == step.SerializeToString()
        assert pending.popleft()(pb.StepResponse(id="a").SerializeToString()) == results.StepResult(id="a")
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
    return [(pb.SampleResponse, sample, results.sample_result), (pb.RouteExpertsResponse, route,
            results.route_experts_result), (pb.SoftmaxResponse, out, results.tensor_result),
            (pb.StepResponse, step, results.step_result)]


@pytest.mark.parametrize("kind,msg,read", _answers())
def test_answers_are_read_where_they_arrived(kind, msg, read):
    raw = msg.SerializeToString()
    parsed, views = wire.split(raw, kind)
    assert views and all(v.obj is raw for v in views.values())  # views of the received bytes
    assert all(not t.data for t in _tensors(parsed))
    assert repr(read(parsed, views)) == repr(read(msg))  # the same values as through protobuf's copies
    result = results.reader(kind, read)(raw)
    first = result if isinstance(result, np.ndarray) else (result[0] if isinstance(result, tuple) else None)
    if first is not None:
        assert first.flags.writeable


# ---------------------------------------------------- what a server receives (a recording one)


@pytest.fixture
def recorder():
    with recording_server() as handler:
        yield handler


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


def _general_parts(t):
    """A torch tensor's wire bytes the general way (detach, contiguous, flat, bytes): what the
    address path of codec.tensor_parts must give."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(64, 1000).to(torch.bfloat16),  # contiguous: read by address
    lambda: torch.randn(64, 1000).to(torch.bfloat16)[:, ::3],  # strided view: copied once
    lambda: torch.randn(64, 1000).to(torch.bfloat16).t(),
    lambda: torch.randn(6, 10).to(torch.bfloat16)[2:4],  # contiguous at an offset into its storage
    lambda: torch.tensor(1.5, dtype=torch.bfloat16),  # 0-d
    lambda: torch.tensor([-2.25], dtype=torch.bfloat16),  # 1 element
    lambda: torch.zeros(0, 7, dtype=torch.bfloat16),  # empty
    lambda: torch.randn(4, 5, requires_grad=True),  # autograd: read without detach
    lambda: torch._neg_view(torch.randn(4, 5)),  # the negative bit: materialized, not read raw
    lambda: torch.arange(10, dtype=torch.int64), lambda: torch.tensor([True, False, True]),
    lambda: torch.randn(3, 128256).to(torch.bfloat16),
])
def test_torch_tensors_give_their_wire_bytes(make):
    t = make()
    dtype, shape, data = codec.tensor_parts(t)
    assert bytes(data) == _general_parts(t.resolve_neg()) and shape == tuple(t.shape)
    if t.is_contiguous() and not t.is_neg() and t.numel():
        assert np.frombuffer(data, np.uint8).__array_interface__["data"][0] == t.data_ptr()  # not copied
    if t.ndim == 2 and t.numel():
        assert codec.decode_torch(codec.encode(t)).equal(t.detach().resolve_neg())
        enc, msg = _build(messages.build_softmax, dict(x=t))
        assert enc.serialize(msg, wire.Recycler()) == _reference(messages.build_softmax, dict(x=t))


def test_a_tensor_read_by_address_stays_alive_while_its_bytes_are_held():
    data = codec.tensor_parts(torch.full((1000,), 3.0, dtype=torch.bfloat16))[2]  # the tensor is unnamed
    __import__("gc").collect()
    torch.zeros(1000, dtype=torch.bfloat16)  # an allocation that could reuse freed memory
    assert bytes(data) == torch.full((1000,), 3.0, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
