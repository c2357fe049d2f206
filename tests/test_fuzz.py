"""Property-based fuzzing of the wire: random and adversarial requests to an in-process server.

Every call must end with OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED: never INTERNAL or UNKNOWN,
never a hang (each call has a deadline, and DEADLINE_EXCEEDED fails the test), never a crash.
OK answers are checked (values against the torch kernels on the same decoded input, or the
invariants of Sample and RouteExperts), and after every input the server must answer two
canary requests correctly.

Inputs (hypothesis): tensors of every dtype and of unknown enum values; shapes of rank 0 to 10
with zero, negative, 2**31, 2**63 - 1 and -2**63 dimensions; data as long as the shape needs,
a few bytes off, or any length; values with NaN, infinities, subnormals and float extremes (raw
bit patterns too); sampling parameters at and beyond their limits (NaN, inf, 1e-300, 1e300,
int64 extremes, unknown filter orders, per-row tensors of the wrong dtype, rank or length);
Step with any subset of operators; and raw bytes through a channel with identity serializers:
garbage, truncations, bit flips, splices and concatenations of valid messages, on every method
and as StreamSteps streams.

The server runs the torch backend with small limits (64 rows, 4096 columns, 256 KiB messages),
so RESOURCE_EXHAUSTED is reachable and every input is cheap. ``FUZZ_EXAMPLES`` scales the
number of examples (default 1.0); the totals are printed at the end of the module and written
as JSON to ``$LOGITSERVE_FUZZ_REPORT`` when set.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logitserve import kernels
from logitserve.server import ServerConfig
from logitserve.server.tensors import TORCH_DTYPES, decode
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
SERVICE = "/logitserve.v1.LogitServe/"
TIMEOUT_S = 30.0
MAX_ROWS, MAX_VOCAB, MAX_MESSAGE = 64, 4096, 256 * 1024
SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1.0"))
ITEMSIZE = {pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT64: 8,
            pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8, pb.DTYPE_BOOL: 1}
FLOAT_WIRE = (pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64)
RESPONSES = {"Sample": pb.SampleResponse, "RouteExperts": pb.RouteExpertsResponse, "Softmax": pb.SoftmaxResponse,
             "CausalSoftmax": pb.CausalSoftmaxResponse, "Silu": pb.SiluResponse, "Step": pb.StepResponse,
             "GetServerInfo": pb.GetServerInfoResponse}
METHODS = sorted([*RESPONSES, "StreamSteps"])

TALLY: collections.Counter = collections.Counter()


def examples(n: int) -> int:
    return max(1, int(n * SCALE))


FUZZ = dict(deadline=None, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# -------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(request):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          max_delay_us=0, max_rows=MAX_ROWS, max_vocab=MAX_VOCAB, max_message_bytes=MAX_MESSAGE)
    with ServerThread(config) as s:
        yield s
    total = sum(v for k, v in TALLY.items() if k.startswith("input:"))
    lines = [f"fuzz: {total} inputs tried"] + [f"  {k}: {v}" for k, v in sorted(TALLY.items())]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(lines))
    if os.environ.get("LOGITSERVE_FUZZ_REPORT"):
        with open(os.environ["LOGITSERVE_FUZZ_REPORT"], "w") as f:
            json.dump(dict(inputs=total, counts=dict(sorted(TALLY.items()))), f, indent=1)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as ch:
        yield ch


def _raw_unary(channel, rpc: str, data: bytes):
    method = channel.unary_unary(SERVICE + rpc, request_serializer=None, response_deserializer=None)
    try:
        return grpc.StatusCode.OK, method(data, timeout=TIMEOUT_S), ""
    except grpc.RpcError as exc:
        return exc.code(), None, exc.details()


def _raw_stream(channel, payloads: list[bytes]):
    method = channel.stream_stream(SERVICE + "StreamSteps", request_serializer=None, response_deserializer=None)
    try:
        return grpc.StatusCode.OK, list(method(iter(payloads), timeout=TIMEOUT_S)), ""
    except grpc.RpcError as exc:
        return exc.code(), None, exc.details()


def _record(kind: str, rpc: str, code: grpc.StatusCode, details: str) -> None:
    TALLY[f"input:{kind}"] += 1
    TALLY[f"status:{code.name}"] += 1
    TALLY[f"rpc:{rpc}"] += 1
    TALLY[f"rpc:{rpc}:{code.name}"] += 1
    assert code in ALLOWED, f"{rpc}: {code.name}: {details}"


# --------------------------------------------------------------------------------- canaries

CANARY_X = torch.tensor([[0.5, -1.0, 3.0, 2.0, float("-inf")], [1.0, 1.0, 1.0, 1.0, 1.0]])
CANARY_SOFTMAX = pb.SoftmaxRequest(x=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 5],
                                               data=CANARY_X.numpy().tobytes())).SerializeToString()
CANARY_SAMPLE = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 5], data=CANARY_X.numpy().tobytes()),
                                 temperature=0.0).SerializeToString()


def _canaries(channel) -> None:
    """The server still answers valid requests, correctly."""
    code, raw, details = _raw_unary(channel, "Softmax", CANARY_SOFTMAX)
    assert code == grpc.StatusCode.OK, details
    out = np.frombuffer(pb.SoftmaxResponse.FromString(raw).out.data, "<f4").reshape(2, 5)
    np.testing.assert_allclose(out, torch.softmax(CANARY_X, -1).numpy(), rtol=1e-6)
    code, raw, details = _raw_unary(channel, "Sample", CANARY_SAMPLE)
    assert code == grpc.StatusCode.OK, details
    assert np.frombuffer(pb.SampleResponse.FromString(raw).token_ids.data, "<i8").tolist() == [2, 0]


# ------------------------------------------------------------------------------- strategies

INT64_EDGES = [0, 1, -1, 2, 7, 2**31 - 1, 2**31, 2**32 + 1, 2**62, 2**63 - 1, -(2**63), -(2**31)]
int64s = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1), st.integers(-3, 70))
# Edges of the rules and of float32 (the kernels' precision): 3.5e38 overflows it, 1e-46 underflows.
DOUBLE_EDGES = [0.0, -0.0, 1.0, 0.5, 2.0, -1.0, 1e-300, 1e300, 5e-324, 1e-46, 1e-45, 3.4e38, 3.5e38, 1.7e308, 65504.0,
                1 - 1e-12, 1 + 1e-12, 0.99999999, math.nan, -math.nan, math.inf, -math.inf]
doubles = st.one_of(st.sampled_from(DOUBLE_EDGES), st.floats(allow_nan=True, allow_infinity=True),
                    st.floats(0, 1), st.floats(0, 3), st.floats(1e30, 1e308), st.floats(0, 1e-30))
dtypes = st.one_of(st.sampled_from(FLOAT_WIRE), st.sampled_from(sorted(ITEMSIZE)),
                   st.sampled_from([0, 8, 99, -1, 2**31 - 1, -(2**31)]))
ADVERSARIAL_DIMS = [0, -1, -7, 2**31, 2**32 + 1, 2**62, 2**63 - 1, -(2**63), 1, 3, 4096, 4097, 65]
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 1e-38, 3.4e38, -3.4e38, 65504.0, 1e308, -1e308,
                     5e-324, 1.0, -1.0], dtype=np.float64)


def _encode(values: np.ndarray, dtype: int) -> bytes:
    """float64 values as the wire dtype's little-endian bytes (bfloat16: top half of float32)."""
    with np.errstate(all="ignore"):
        if dtype == pb.DTYPE_BFLOAT16:
            return (values.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        if dtype in (pb.DTYPE_INT32, pb.DTYPE_INT64):
            clean = np.nan_to_num(values, nan=0, posinf=2**31 - 1, neginf=-(2**31))
            return np.clip(clean, -(2**31), 2**31 - 1).astype("<i4" if dtype == pb.DTYPE_INT32 else "<i8").tobytes()
        if dtype == pb.DTYPE_BOOL:
            return (values > 0).astype("|b1").tobytes()
        return values.astype({pb.DTYPE_FLOAT16: "<f2", pb.DTYPE_FLOAT32: "<f4",
                              pb.DTYPE_FLOAT64: "<f8"}.get(dtype, "<f4")).tobytes()  # unknown: 4 bytes


@st.composite
def tensors(draw, dtype=dtypes, shape=None, max_elems: int = 8192, well_formed: bool = False) -> pb.Tensor:
    """A Tensor message. ``well_formed``: data exactly as long as the shape needs (values with
    NaN, infinities and extremes, or raw bit patterns); else often not, and any shape."""
    wire = draw(dtype)
    if shape is None:
        if not well_formed and draw(st.integers(0, 4)) == 0:
            shape = draw(st.lists(st.one_of(st.sampled_from(ADVERSARIAL_DIMS), st.integers(-3, 9)), max_size=10))
        else:
            shape = draw(st.lists(st.integers(1, 6), min_size=0, max_size=3))
            shape.append(draw(st.sampled_from([1, 2, 5, 16, 33, 64, 300, 1000, 4097])))
    n = math.prod(shape) if all(d >= 0 for d in shape) else -1
    itemsize = ITEMSIZE.get(wire, 4)
    modes = ["values", "values", "bits"] if well_formed else ["values", "values", "values", "bits", "off by some",
                                                              "any length"]
    mode = draw(st.sampled_from(modes))
    if 0 <= n <= max_elems and mode in ("values", "bits"):
        if mode == "bits":
            data = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
        else:
            rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
            values = rng.standard_normal(n) * draw(st.sampled_from([1.0, 3.0, 1e4, 1e-30]))
            k = draw(st.integers(0, min(n, 4)))
            if k:
                values[rng.choice(n, k, replace=False)] = rng.choice(SPECIALS, k)
            data = _encode(values, wire)
    elif mode == "off by some" and 0 <= n <= max_elems:
        data = b"\x00" * max(n * itemsize + draw(st.sampled_from([-9, -2, -1, 1, 3, 8])), 0)
    else:
        data = draw(st.binary(max_size=512))
    return pb.Tensor(dtype=wire, shape=shape, data=data)


def good_tensors(shape, dtype=st.sampled_from(FLOAT_WIRE)) -> st.SearchStrategy:
    return tensors(dtype=dtype, shape=list(shape), well_formed=True)


# Legal values of each sampling parameter, extremes included (they must be answered OK).
LEGAL = {
    "temperature": st.one_of(st.sampled_from([0.0, 1e-300, 1e-30, 1e-6, 1.0, 3e38]), st.floats(0, 10)),
    "top_p": st.one_of(st.sampled_from([1.0, 1e-30, 1e-6, 0.5, 0.99999999]), st.floats(1e-6, 1)),
    "min_p": st.one_of(st.sampled_from([0.0, 1.0, 1e-300, 0.5]), st.floats(0, 1)),
    "random_val": st.one_of(st.sampled_from([0.0, 0.5, 0.9999999]), st.floats(0, 0.9999)),
    "top_k": st.one_of(st.sampled_from([0, 1, 2, 2**31, 2**63 - 1]), st.integers(0, 5000)),
    "seed": st.one_of(st.sampled_from([0, 2**63 - 1, 2**32]), st.integers(0, 2**63 - 1)),
    "step": st.one_of(st.sampled_from([0, 2**63 - 1]), st.integers(0, 2**63 - 1)),
}
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "random_val")


