"""A short mixed load against a server process, every answer checked: test_faults' load run.

Clients (each an :class:`~logitserve.client.AsyncClient` plus a raw channel, on one asyncio
loop) send a random mix of every RPC for a few seconds (Sample seeded, unseeded, per-row,
greedy, ``random_val``, with NaN rows; RouteExperts; Softmax on any axis; CausalSoftmax; Silu and
SwiGLU; Step; StreamSteps; GetServerInfo; grpc.health Check) in float32, bfloat16 and float16,
about one request in six invalid. Each answer is checked against the kernels called here on the
same inputs and seeds (``backend="torch"``); each invalid request must get its status code. Then
:func:`queue_probe` fills a slow server's queue and times the RESOURCE_EXHAUSTED answers.

``tests/load_run.py`` drives it (test_faults' short run, and ``python -m bench.load``'s soak).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Awaitable, Callable

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logitserve import kernels
from logitserve.client import AsyncClient
from logitserve.client.codec import encode
from logitserve.v1 import logitserve_pb2 as pb

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
SERVICE = "/logitserve.v1.LogitServe/"
MAX_ROWS = 64  # the load server's --max-rows: the "too many rows" requests go over it
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# rtol, atol per dtype: a few ulps, since batching may move a row into a vectorised loop's tail.
TOLERANCE = {torch.float32: (4e-6, 1e-7), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-6),
             torch.float64: (1e-12, 1e-15)}


@dataclasses.dataclass
class Case:
    """One request of the mix: how to send it and how to judge the outcome."""

    rpc: str
    name: str
    send: Callable[["Worker"], Awaitable[Any]]
    check: Callable[[Any], str | None] = lambda result: None  # None: right; else what is wrong
    expect: grpc.StatusCode = OK


class Worker:
    """One client: the library's AsyncClient and a raw channel (invalid bytes, health)."""

    def __init__(self, target: str, timeout: float):
        self.client = AsyncClient(target, timeout=timeout, retries=0)
        self.channel = grpc.aio.insecure_channel(target)
        self.timeout = timeout
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def raw(self, rpc: str, data: bytes) -> bytes:
        method = self.channel.unary_unary(SERVICE + rpc, request_serializer=None, response_deserializer=None)
        return await method(data, timeout=self.timeout)

    async def close(self) -> None:
        await self.client.close()
        await self.channel.close()


# ------------------------------------------------------------------------------------ checks


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def close_enough(got: np.ndarray, want: torch.Tensor, what: str) -> str | None:
    rtol, atol = TOLERANCE[want.dtype]
    want = _np(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, expected {want.shape}"
    if not np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        bad = int(np.sum(~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)))
        return f"{what}: {bad} of {want.size} values off (max abs diff {np.nanmax(np.abs(got - want)):.3g})"
    return None


def _equal(got: np.ndarray, want: torch.Tensor, what: str) -> str | None:
    want = want.numpy()
    if got.shape != want.shape or not np.array_equal(got, want):
        return f"{what}: {got.tolist()} != expected {want.tolist()}"
    return None


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


# ------------------------------------------------------------------------------- valid cases


def _logits(rng: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=rng) * 3).to(dtype)


