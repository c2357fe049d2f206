"""Step: several operators in one round trip, each a call of its own (they batch independently).

The parts run in any order, so none may write memory another reads or writes: a part's output
region sharing bytes with another part's input or output is refused (server/regions/overlap.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from logitserve.v1 import logitserve_pb2 as pb

from ..regions.overlap import check_parts_apart
from ..tensors import NOT_IN_PLACE
from .limits import Limits, field_bytes
from .route_experts import RouteExpertsCall
from .sample import SampleCall
from .tensor_ops import CausalSoftmaxCall, SiluCall, SoftmaxCall

STEP_OPS = {
    "sample": SampleCall,
    "route_experts": RouteExpertsCall,
    "softmax": SoftmaxCall,
    "causal_softmax": CausalSoftmaxCall,
    "silu": SiluCall,
}


def _within(in_place: Mapping[str, memoryview], name: str) -> Mapping[str, memoryview]:
    """The entries of ``in_place`` inside the sub-message ``name``, by their names there."""
    prefix = name + "."
    return {k[len(prefix):]: v for k, v in in_place.items() if k.startswith(prefix)}


@dataclass
class StepCall:
    """The operators one StepRequest names, each a call of its own (they batch independently)."""

    id: str
    calls: dict[str, object]

    @classmethod
    def from_pb(cls, msg: pb.StepRequest, limits: Limits,
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None) -> "StepCall":
        """``in_place``: tensor bytes read in place, by dotted name (``sample.logits``);
        ``regions``: the request's :class:`~..regions.CallRegions`, shared by its parts."""
        calls, leases = {}, {}
        for name, op in STEP_OPS.items():
            if not msg.HasField(name):
                continue
            first = 0 if regions is None else regions.leases
            calls[name] = op.from_pb(getattr(msg, name), limits, path=f"{name}.", in_place=_within(in_place, name),
                                     regions=regions)
            if regions is not None:
                leases[name] = regions.resolved(first)
        if not calls:
            raise ValueError(f"step: sets none of {', '.join(STEP_OPS)}")
        check_parts_apart(leases)  # the parts run independently: none may write what another touches
        step = cls(msg.id, calls)
        limits.check_answer("step", step.answer_size)
        return step

    @property
    def answer_size(self) -> int:
        """The StepResponse's message size: the id and every part's answer, framed."""
        fields = pb.StepResponse.DESCRIPTOR.fields_by_name
        id_bytes = len(self.id.encode())
        return ((field_bytes(fields["id"].number, id_bytes) if id_bytes else 0)
                + sum(field_bytes(fields[name].number, c.answer_size) for name, c in self.calls.items()))

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.calls.values())


@dataclass
class StepResult:
    id: str
    results: dict[str, object]

    def to_pb(self) -> pb.StepResponse:
        return pb.StepResponse(id=self.id, **{name: r.to_pb() for name, r in self.results.items()})
