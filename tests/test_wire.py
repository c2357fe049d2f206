"""Requests read with their tensor bytes in place (server/wire.py) parse to what protobuf parses,
for any encoding of the same fields, and invalid bytes fail as protobuf fails them."""

import random

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from logitserve.server.api.servicer import request_parsers
from logitserve.server.wire import InPlaceReader
from logitserve.v1 import logitserve_pb2 as pb

READ_SAMPLE = InPlaceReader(pb.SampleRequest.FromString, {"logits": (1,)})
PARSERS = request_parsers()


def restored(received):
    """The received message with the bytes read in place put back into it."""
    message = type(received.message)()
    message.CopyFrom(received.message)
    for name, view in received.tensor_bytes.items():
        tensor = message
        for part in name.split("."):
            tensor = getattr(tensor, part)
        assert tensor.data == b""
        tensor.data = bytes(view)
    return message


def tensor(dtype=pb.DTYPE_BFLOAT16, shape=(1, 6), data=None) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape, data=bytes(range(12)) if data is None else data)


def test_a_client_encoded_request_keeps_its_logits_in_place():
    request = pb.SampleRequest(logits=tensor(), temperature=0.7, top_k=20, seed=5)
    raw = request.SerializeToString()
    received = READ_SAMPLE(raw)
    view = received.tensor_bytes["logits"]
    assert view.obj is raw and bytes(view) == bytes(range(12))  # a view of the received bytes, not a copy
    assert received.message.logits.data == b"" and list(received.message.logits.shape) == [1, 6]
    assert restored(received) == request


OPERATOR_REQUESTS = {
    "Sample": pb.SampleRequest(logits=tensor()),
    "RouteExperts": pb.RouteExpertsRequest(gate_logits=tensor(), k=2),
    "Softmax": pb.SoftmaxRequest(x=tensor(), dim=0),
    "CausalSoftmax": pb.CausalSoftmaxRequest(x=tensor()),
    "Silu": pb.SiluRequest(x=tensor(), up=tensor(data=bytes(range(100, 112)))),
    "VerifyDraft": pb.VerifyDraftRequest(draft_token_ids=tensor(pb.DTYPE_INT32, (1, 3)), draft_probs=tensor(),
                                         draft_logits=tensor(data=bytes(range(50, 62))), target_logits=tensor(),
                                         top_p=0.9),
}
STEP = pb.StepRequest(id="s1", sample=OPERATOR_REQUESTS["Sample"], route_experts=OPERATOR_REQUESTS["RouteExperts"],
                      softmax=OPERATOR_REQUESTS["Softmax"], causal_softmax=OPERATOR_REQUESTS["CausalSoftmax"],
                      silu=OPERATOR_REQUESTS["Silu"])


def test_every_rpc_with_tensors_reads_them_in_place():
    requests = {**OPERATOR_REQUESTS, "Step": STEP, "StreamSteps": STEP}
    assert sorted(path.rsplit("/", 1)[1] for path in PARSERS) == sorted(requests)
    for name, request in requests.items():
        received = PARSERS[f"/logitserve.v1.LogitServe/{name}"](request.SerializeToString())
        assert restored(received) == request, name
    step = PARSERS["/logitserve.v1.LogitServe/Step"](STEP.SerializeToString())
    assert sorted(step.tensor_bytes) == ["causal_softmax.x", "route_experts.gate_logits", "sample.logits",
                                         "silu.up", "silu.x", "softmax.x"]
    assert bytes(step.tensor_bytes["silu.up"]) == bytes(range(100, 112))


def test_requests_without_tensor_bytes_parse_as_usual():
    for request in (pb.SampleRequest(), pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 1])),
                    pb.SampleRequest(top_k=3)):
        received = READ_SAMPLE(request.SerializeToString())
        assert received.tensor_bytes == {} and received.message == request


def _field_bytes(request: pb.SampleRequest) -> list[bytes]:
    """``request`` as one encoding per set field; concatenated in any order they parse back to it."""
    pieces = []
    for descriptor, value in request.ListFields():
        single = pb.SampleRequest()
        if descriptor.message_type is not None:
            getattr(single, descriptor.name).CopyFrom(value)
        else:
            setattr(single, descriptor.name, value)
        pieces.append(single.SerializeToString())
    return pieces