def _sample_case(rng: torch.Generator, r: random.Random) -> Case:
    rows, vocab, dtype = r.randint(1, 4), r.choice((37, 1000, 4096)), r.choice(DTYPES)
    logits = _logits(rng, rows, vocab, dtype)
    flavour = r.choice(("scalar", "per-row", "greedy", "random_val", "nan row", "unseeded"))
    kw: dict[str, Any] = dict(seed=r.randrange(2**63), step=r.randrange(1000))
    if flavour == "scalar":
        kw.update(temperature=r.choice((0.7, 1.0, 1.3)), top_k=r.choice((0, 5, 50)), top_p=r.choice((0.8, 1.0)),
                  min_p=r.choice((0.0, 0.05)), filter_order=r.choice(("top_k_first", "joint")))
    elif flavour in ("per-row", "nan row", "unseeded"):
        kw.update(temperature=torch.tensor([r.choice((0.0, 0.6, 1.0, 1.5)) for _ in range(rows)], dtype=torch.float64),
                  top_k=torch.tensor([r.choice((0, 1, 10, 100)) for _ in range(rows)]),
                  top_p=torch.tensor([r.choice((0.5, 0.9, 1.0)) for _ in range(rows)], dtype=torch.float64),
                  min_p=torch.tensor([r.choice((0.0, 0.1)) for _ in range(rows)], dtype=torch.float64),
                  seed=torch.tensor([r.randrange(2**63) for _ in range(rows)]),
                  step=torch.tensor([r.randrange(1000) for _ in range(rows)]))
        if flavour == "nan row":
            logits[r.randrange(rows), r.randrange(vocab)] = float("nan")
    elif flavour == "greedy":
        kw.update(temperature=0.0)
    else:
        kw.update(random_val=torch.rand(rows, generator=rng, dtype=torch.float64) * 0.999,
                  temperature=r.choice((0.5, 1.0)), top_k=r.choice((0, 20)), top_p=r.choice((0.7, 1.0)))
    if flavour == "unseeded":
        del kw["seed"]
        sent = dict(kw)

        def check(result) -> str | None:  # replay the row with the seeds the server drew
            want = kernels.sample(logits, **{**sent, "seed": torch.from_numpy(result.seeds.copy())}, backend="torch")
            return _first(_equal(result.token_ids, want, "token_ids"),
                          _equal(result.valid, want >= 0, "valid"))
    else:
        want = kernels.sample(logits, **kw, backend="torch")

        def check(result) -> str | None:
            seeds = kw["seed"] if isinstance(kw.get("seed"), torch.Tensor) else None
            return _first(_equal(result.token_ids, want, "token_ids"), _equal(result.valid, want >= 0, "valid"),
                          None if seeds is None else _equal(result.seeds, seeds, "seeds"))
    return Case("Sample", f"sample {flavour}", lambda w: w.client.sample(logits, **kw), check)


def _route_case(rng: torch.Generator, r: random.Random) -> Case:
    experts = r.choice((8, 64, 128, 256))
    k, renorm = r.randint(1, min(8, experts)), r.random() < 0.5
    g = _logits(rng, r.randint(1, 16), experts, r.choice(DTYPES))
    weights, indices = kernels.topk_softmax(g, k, renormalize=renorm, backend="torch")

    def check(result) -> str | None:
        return _first(_equal(result[1], indices, "indices"), close_enough(result[0], weights, "weights"))
    return Case("RouteExperts", "route_experts", lambda w: w.client.route_experts(g, k, renorm), check)


def _tensor_case(rng: torch.Generator, r: random.Random) -> Case:
    dtype = r.choice(DTYPES)
    op = r.choice(("softmax", "causal_softmax", "silu", "swiglu"))
    if op == "softmax":
        last = r.random() < 0.6  # wide rows along the last axis; any axis of a small tensor
        x = _logits(rng, r.randint(1, 6), r.choice((5, 300, 2048) if last else (5, 17, 60)), dtype)
        if r.random() < 0.3:
            x = x.reshape(1, *x.shape)
        dim = -1 if last else r.randrange(-x.ndim, x.ndim)
        want = kernels.softmax(x, dim=dim, backend="torch")
        return Case("Softmax", "softmax", lambda w: w.client.softmax(x, dim=dim), lambda got: close_enough(got, want, "out"))
    if op == "causal_softmax":
        s = r.randint(1, 8)
        x = _logits(rng, s, s + r.randint(0, 8), dtype)
        if r.random() < 0.5:
            x = torch.stack([x, x * 0.5])
        want = kernels.causal_softmax(x, backend="torch")
        return Case("CausalSoftmax", "causal_softmax", lambda w: w.client.causal_softmax(x),
                    lambda got: close_enough(got, want, "out"))
    x = _logits(rng, r.randint(1, 8), r.choice((16, 1000)), dtype)
    if op == "silu":
        want = kernels.silu(x, backend="torch")
        return Case("Silu", "silu", lambda w: w.client.silu(x), lambda got: close_enough(got, want, "out"))
    up = _logits(rng, 1, x.shape[1], dtype) if r.random() < 0.5 else _logits(rng, *x.shape, dtype)
    want = kernels.swiglu(x, up, backend="torch")
    return Case("Silu", "swiglu", lambda w: w.client.swiglu(x, up), lambda got: close_enough(got, want, "out"))