@st.composite
def per_row(draw, rows: int, name: str, legal: bool) -> pb.Tensor:
    """A per-row parameter tensor: legal ([rows], fitting dtype, legal values) or anything."""
    floating = name in FLOAT_PARAMS
    if not legal and draw(st.integers(0, 3)) == 0:
        return draw(tensors())
    values = draw(st.lists(LEGAL[name] if legal else (doubles if floating else int64s), min_size=rows, max_size=rows))
    if floating:
        wire = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64]))
        return pb.Tensor(dtype=wire, shape=[rows], data=_encode(np.array(values, dtype=np.float64), wire))
    wire = pb.DTYPE_INT64 if not legal or max(values) >= 2**31 else draw(st.sampled_from([pb.DTYPE_INT32,
                                                                                         pb.DTYPE_INT64]))
    if name == "seed":
        wire = pb.DTYPE_INT64 if legal else wire
    ints = np.array(values, dtype=np.int64)
    return pb.Tensor(dtype=wire, shape=[rows], data=ints.astype("<i4" if wire == pb.DTYPE_INT32 else "<i8").tobytes())


@st.composite
def sample_requests(draw, legal: bool | None = None) -> pb.SampleRequest:
    legal = draw(st.booleans()) if legal is None else legal
    # Not legal: one or two fields go wild, the rest stay legal, so each wild value is what
    # the server has to judge (a request wrong everywhere is refused at its first field).
    fields = ("logits", *FLOAT_PARAMS, "top_k", "seed", "step", "filter_order")
    wild = set() if legal else draw(st.sets(st.sampled_from(fields), min_size=1, max_size=2))
    rows, vocab = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 7, 64, 1000, 4096]))
    logits = draw(st.one_of(good_tensors([rows, vocab]), tensors()) if "logits" in wild else good_tensors([rows, vocab]))
    msg = pb.SampleRequest(logits=logits)
    with_random_val = draw(st.booleans()) or "random_val" in wild
    for name in (*FLOAT_PARAMS, "top_k", "seed", "step"):
        choice = draw(st.sampled_from(["scalar", "rows"] if name in wild else ["unset", "scalar", "rows"]))
        if name == "random_val" and not with_random_val:
            choice = "unset"
        if name == "min_p" and with_random_val and "min_p" not in wild:
            choice = "unset"  # random_val mode has no min-p
        if choice == "scalar":
            floating = name in FLOAT_PARAMS
            setattr(msg, name, draw((doubles if floating else int64s) if name in wild else LEGAL[name]))
        elif choice == "rows":
            getattr(msg, f"{name}_rows").CopyFrom(draw(per_row(rows, name, name not in wild)))
    msg.filter_order = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(-(2**31), 2**31 - 1))
                            if "filter_order" in wild else st.sampled_from([0, 1, 2]))
    return msg


