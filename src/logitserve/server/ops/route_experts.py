"""RouteExperts: ``kernels.route_experts`` on ``gate_logits [N, E]``, MoE routing.

The router's options (scoring, correction bias, groups, scaling) travel as one hashable
:class:`Router`, part of the batching key: calls share a launch only under equal options, the
bias compared by content. The defaults are ``kernels.topk_softmax``'s routing, unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.route_experts import check_group_options
from logitserve.kernels.topk_softmax import MAX_EXPERTS
from logitserve.v1 import logitserve_pb2 as pb

from ..engine.staging import Staging, to_host
from ..tensors import NOT_IN_PLACE, HostTensor, from_array, tensor_field
from .batching import split, split_rows
from .limits import Limits, answer_bytes
from .resident import Outputs, device_inputs, launches_in_place

ROUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORINGS = {pb.RouteExpertsRequest.SCORING_UNSPECIFIED: "softmax", pb.RouteExpertsRequest.SCORING_SIGMOID: "sigmoid"}
GROUP_SCORES = {pb.RouteExpertsRequest.GROUP_SCORE_UNSPECIFIED: "top2_sum",
                pb.RouteExpertsRequest.GROUP_SCORE_MAX: "max"}


@dataclass(frozen=True)
class Router:
    """A request's router options; hashable (the bias by its bytes), part of the batching key."""

    scoring: str = "softmax"
    bias: bytes | None = None  # float32 [E], little-endian
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_pb(cls, msg: pb.RouteExpertsRequest, experts: int, k: int, path: str = "") -> "Router":
        """The options of ``msg``, checked against E and k; ValueError names the field and the rule."""
        if msg.scoring not in SCORINGS:
            raise ValueError(f"{path}scoring: must be SCORING_UNSPECIFIED (softmax) or SCORING_SIGMOID, "
                             f"got {msg.scoring}")
        if msg.group_score not in GROUP_SCORES:
            raise ValueError(f"{path}group_score: must be GROUP_SCORE_UNSPECIFIED (top2_sum) or GROUP_SCORE_MAX, "
                             f"got {msg.group_score}")
        for name in ("n_group", "topk_group"):
            if getattr(msg, name) < 0:
                raise ValueError(f"{path}{name}: must be >= 1 (0: unset, 1), got {getattr(msg, name)}")
        n_group, topk_group = msg.n_group or 1, msg.topk_group or 1
        scale = msg.routed_scaling_factor if msg.HasField("routed_scaling_factor") else 1.0
        group_score = GROUP_SCORES[msg.group_score]
        check_group_options(experts, k, n_group, topk_group, group_score, scale, path)
        bias = None
        if msg.HasField("correction_bias"):
            b = tensor_field(msg, "correction_bias", path, NOT_IN_PLACE, dtypes=(torch.float32,), ranks=(1,))
            if b.shape != (experts,):
                raise ValueError(f"{path}correction_bias.shape: must be [E] = [{experts}], got {list(b.shape)}")
            bias = bytes(b.data)
            if not np.isfinite(np.frombuffer(bias, dtype="<f4")).all():
                raise ValueError(f"{path}correction_bias: must be finite")
        return cls(SCORINGS[msg.scoring], bias, n_group, topk_group, group_score, scale)

    def options(self) -> dict:
        return dict(scoring=self.scoring, n_group=self.n_group, topk_group=self.topk_group,
                    group_score=self.group_score, routed_scaling_factor=self.routed_scaling_factor)

    def launcher(self, k: int, renormalize: bool, backend: str):
        """``launch(gate_logits) -> (weights, indices)``; the bias goes to the device on the first
        launch (before a CUDA graph's capture, server/engine/graphs.py) and stays with the closure."""
        options, device_bias = self.options(), {}

        def launch(gate_logits):
            if self.bias is not None and gate_logits.device not in device_bias:
                bias = torch.frombuffer(bytearray(self.bias), dtype=torch.float32)
                device_bias[gate_logits.device] = bias.to(gate_logits.device)
            return kernels.route_experts(gate_logits, k, correction_bias=device_bias.get(gate_logits.device),
                                         renormalize=renormalize, backend=backend, **options)
        return launch


DEFAULT_ROUTER = Router()


@dataclass(eq=False)
class RouteExpertsCall:
    """``kernels.route_experts`` on ``gate_logits [N, E]``."""

    gate_logits: HostTensor
    k: int
    renormalize: bool
    # The outputs to write into regions (output_regions), and the call's leases (server/regions/calls.py).
    outputs: Outputs | None = None
    regions: object = None
    router: Router = DEFAULT_ROUTER
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
        router = Router.from_pb(msg, experts, msg.k, path)
        shape = (g.shape[0], msg.k)
        shapes = {"weights": (torch.float32, shape), "indices": (torch.int32, shape)}
        outputs = Outputs.of(msg, "RouteExperts", regions, path, shapes)
        size = answer_bytes(pb.RouteExpertsResponse, shapes, outputs)
        limits.check_answer(f"{path}gate_logits", size)
        return cls(g, msg.k, msg.renormalize, outputs, regions, router, size)

    @property
    def inputs(self) -> tuple:
        return (self.gate_logits,)

    @property
    def rows(self) -> int:
        return self.gate_logits.shape[0]

    @property
    def key(self):
        return (self.op, self.gate_logits.dtype, self.gate_logits.shape[1], self.k, self.renormalize, self.router)

    @staticmethod
    async def run_batch(calls: list["RouteExpertsCall"], handle) -> list["RouteExpertsResult"]:
        if launches_in_place(calls, handle.device):
            done = await handle.run(_launch_in_place, calls, handle)
            return [RouteExpertsResult(None if w is None else w.numpy(), None if i is None else i.numpy(), c.outputs,
                                       written=True) for w, i, c in done]
        rows = [c.rows for c in calls]
        launch = calls[0].router.launcher(calls[0].k, calls[0].renormalize, handle.backend)

        def stage_for(batch_rows: int) -> Staging:
            stage = Staging()
            stage.add([c.gate_logits for c in calls], rows=batch_rows)
            return stage

        weights, indices = await handle.launch(calls[0].key, sum(rows), stage_for, launch)
        return [RouteExpertsResult(w, i, c.outputs)
                for w, i, c in zip(split_rows(weights, rows), split_rows(indices, rows), calls)]


def _launch_in_place(calls: list[RouteExpertsCall], handle) -> list[tuple]:
    """On the launch thread: ``calls`` launched on their gate logits where they are
    (server/ops/resident.py), in one launch; each call's outputs put into its regions, the others
    brought to the host: ``(weights, indices, call)``, None for an output in a region."""
    launch = calls[0].router.launcher(calls[0].k, calls[0].renormalize, handle.backend)
    gate_logits, = device_inputs(handle, [c.gate_logits for c in calls])
    weights, indices = launch(gate_logits)
    rows = [c.rows for c in calls]
    done = []
    for w, i, c in zip(split(weights, rows), split(indices, rows), calls):
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
