"""RouteExperts: ``kernels.topk_softmax`` on ``gate_logits [N, E]``, MoE routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.topk_softmax import MAX_EXPERTS
from logitserve.v1 import logitserve_pb2 as pb

from ..staging import Staging
from ..tensors import NOT_IN_PLACE, HostTensor, from_array, tensor_field
from .batching import split_rows
from .limits import Limits

ROUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(eq=False)
class RouteExpertsCall:
    """``kernels.topk_softmax`` on ``gate_logits [N, E]``."""

    gate_logits: HostTensor
    k: int
    renormalize: bool

    op = "route_experts"

    @classmethod
    def from_pb(cls, msg: pb.RouteExpertsRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "RouteExpertsCall":
        g = tensor_field(msg, "gate_logits", path, in_place, dtypes=ROUTE_DTYPES, ranks=(2,))
        limits.check(f"{path}gate_logits", g.shape[0], g.shape[1])
        experts = g.shape[1]
        if experts > MAX_EXPERTS:
            raise ValueError(f"{path}gate_logits.shape: at most {MAX_EXPERTS} experts, got E = {experts}")
        if not 1 <= msg.k <= experts:
            raise ValueError(f"{path}k: must be in [1, E] with E = {experts} experts (gate_logits.shape[1]), "
                             f"got {msg.k}")
        limits.check_output(f"{path}gate_logits", (g.shape[0], msg.k), 8)  # float32 weights + int32 indices
        return cls(g, msg.k, msg.renormalize)

    @property
    def rows(self) -> int:
        return self.gate_logits.shape[0]

    @property
    def key(self):
        return (self.op, self.gate_logits.dtype, self.gate_logits.shape[1], self.k, self.renormalize)

    @staticmethod
    async def run_batch(calls: list["RouteExpertsCall"], handle) -> list["RouteExpertsResult"]:
        rows = [c.rows for c in calls]
        k, renormalize = calls[0].k, calls[0].renormalize

        def stage_for(batch_rows: int) -> Staging:
            stage = Staging()
            stage.add([c.gate_logits for c in calls], rows=batch_rows)
            return stage

        def launch(gate_logits):
            return kernels.topk_softmax(gate_logits, k, renormalize=renormalize, backend=handle.backend)

        weights, indices = await handle.launch(calls[0].key, sum(rows), stage_for, launch)
        return [RouteExpertsResult(w, i) for w, i in zip(split_rows(weights, rows), split_rows(indices, rows))]


@dataclass
class RouteExpertsResult:
    weights: np.ndarray
    indices: np.ndarray

    def to_pb(self) -> pb.RouteExpertsResponse:
        return pb.RouteExpertsResponse(weights=from_array(self.weights), indices=from_array(self.indices))