ROUTE_WIRE = st.sampled_from([pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32])


@st.composite
def route_requests(draw, legal: bool | None = None) -> pb.RouteExpertsRequest:
    legal = draw(st.booleans()) if legal is None else legal
    rows, experts = draw(st.integers(1, 8)), draw(st.sampled_from([1, 3, 8, 64, 256, 4096]))
    if legal:
        return pb.RouteExpertsRequest(gate_logits=draw(good_tensors([rows, experts], ROUTE_WIRE)),
                                      k=draw(st.integers(1, min(experts, 16))), renormalize=draw(st.booleans()))
    gate = draw(st.one_of(good_tensors([rows, experts]), tensors()))
    return pb.RouteExpertsRequest(gate_logits=gate, k=draw(st.one_of(st.integers(0, 9), int64s)),
                                  renormalize=draw(st.booleans()))


@st.composite
def softmax_requests(draw, legal: bool | None = None) -> pb.SoftmaxRequest:
    legal = draw(st.booleans()) if legal is None else legal
    if legal:
        x = draw(tensors(dtype=st.sampled_from(FLOAT_WIRE), well_formed=True))
        msg = pb.SoftmaxRequest(x=x)
        rank = len(x.shape)
        if draw(st.booleans()) and rank:
            msg.dim = draw(st.integers(-rank, rank - 1))
        if math.prod(x.shape) > MAX_ROWS * 16:
            msg.dim = -1  # any axis of a big tensor would be over --max-rows
        return msg
    msg = pb.SoftmaxRequest(x=draw(tensors()))
    if draw(st.booleans()):
        msg.dim = draw(st.one_of(st.integers(-4, 4), int64s))
    return msg


