"""Answers read into Python results, shared by Client and AsyncClient: the ``*_result``
functions return arrays (views of the answer's bytes where they can) and, for each output the
server wrote into a region, the ``out=`` argument itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import wire
from .codec import decode, dtype_name
from .errors import LogitServeError
from .messages import ROUTE_OUTPUTS, SAMPLE_LOGPROBS, SAMPLE_OUTPUTS, VERIFY_OUTPUTS


@dataclass(frozen=True)
class SampleResult:
    """Sample's answer, per row: the token (-1 where the row had a NaN or no finite logit), the
    seed used (give it back as ``seed=`` to replay the row) and whether a token was produced."""

    token_ids: np.ndarray  # int64 [B]
    seeds: np.ndarray  # int64 [B]
    valid: np.ndarray  # bool [B]
    # With logprobs=n: the chosen token's log-probability float32 [B] (NaN where invalid) and rank
    # int64 [B] (1 = most probable), the top-n token ids int64 [B, n] and logprobs float32 [B, n].
    token_logprobs: np.ndarray | None = None
    token_ranks: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # With return_kept: int32 [B, ceil(V / 32)], bit t % 32 of word t // 32 set where token t
    # survived the filters.
    kept_bitmask: np.ndarray | None = None


@dataclass(frozen=True)
class VerifyDraftResult:
    """VerifyDraft's answer, per row: the accepted draft tokens, then the correction (or bonus)
    token, then -1 (all -1 where the row is not valid); how many draft tokens were accepted; whether
    the row was verified; the seed used (give it back as ``seed=`` to replay the row)."""

    token_ids: np.ndarray  # int64 [B, n + 1]
    num_accepted: np.ndarray  # int64 [B]
    valid: np.ndarray  # bool [B]
    seeds: np.ndarray  # int64 [B]


@dataclass(frozen=True)
class StepResult:
    """Step's answers: each field is set where the step asked for that operator."""

    id: str
    sample: SampleResult | None = None
    route_experts: tuple[np.ndarray, np.ndarray] | None = None  # (weights, indices)
    softmax: np.ndarray | None = None
    causal_softmax: np.ndarray | None = None
    silu: np.ndarray | None = None  # silu(x), where the step asked silu=
    swiglu: np.ndarray | None = None  # silu(gate) * up, where the step asked swiglu=


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
    # A server started with --devices: every device's process, {device: address}, in device order,
    # as the server wrote it (client/devices.py reads 0.0.0.0 or [::] as the host dialled).
    device_endpoints: dict[str, str] = field(default_factory=dict)




Views = Mapping[wire.Path, memoryview]
_NONE: dict = {}


def _tensor(msg: pb.Tensor, path: wire.Path, views: Views, outputs: Mapping[wire.Path, Any]):
    """An answer's tensor: the caller's ``out=`` object where the server wrote it into a region,
    else a numpy array decoded from its bytes (``views[path]`` when read apart)."""
    given = outputs.get(path)
    if given is not None:
        if not msg.HasField("region"):
            raise LogitServeError(grpc.StatusCode.UNIMPLEMENTED,
                                  f"{'.'.join(path)}: asked for in a region, but the server answered bytes "
                                  f"(a server without output regions?)")
        return given
    return decode(msg, ".".join(path), views.get(path))


def sample_result(msg: pb.SampleResponse, views: Views = _NONE, outputs=_NONE, path: wire.Path = ()) -> SampleResult:
    logprobs = {name: _tensor(getattr(msg, name), (*path, name), views, outputs) for name in SAMPLE_LOGPROBS
                if msg.HasField(name)}
    return SampleResult(*(_tensor(getattr(msg, name), (*path, name), views, outputs) for name in SAMPLE_OUTPUTS),
                        **logprobs)


def route_experts_result(msg: pb.RouteExpertsResponse, views: Views = _NONE, outputs=_NONE,
                         path: wire.Path = ()) -> tuple[np.ndarray, np.ndarray]:
    return tuple(_tensor(getattr(msg, name), (*path, name), views, outputs) for name in ROUTE_OUTPUTS)


def verify_draft_result(msg: pb.VerifyDraftResponse, views: Views = _NONE, outputs=_NONE,
                        path: wire.Path = ()) -> VerifyDraftResult:
    return VerifyDraftResult(*(_tensor(getattr(msg, name), (*path, name), views, outputs) for name in VERIFY_OUTPUTS))


def tensor_result(msg, views: Views = _NONE, outputs=_NONE, path: wire.Path = ()) -> np.ndarray:
    return _tensor(msg.out, (*path, "out"), views, outputs)


def step_result(msg: pb.StepResponse, views: Views = _NONE, outputs=_NONE, swiglu: bool = False) -> StepResult:
    """``swiglu``: the step asked ``swiglu=``, whose answer shares the ``silu`` slot on the wire
    and is read as ``.swiglu``."""
    def part(name, read, slot=None):
        slot = slot or name
        return read(getattr(msg, slot), views, outputs, (slot,)) if msg.HasField(slot) else None

    return StepResult(
        id=msg.id,
        sample=part("sample", sample_result),
        route_experts=part("route_experts", route_experts_result),
        softmax=part("softmax", tensor_result),
        causal_softmax=part("causal_softmax", tensor_result),
        **{"swiglu" if swiglu else "silu": part("silu", tensor_result)},
    )


def step_read(request: pb.StepRequest):
    """:func:`step_result` for the answer to ``request``: its silu slot read as ``.swiglu``
    where the request gave SwiGLU's ``up``."""
    swiglu = request.HasField("silu") and request.silu.HasField("up")
    return lambda msg, views=_NONE, outputs=_NONE: step_result(msg, views, outputs, swiglu)


def reader(response_type, read, outputs=_NONE):
    """``raw answer bytes -> result``: the tensors' bytes read where they arrived
    (:func:`.wire.split`), ``outputs`` (an Encoder's) returned for those written into regions."""

    def parse(raw: bytes):
        msg, views = wire.split(raw, response_type)
        return read(msg, views, outputs)

    return parse


def server_info(msg: pb.GetServerInfoResponse) -> ServerInfo:
    def fields(m) -> dict[str, int]:
        return {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}

    return ServerInfo(
        version=msg.version, device=msg.device, device_name=msg.device_name, backend=msg.backend,
        dtypes=tuple(dtype_name(d) for d in msg.dtypes), warmed_dtypes=tuple(dtype_name(d) for d in msg.warmed_dtypes),
        limits=fields(msg.limits), stats=fields(msg.stats),
        device_endpoints={e.device: e.address for e in msg.device_endpoints})