def _step_kwargs(rng: torch.Generator, r: random.Random):
    """Arguments of one Step (a seeded sample, a routing, a softmax) and a check of its answer."""
    logits = _logits(rng, r.randint(1, 3), 500, torch.float32)
    seed, temperature, top_p = r.randrange(2**63), r.choice((0.0, 0.8)), r.choice((0.9, 1.0))
    g = _logits(rng, r.randint(1, 8), 64, torch.bfloat16)
    x = _logits(rng, 2, 33, torch.float16)
    want_tokens = kernels.sample(logits, temperature=temperature, top_p=top_p, seed=seed, backend="torch")
    want_w, want_i = kernels.topk_softmax(g, 6, renormalize=True, backend="torch")
    want_x = kernels.softmax(x, backend="torch")
    kwargs = dict(sample=dict(logits=logits, temperature=temperature, top_p=top_p, seed=seed),
                  route_experts=dict(gate_logits=g, k=6, renormalize=True), softmax=dict(x=x))

    def check(result) -> str | None:
        return _first(_equal(result.sample.token_ids, want_tokens, "step.sample.token_ids"),
                      _equal(result.route_experts[1], want_i, "step.route_experts.indices"),
                      close_enough(result.route_experts[0], want_w, "step.route_experts.weights"),
                      close_enough(result.softmax, want_x, "step.softmax"))
    return kwargs, check


def _step_case(rng: torch.Generator, r: random.Random) -> Case:
    kwargs, check = _step_kwargs(rng, r)
    return Case("Step", "step", lambda w: w.client.step(id="s", **kwargs), check)


def _stream_case(rng: torch.Generator, r: random.Random) -> Case:
    steps = [_step_kwargs(rng, r) for _ in range(3)]

    async def send(w: Worker):
        return [res async for res in w.client.stream_steps([dict(id=str(i), **kw) for i, (kw, _) in enumerate(steps)])]

    def check(results) -> str | None:
        if [res.id for res in results] != ["0", "1", "2"]:
            return f"stream ids {[res.id for res in results]}"
        return _first(*(c(res) for (_, c), res in zip(steps, results)))
    return Case("StreamSteps", "stream_steps", send, check)


def _info_case() -> Case:
    def check(info) -> str | None:
        return None if info.version and info.limits["max_rows"] == MAX_ROWS else f"server_info {info}"
    return Case("GetServerInfo", "server_info", lambda w: w.client.server_info(), check)


def _health_case() -> Case:
    async def send(w: Worker):
        return await w.health.Check(health_pb2.HealthCheckRequest(), timeout=w.timeout)

    def check(reply) -> str | None:
        return None if reply.status == health_pb2.HealthCheckResponse.SERVING else f"health {reply.status}"
    return Case("Health", "health", send, check)


# ----------------------------------------------------------------------------- invalid cases


def invalid_cases() -> list[Case]:
    x = torch.randn(2, 10)
    short = encode(x.numpy())
    short.data = short.data[:-4]
    unknown_dtype = encode(x.numpy())
    unknown_dtype.dtype = 99
    too_many_rows = torch.randn(MAX_ROWS + 1, 4)
    return [
        Case("Softmax", "data shorter than shape", lambda w: w.raw("Softmax", pb.SoftmaxRequest(
            x=short).SerializeToString()), expect=INVALID),
        Case("Sample", "unknown dtype", lambda w: w.raw("Sample", pb.SampleRequest(
            logits=unknown_dtype).SerializeToString()), expect=INVALID),
        Case("Sample", "top_p 0", lambda w: w.client.sample(x, top_p=0.0), expect=INVALID),
        Case("RouteExperts", "k > E", lambda w: w.client.route_experts(x, 11), expect=INVALID),
        Case("Softmax", "rows over --max-rows", lambda w: w.client.softmax(too_many_rows), expect=EXHAUSTED),
        Case("Step", "garbage bytes", lambda w: w.raw("Step", b"\xff\x00garbage"), expect=INVALID),
        Case("CausalSoftmax", "T < S", lambda w: w.client.causal_softmax(torch.randn(4, 3)), expect=INVALID),
    ]


def build_pool(seed: int = 0, size: int = 96) -> list[Case]:
    """``size`` valid requests (with their reference answers), then GetServerInfo and Health."""
    rng = torch.Generator().manual_seed(seed)
    r = random.Random(seed)
    makers = [_sample_case] * 3 + [_route_case] * 2 + [_tensor_case] * 3 + [_step_case, _stream_case]
    pool = [makers[i % len(makers)](rng, r) for i in range(size)]
    return pool + [_info_case(), _health_case()] * 3