@st.composite
def causal_requests(draw, legal: bool | None = None) -> pb.CausalSoftmaxRequest:
    legal = draw(st.booleans()) if legal is None else legal
    s = draw(st.integers(1, 6))
    t = s + draw(st.integers(0 if legal else -2, 6))
    shape = ([draw(st.integers(1, 3))] if draw(st.booleans()) else []) + [s, t]
    if legal:
        return pb.CausalSoftmaxRequest(x=draw(good_tensors(shape)))
    return pb.CausalSoftmaxRequest(x=draw(st.one_of(tensors(shape=shape), tensors())))


@st.composite
def silu_requests(draw, legal: bool | None = None) -> pb.SiluRequest:
    legal = draw(st.booleans()) if legal is None else legal
    x = draw(tensors(dtype=st.sampled_from(FLOAT_WIRE), well_formed=True) if legal else tensors())
    msg = pb.SiluRequest(x=x)
    if draw(st.booleans()):
        dims = list(x.shape)
        if legal or (draw(st.booleans()) and dims):  # broadcastable variants of x's shape
            dims = [d if draw(st.booleans()) else 1 for d in dims]
            shape = [draw(st.integers(1, 4))] * draw(st.integers(0, 1)) + dims
            wire = st.just(x.dtype) if legal or draw(st.booleans()) else dtypes
            msg.up.CopyFrom(draw(tensors(dtype=wire, shape=shape, well_formed=legal)))
        else:
            msg.up.CopyFrom(draw(tensors()))
    return msg


