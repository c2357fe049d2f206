"""The fuzzer's request strategies (hypothesis): tensors of every dtype and of unknown enum
values, adversarial shapes and data lengths, special float values, sampling parameters at and
beyond their limits, and each RPC's request (test_fuzz.py drives them against a server).

``legal=True`` draws requests the server must answer OK (within test_fuzz's limits), ``False``
ones it must refuse, ``None`` either.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from logitserve.v1 import logitserve_pb2 as pb

MAX_ROWS, MAX_VOCAB, MAX_MESSAGE = 64, 4096, 256 * 1024  # test_fuzz's server limits
ITEMSIZE = {pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2, pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT64: 8,
            pb.DTYPE_INT32: 4, pb.DTYPE_INT64: 8, pb.DTYPE_BOOL: 1}
FLOAT_WIRE = (pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64)


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
def verify_requests(draw, legal: bool | None = None) -> pb.VerifyDraftRequest:
    legal = draw(st.booleans()) if legal is None else legal
    fields = ("draft_token_ids", "target_logits", "draft", "temperature", "top_p", "min_p", "top_k", "seed", "step",
              "draft_temperature", "filter_order")
    wild = set() if legal else draw(st.sets(st.sampled_from(fields), min_size=1, max_size=2))
    rows, n, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 7, 64, 1000]))
    ids = np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=rows * n, max_size=rows * n)), dtype=np.int64)
    if "draft_token_ids" in wild and draw(st.booleans()):
        ids[draw(st.integers(0, rows * n - 1))] = draw(st.sampled_from([-1, vocab, 2**40, -(2**63)]))
    wire = draw(st.sampled_from([pb.DTYPE_INT32, pb.DTYPE_INT64]))
    msg = pb.VerifyDraftRequest(draft_token_ids=pb.Tensor(dtype=wire, shape=[rows, n], data=ids.astype(
        "<i4" if wire == pb.DTYPE_INT32 else "<i8").tobytes()))
    if "draft_token_ids" in wild and draw(st.booleans()):
        msg.draft_token_ids.CopyFrom(draw(tensors()))
    for name, shape in (("target_logits", [rows, n + 1, vocab]), ("draft", [rows, n, vocab])):
        tensor = draw(st.one_of(good_tensors(shape), tensors()) if name in wild else good_tensors(shape))
        field = name if name != "draft" else draw(st.sampled_from(["draft_probs", "draft_logits"]))
        getattr(msg, field).CopyFrom(tensor)
    for name in ("temperature", "top_p", "min_p", "top_k", "seed", "step", "draft_temperature"):
        if name == "draft_temperature" and not msg.HasField("draft_logits") and name not in wild:
            continue
        choice = draw(st.sampled_from(["scalar", "rows"] if name in wild else ["unset", "scalar", "rows"]))
        legal_values = LEGAL["temperature" if name == "draft_temperature" else name]
        if choice == "scalar":
            floating = name in FLOAT_PARAMS or name == "draft_temperature"
            setattr(msg, name, draw((doubles if floating else int64s) if name in wild else legal_values))
        elif choice == "rows":
            rows_of = per_row(rows, "temperature" if name == "draft_temperature" else name, name not in wild)
            getattr(msg, f"{name}_rows").CopyFrom(draw(rows_of))
    msg.filter_order = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(-(2**31), 2**31 - 1))
                            if "filter_order" in wild else st.sampled_from([0, 1, 2]))
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
    "GetServerInfo": st.just(pb.GetServerInfoRequest()), "VerifyDraft": verify_requests(),
}