def _unknown_field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload  # numbers < 16, payloads < 128 bytes


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=200),
    shape=st.lists(st.integers(0, 1 << 40), max_size=4),
    dtype=st.sampled_from([pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, 99]),
    temperature=st.none() | st.floats(allow_nan=False),
    top_k=st.none() | st.integers(-5, 1 << 40),
    split_logits=st.booleans(),
    second_data=st.none() | st.binary(max_size=20),
    unknown=st.booleans(),
    order=st.randoms(use_true_random=False),
)
def test_any_encoding_parses_as_protobuf_parses_it(data, shape, dtype, temperature, top_k, split_logits, second_data,
                                                   unknown, order: random.Random):
    request = pb.SampleRequest(logits=pb.Tensor(dtype=dtype, shape=shape, data=data), seed=7)
    if temperature is not None:
        request.temperature = temperature
    if top_k is not None:
        request.top_k = top_k
    pieces = _field_bytes(request)
    if split_logits:  # the logits field twice: protobuf merges the occurrences
        pieces.append(pb.SampleRequest(logits=pb.Tensor(shape=[3])).SerializeToString())
    if second_data is not None:  # a later occurrence with data of its own: it wins
        pieces.append(pb.SampleRequest(logits=pb.Tensor(data=second_data)).SerializeToString())
    if unknown:
        pieces.insert(order.randrange(len(pieces) + 1), _unknown_field(15, b"unknown"))
    # Fields in any order, but the logits occurrences (tag 0x0a) in theirs: the last one's data wins.
    occurrences = [p for p in pieces if p.startswith(b"\x0a")]
    others = [p for p in pieces if not p.startswith(b"\x0a")]
    order.shuffle(others)
    merged = []
    while others or occurrences:
        take_logits = occurrences and (not others or order.random() < 0.5)
        merged.append(occurrences.pop(0) if take_logits else others.pop())
    raw = b"".join(merged)
    received = READ_SAMPLE(raw)
    assert restored(received) == pb.SampleRequest.FromString(raw)


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(1, 40), garbage=st.binary(max_size=40))
def test_invalid_bytes_fail_as_protobuf_fails_them(cut, garbage):
    raw = pb.SampleRequest(logits=tensor(), top_k=5).SerializeToString()
    for bad in (raw[:-cut], garbage, raw + garbage, garbage + raw):
        try:
            expected = pb.SampleRequest.FromString(bad)
        except DecodeError:
            with pytest.raises(DecodeError):
                READ_SAMPLE(bad)
        else:
            assert restored(READ_SAMPLE(bad)) == expected


def _fields_in_any_order(message, order: random.Random) -> bytes:
    """``message`` encoded a field at a time, its fields in a random order (sub-messages too)."""
    pieces = []
    for descriptor, value in message.ListFields():
        single = type(message)()
        if descriptor.message_type is not None:
            inner = _fields_in_any_order(value, order)
            single = bytes([descriptor.number << 3 | 2]) + _varint(len(inner)) + inner
        else:
            if isinstance(value, (str, bytes, int, float)):
                setattr(single, descriptor.name, value)
            else:  # a repeated field
                getattr(single, descriptor.name).extend(value)
            single = single.SerializeToString()
        pieces.append(single)
    order.shuffle(pieces)
    return b"".join(pieces)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=3, max_size=3),
    ops=st.sets(st.sampled_from(["sample", "silu", "softmax"]), min_size=1),
    second_silu=st.none() | st.binary(max_size=20),
    order=st.randoms(use_true_random=False),
)
def test_a_step_in_any_encoding_parses_as_protobuf_parses_it(sizes, ops, second_silu, order: random.Random):
    """Tensors two levels down, with lengths to write anew (varints of 1 and 2 bytes) around them."""
    step = pb.StepRequest(id="x" * sizes[2])
    if "sample" in ops:
        step.sample.CopyFrom(pb.SampleRequest(logits=tensor(shape=[1, sizes[0]], data=b"s" * sizes[0]), top_k=3))
    if "silu" in ops:
        step.silu.CopyFrom(pb.SiluRequest(x=tensor(data=b"x" * sizes[1]), up=tensor(data=b"u" * sizes[0])))
    if "softmax" in ops:
        step.softmax.CopyFrom(pb.SoftmaxRequest(x=tensor(data=b"m" * sizes[2]), dim=1))
    raw = _fields_in_any_order(step, order)
    if second_silu is not None:  # the silu field again, with an up of its own: the last one wins
        raw += pb.StepRequest(silu=pb.SiluRequest(up=pb.Tensor(data=second_silu))).SerializeToString()
    received = PARSERS["/logitserve.v1.LogitServe/Step"](raw)
    assert restored(received) == pb.StepRequest.FromString(raw)