@st.composite
def step_requests(draw) -> pb.StepRequest:
    legal = draw(st.booleans())
    msg = pb.StepRequest(id=draw(st.text(max_size=20)))
    for name, strategy in (("sample", sample_requests), ("route_experts", route_requests),
                           ("softmax", softmax_requests), ("causal_softmax", causal_requests),
                           ("silu", silu_requests)):
        if draw(st.integers(0, 2)) == 0:
            getattr(msg, name).CopyFrom(draw(strategy(legal=True if legal else None)))
    return msg


REQUEST_STRATEGIES = {
    "Sample": sample_requests(), "RouteExperts": route_requests(), "Softmax": softmax_requests(),
    "CausalSoftmax": causal_requests(), "Silu": silu_requests(), "Step": step_requests(),
    "GetServerInfo": st.just(pb.GetServerInfoRequest()),
}


# --------------------------------------------------------------------- checks of OK answers


def _decode(t: pb.Tensor) -> torch.Tensor:
    return decode(t, "answer", dtypes=tuple(TORCH_DTYPES.values()), ranks=tuple(range(0, 11))).torch()


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    g, w = got.double(), want.double()
    both_nan = torch.isnan(g) & torch.isnan(w)
    close = torch.isclose(g, w, rtol=1e-5 if want.dtype in (torch.float32, torch.float64) else 1e-2, atol=1e-30)
    assert bool((close | both_nan).all()), f"{what}: answer differs from the kernel's"


