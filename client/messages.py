"""Requests from Python arguments, results from responses: shared by Client and AsyncClient."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from .codec import decode, dtype_name, encode, is_torch

FILTER_ORDERS = {"top_k_first": pb.FILTER_ORDER_TOP_K_FIRST, "joint": pb.FILTER_ORDER_JOINT}
STEP_OPS = ("sample", "route_experts", "softmax", "causal_softmax", "silu", "swiglu")


@dataclass(frozen=True)
class SampleResult:
    """Sample's answer, per row: the token (-1 where the row had a NaN or no finite logit), the
    seed used (give it back as ``seed=`` to replay the row) and whether a token was produced."""

    token_ids: np.ndarray  # int64 [B]
    seeds: np.ndarray  # int64 [B]
    valid: np.ndarray  # bool [B]


@dataclass(frozen=True)
class StepResult:
    """Step's answers: each field is set where the step asked for that operator."""

    id: str
    sample: SampleResult | None = None
    route_experts: tuple[np.ndarray, np.ndarray] | None = None  # (weights, indices)
    softmax: np.ndarray | None = None
    causal_softmax: np.ndarray | None = None
    silu: np.ndarray | None = None  # silu(x), or swiglu(gate, up)


@dataclass(frozen=True)
class ServerInfo:
    """What the server runs on and accepts."""

    version: str
    device: str
    device_name: str
    backend: str
    dtypes: tuple[str, ...]
    warmed_dtypes: tuple[str, ...]
    limits: dict[str, int]
    stats: dict[str, int]


# ------------------------------------------------------------------------------------ requests


def _is_scalar(value) -> bool:
    if isinstance(value, (numbers.Number, np.generic)):
        return True
    if is_torch(value) or isinstance(value, np.ndarray):
        return value.ndim == 0
    return False


def _set_param(msg, name: str, value, *, floating: bool) -> None:
    """A sampling parameter: scalar field ``name``, or per-row Tensor ``name + "_rows"``."""
    if value is None:
        return
    if _is_scalar(value):
        setattr(msg, name, float(value) if floating else int(value))
        return
    if is_torch(value):
        if floating and not value.is_floating_point():
            value = value.double()
    else:
        value = np.asarray(value)
        if floating and value.dtype.kind in "biu":
            value = value.astype(np.float64)
    getattr(msg, f"{name}_rows").CopyFrom(encode(value, f"{name}"))


def sample_request(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
                   filter_order="top_k_first", random_val=None) -> pb.SampleRequest:
    if filter_order not in FILTER_ORDERS:
        raise ValueError(f"filter_order: must be one of {', '.join(FILTER_ORDERS)}, got {filter_order!r}")
    msg = pb.SampleRequest(logits=encode(logits, "logits"), filter_order=FILTER_ORDERS[filter_order])
    for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                        ("random_val", random_val)):
        _set_param(msg, name, value, floating=True)
    for name, value in (("top_k", top_k), ("seed", seed), ("step", step)):
        _set_param(msg, name, value, floating=False)
    return msg


def route_experts_request(gate_logits, k: int, renormalize: bool = False) -> pb.RouteExpertsRequest:
    return pb.RouteExpertsRequest(gate_logits=encode(gate_logits, "gate_logits"), k=int(k), renormalize=renormalize)


def softmax_request(x, dim: int = -1) -> pb.SoftmaxRequest:
    return pb.SoftmaxRequest(x=encode(x, "x"), dim=int(dim))


def causal_softmax_request(x) -> pb.CausalSoftmaxRequest:
    return pb.CausalSoftmaxRequest(x=encode(x, "x"))


def silu_request(x) -> pb.SiluRequest:
    return pb.SiluRequest(x=encode(x, "x"))


def swiglu_request(gate, up) -> pb.SiluRequest:
    return pb.SiluRequest(x=encode(gate, "gate"), up=encode(up, "up"))


_BUILDERS = {
    "sample": sample_request,
    "route_experts": route_experts_request,
    "softmax": softmax_request,
    "causal_softmax": causal_softmax_request,
    "silu": silu_request,
    "swiglu": swiglu_request,
}


def step_request(id: str = "", **ops: Mapping[str, Any] | None) -> pb.StepRequest:
    """A StepRequest from keyword arguments per operator, e.g.
    ``step_request(sample={"logits": x, "temperature": 0.7}, route_experts={"gate_logits": g, "k": 2})``.

    ``swiglu={"gate": g, "up": u}`` fills the step's ``silu`` slot (a step holds one of the two).
    """
    unknown = set(ops) - set(STEP_OPS)
    if unknown:
        raise TypeError(f"step: unknown operator(s) {sorted(unknown)}; use {', '.join(STEP_OPS)}")
    if ops.get("silu") is not None and ops.get("swiglu") is not None:
        raise ValueError("step: give silu or swiglu, not both (they share the step's silu slot)")
    msg = pb.StepRequest(id=id)
    for name, kwargs in ops.items():
        if kwargs is None:
            continue
        slot = "silu" if name == "swiglu" else name
        built = kwargs if not isinstance(kwargs, Mapping) else _BUILDERS[name](**kwargs)
        getattr(msg, slot).CopyFrom(built)
    return msg


def as_step_request(step) -> pb.StepRequest:
    """A StepRequest from a StepRequest or a dict of :func:`step_request`'s arguments."""
    return step if isinstance(step, pb.StepRequest) else step_request(**step)


# ------------------------------------------------------------------------------------- results


def sample_result(msg: pb.SampleResponse) -> SampleResult:
    return SampleResult(decode(msg.token_ids, "token_ids"), decode(msg.seeds, "seeds"), decode(msg.valid, "valid"))


def route_experts_result(msg: pb.RouteExpertsResponse) -> tuple[np.ndarray, np.ndarray]:
    return decode(msg.weights, "weights"), decode(msg.indices, "indices")


def tensor_result(msg) -> np.ndarray:
    return decode(msg.out, "out")


def step_result(msg: pb.StepResponse) -> StepResult:
    has = msg.HasField
    return StepResult(
        id=msg.id,
        sample=sample_result(msg.sample) if has("sample") else None,
        route_experts=route_experts_result(msg.route_experts) if has("route_experts") else None,
        softmax=tensor_result(msg.softmax) if has("softmax") else None,
        causal_softmax=tensor_result(msg.causal_softmax) if has("causal_softmax") else None,
        silu=tensor_result(msg.silu) if has("silu") else None,
    )


def server_info(msg: pb.GetServerInfoResponse) -> ServerInfo:
    def fields(m) -> dict[str, int]:
        return {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}

    return ServerInfo(
        version=msg.version, device=msg.device, device_name=msg.device_name, backend=msg.backend,
        dtypes=tuple(dtype_name(d) for d in msg.dtypes), warmed_dtypes=tuple(dtype_name(d) for d in msg.warmed_dtypes),
        limits=fields(msg.limits), stats=fields(msg.stats))
