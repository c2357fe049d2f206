"""RouteExperts: ``kernels.topk_softmax`` on ``gate_logits [N, E]``, MoE routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.topk_softmax import MAX_EXPERTS
from logitserve.v1 import logitserve_pb2 as pb

from ..staging import Staging, to_host
from ..tensors import NOT_IN_PLACE, HostTensor, from_array, tensor_field
from .batching import split, split_rows
from .limits import Limits, answer_bytes
from .resident import Outputs, device_inputs, launches_in_place, launches_together

ROUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(eq=False)
class RouteExpertsCall:
    """``kernels.topk_softmax`` on ``gate_logits [N, E]``."""

    gate_logits: HostTensor
    k: int
    renormalize: bool
    # The outputs to write into regions (output_regions), and the call's leases (server/regions/calls.py).
    outputs: Outputs | None = None
    regions: object = None
    answer_size: int = 0  # the answer's message size (limits.answer_bytes)

    op = "route_experts"

    @classmethod
    def from_pb(cls, msg: pb.RouteExpertsRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None) -> "RouteExpertsCall":
        g = tensor_field(msg, "gate_logits", path, in_place, dtypes=ROUTE_DTYPES, ranks=(2,), regions=regions)
        limits.check(f"{path}gate_logits", g.shape[0], g.shape[1])
        experts = g.shape[1]
        if experts > MAX_EXPERTS:
            raise ValueError(f"{path}gate_logits.shape: at most {MAX_EXPERTS} experts, got E = {experts}")
        if not 1 <= msg.k <= experts:
            raise ValueError(f"{path}k: must be in [1, E] with E = {experts} experts (gate_logits.shape[1]), "
                             f"got {msg.k}")
        shape = (g.shape[0], msg.k)
        shapes = {"weights": (torch.float32, shape), "indices": (torch.int32, shape)}
        outputs = Outputs.of(msg, "RouteExperts", regions, path, shapes)
        size = answer_bytes(pb.RouteExpertsResponse, shapes, outputs)
        limits.check_answer(f"{path}gate_logits", size)
        return cls(g, msg.k, msg.renormalize, outputs, regions, size)

    @property
    def inputs(self) -> tuple:
        return (self.gate_logits,)

    @property
    def rows(self) -> int:
        return self.gate_logits.shape[0]

    @property
    def key(self):
        return (self.op, self.gate_logits.dtype, self.gate_logits.shape[1], self.k, self.renormalize)

    @staticmethod
    async def run_batch(calls: list["RouteExpertsCall"], handle) -> list["RouteExpertsResult"]:
        if launches_in_place(calls, handle.device):
            done = await handle.run(_launch_in_place, calls, handle)
            return [RouteExpertsResult(None if w is None else w.numpy(), None if i is None else i.numpy(), c.outputs,
                                       written=True) for w, i, c in done]
        rows = [c.rows for c in calls]
        k, renormalize = calls[0].k, calls[0].renormalize

        def stage_for(batch_rows: int) -> Staging:
            stage = Staging()
            stage.add([c.gate_logits for c in calls], rows=batch_rows)
            return stage

        def launch(gate_logits):
            return kernels.topk_softmax(gate_logits, k, renormalize=renormalize, backend=handle.backend)

        weights, indices = await handle.launch(calls[0].key, sum(rows), stage_for, launch)
        return [RouteExpertsResult(w, i, c.outputs)
                for w, i, c in zip(split_rows(weights, rows), split_rows(indices, rows), calls)]


def _launch_in_place(calls: list[RouteExpertsCall], handle) -> list[tuple]:
    """On the launch thread: ``calls`` launched on their gate logits where they are
    (server/ops/resident.py), together or one by one; each call's outputs put into its regions,
    the others brought to the host: ``(weights, indices, call)``, None for an output in a region."""
    k, renormalize = calls[0].k, calls[0].renormalize
    groups = [calls] if launches_together(calls, handle) else [[c] for c in calls]
    done = []
    for group in groups:
        gate_logits, = device_inputs(handle, [c.gate_logits for c in group])
        weights, indices = kernels.topk_softmax(gate_logits, k, renormalize=renormalize, backend=handle.backend)
        rows = [c.rows for c in group]
        for w, i, c in zip(split(weights, rows), split(indices, rows), group):
            outs = []
            for name, value in (("weights", w), ("indices", i)):
                if c.outputs is not None and name in c.outputs:
                    c.outputs.put(name, value)
                    outs.append(None)
                else:
                    outs.append(to_host(value))
            done.append((*outs, c))
    return done


@dataclass
class RouteExpertsResult:
    weights: np.ndarray | None  # None: in its region
    indices: np.ndarray | None
    outputs: Outputs | None = None  # the outputs that go into regions
    written: bool = False  # they are there already (else to_pb writes them: system regions)

    def to_pb(self) -> pb.RouteExpertsResponse:
        if self.outputs is None:
            return pb.RouteExpertsResponse(weights=from_array(self.weights), indices=from_array(self.indices))
        response = pb.RouteExpertsResponse()
        for name, value in (("weights", self.weights), ("indices", self.indices)):
            if name in self.outputs:
                if not self.written:
                    self.outputs.write(name, value)
                getattr(response, name).CopyFrom(self.outputs.message(name))
            else:
                getattr(response, name).CopyFrom(from_array(value))
        return response