def _check_answer(rpc: str, request, raw) -> None:
    """An OK answer: values equal to the kernels' on the decoded input, or Sample/RouteExperts invariants."""
    if rpc == "Step":
        reply = pb.StepResponse.FromString(raw)
        assert reply.id == request.id
        for name, sub in (("sample", "Sample"), ("route_experts", "RouteExperts"), ("softmax", "Softmax"),
                          ("causal_softmax", "CausalSoftmax"), ("silu", "Silu")):
            assert reply.HasField(name) == request.HasField(name), name
            if request.HasField(name):
                _check_answer(sub, getattr(request, name), getattr(reply, name).SerializeToString())
        return
    reply = RESPONSES[rpc].FromString(raw) if isinstance(raw, bytes) else raw
    if rpc == "Sample":
        rows, vocab = request.logits.shape
        ids, valid, seeds = _decode(reply.token_ids), _decode(reply.valid), _decode(reply.seeds)
        assert ids.shape == (rows,) and seeds.shape == (rows,) and ids.dtype == torch.int64
        assert bool(((ids >= -1) & (ids < vocab)).all()) and torch.equal(valid, ids >= 0)
        assert bool((seeds >= 0).all())
        # -1 exactly for the rows with a NaN or no finite logit (DESIGN.md); greedy is the arg-max.
        logits = _decode(request.logits).double()
        bad = torch.isnan(logits).any(1) | ~torch.isfinite(logits).any(1)
        assert torch.equal(valid, ~bad), f"valid {valid.tolist()} for rows with NaN / no finite logit {bad.tolist()}"
        greedy = (request.HasField("temperature") and request.temperature == 0 and not request.HasField("temperature_rows")
                  and not request.HasField("random_val") and not request.HasField("random_val_rows"))
        if greedy:
            assert torch.equal(ids, torch.where(bad, -1, logits.argmax(1))), "greedy: not the first arg-max"
    elif rpc == "RouteExperts":
        rows, _experts = request.gate_logits.shape
        w, i = _decode(reply.weights), _decode(reply.indices)
        assert w.shape == i.shape == (rows, request.k) and w.dtype == torch.float32 and i.dtype == torch.int32
        assert bool(((i >= 0) & (i < request.gate_logits.shape[1])).all())
    elif rpc in ("Softmax", "CausalSoftmax", "Silu"):
        x = _decode(request.x)
        if rpc == "Softmax":
            want = kernels.softmax(x, dim=request.dim if request.HasField("dim") else -1, backend="torch")
        elif rpc == "CausalSoftmax":
            want = kernels.causal_softmax(x, backend="torch")
        elif request.HasField("up"):
            want = kernels.swiglu(x, _decode(request.up), backend="torch")
        else:
            want = kernels.silu(x, backend="torch")
        _same(_decode(reply.out), want, rpc)
    elif rpc == "GetServerInfo":
        assert reply.limits.max_rows == MAX_ROWS and reply.backend == "torch"


# ---------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("rpc", sorted(REQUEST_STRATEGIES))
def test_structured_requests(channel, rpc):
    n = {"Sample": 1200, "Step": 600, "GetServerInfo": 3}.get(rpc, 500)

    @settings(max_examples=examples(n), **FUZZ)
    @given(request=REQUEST_STRATEGIES[rpc])
    def fuzz(request):
        code, raw, details = _raw_unary(channel, rpc, request.SerializeToString())
        _record("structured", rpc, code, details)
        if code == grpc.StatusCode.OK:
            _check_answer(rpc, request, raw)
        _canaries(channel)

    fuzz()


@settings(max_examples=examples(250), **FUZZ)
@given(steps=st.lists(step_requests(), min_size=1, max_size=3))
def test_stream_steps(channel, steps):
    code, replies, details = _raw_stream(channel, [s.SerializeToString() for s in steps])
    _record("stream", "StreamSteps", code, details)
    if code == grpc.StatusCode.OK:
        assert len(replies) == len(steps)
        for step, raw in zip(steps, replies):
            _check_answer("Step", step, raw)
    _canaries(channel)


@st.composite
def mangled(draw) -> bytes:
    """Bytes near a valid message: truncated, bit-flipped, spliced, concatenated, or plain garbage."""
    base = draw(st.one_of(*REQUEST_STRATEGIES.values())).SerializeToString()
    how = draw(st.sampled_from(["garbage", "truncate", "flip", "splice", "concat", "varint"]))
    if how == "garbage" or not base:
        return draw(st.binary(max_size=1024))
    if how == "truncate":
        return base[:draw(st.integers(0, len(base) - 1))]
    if how == "flip":
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if how == "splice":
        i = draw(st.integers(0, len(base)))
        return base[:i] + draw(st.binary(min_size=1, max_size=64)) + base[i:]
    if how == "concat":  # protobuf merges: repeated shapes grow, scalars are overwritten
        return base + draw(st.one_of(*REQUEST_STRATEGIES.values())).SerializeToString()
    # a field whose length prefix claims far more than follows
    return b"\x0a\xff\xff\xff\xff\x0f" + base


