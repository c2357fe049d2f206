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

from fuzz_requests import ITEMSIZE, MAX_MESSAGE, MAX_ROWS, MAX_VOCAB, REQUEST_STRATEGIES, step_requests

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
SERVICE = "/logitserve.v1.LogitServe/"
TIMEOUT_S = 30.0
SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1.0"))
RESPONSES = {"Sample": pb.SampleResponse, "RouteExperts": pb.RouteExpertsResponse, "Softmax": pb.SoftmaxResponse,
             "CausalSoftmax": pb.CausalSoftmaxResponse, "Silu": pb.SiluResponse, "Step": pb.StepResponse,
             "GetServerInfo": pb.GetServerInfoResponse, "VerifyDraft": pb.VerifyDraftResponse}
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
    elif rpc == "VerifyDraft":
        _check_verify(request, reply)
    elif rpc == "GetServerInfo":
        assert reply.limits.max_rows == MAX_ROWS and reply.backend == "torch"


def _check_verify(request, reply) -> None:
    """The accepted prefix is the draft's, then one token in the vocabulary, then -1; invalid rows
    (a target position with a NaN or no finite logit; from logits, such a draft position) all -1."""
    ids, target = _decode(request.draft_token_ids), _decode(request.target_logits).double()
    tokens, accepted, valid = _decode(reply.token_ids), _decode(reply.num_accepted), _decode(reply.valid)
    rows, n = ids.shape
    assert tokens.shape == (rows, n + 1) and tokens.dtype == torch.int64 and accepted.shape == valid.shape == (rows,)
    bad = (torch.isnan(target) | ~torch.isfinite(target).any(-1, keepdim=True)).flatten(1).any(1)
    if request.HasField("draft_logits"):
        draft = _decode(request.draft_logits).double()
        bad |= (torch.isnan(draft) | ~torch.isfinite(draft).any(-1, keepdim=True)).flatten(1).any(1)
    assert torch.equal(valid, ~bad), f"valid {valid.tolist()} for rows with NaN / no finite logit {bad.tolist()}"
    for b in range(rows):
        a = int(accepted[b])
        if not valid[b]:
            assert a == 0 and bool((tokens[b] == -1).all())
            continue
        assert 0 <= a <= n and torch.equal(tokens[b, :a], ids[b, :a].long()), (a, tokens[b].tolist())
        assert 0 <= int(tokens[b, a]) < target.shape[2] and bool((tokens[b, a + 1:] == -1).all())


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