@settings(max_examples=examples(2000), **FUZZ)
@given(rpc=st.sampled_from(METHODS), payload=mangled(), more=st.lists(mangled(), max_size=2))
def test_raw_bytes(channel, rpc, payload, more):
    if rpc == "StreamSteps":
        code, _, details = _raw_stream(channel, [payload, *more])
    else:
        code, _, details = _raw_unary(channel, rpc, payload)
    _record("raw bytes", rpc, code, details)
    _canaries(channel)


# ------------------------------------------------------------- adversarial cases, spelled out


def _t(shape, dtype=pb.DTYPE_FLOAT32, data=None) -> pb.Tensor:
    n = math.prod(shape)
    return pb.Tensor(dtype=dtype, shape=shape, data=b"\x00" * (n * ITEMSIZE[dtype]) if data is None else data)


ADVERSARIAL = {
    # size limits: RESOURCE_EXHAUSTED before any work
    "message over --max-message-bytes": ("Softmax", pb.SoftmaxRequest(x=_t([80, 1000])), "RESOURCE_EXHAUSTED"),
    "rows over --max-rows": ("Sample", pb.SampleRequest(logits=_t([65, 2])), "RESOURCE_EXHAUSTED"),
    "row over --max-vocab": ("Softmax", pb.SoftmaxRequest(x=_t([1, 4097])), "RESOURCE_EXHAUSTED"),
    "broadcast answer over the message limit": (
        "Silu", pb.SiluRequest(x=_t([64, 1]), up=_t([1, 4096])), "RESOURCE_EXHAUSTED"),
    "experts' answer over the limit": ("RouteExperts", pb.RouteExpertsRequest(gate_logits=_t([64, 4096], pb.DTYPE_BFLOAT16),
                                                                              k=4096), "RESOURCE_EXHAUSTED"),
    # shapes whose element count overflows int64
    "shape product over 2**63": ("Softmax", pb.SoftmaxRequest(x=pb.Tensor(dtype=pb.DTYPE_FLOAT32,
                                                                          shape=[2**62, 2**62], data=b"")), "INVALID_ARGUMENT"),
    "int64 min dimension": ("Sample", pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-(2**63), 1])),
                            "INVALID_ARGUMENT"),
    # parameters the kernels see in float32
    "temperature 1e300": ("Sample", pb.SampleRequest(logits=_t([1, 4]), temperature=1e300), "INVALID_ARGUMENT"),
    "top_p 1e-300": ("Sample", pb.SampleRequest(logits=_t([1, 4]), top_p=1e-300), "INVALID_ARGUMENT"),
    "random_val 1 - 1e-12": ("Sample", pb.SampleRequest(logits=_t([1, 4]), random_val=1 - 1e-12), "INVALID_ARGUMENT"),
    "temperature 1e-300 (greedy)": ("Sample", pb.SampleRequest(logits=_t([1, 4]), temperature=1e-300), "OK"),
    "top_k int64 max": ("Sample", pb.SampleRequest(logits=_t([2, 4]), top_k=2**63 - 1, seed=2**63 - 1, step=2**63 - 1),
                        "OK"),
    "all -inf logits": ("Sample", pb.SampleRequest(logits=_t([1, 3], data=np.full(3, -np.inf, "<f4").tobytes())), "OK"),
    "softmax dim int64 min": ("Softmax", pb.SoftmaxRequest(x=_t([2, 2]), dim=-(2**63)), "INVALID_ARGUMENT"),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_case(channel, case):
    rpc, request, expected = ADVERSARIAL[case]
    code, raw, details = _raw_unary(channel, rpc, request.SerializeToString())
    _record("adversarial", rpc, code, details)
    assert code.name == expected, details
    if code == grpc.StatusCode.OK:
        _check_answer(rpc, request, raw)
    _canaries(channel)
