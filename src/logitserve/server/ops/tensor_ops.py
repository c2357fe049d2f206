"""The row-wise tensor ops: Softmax, CausalSoftmax, Silu / SwiGLU.

Compatible calls are stacked as rows of one 2-D (3-D for causal softmax) tensor, launched
eagerly with torch on the device's launch thread, and split again after the launch. Calls whose
tensors live in regions launch as server/ops/resident.py says: a lone call reads its inputs in
place and its kernel writes ``out`` straight into its region (``out=``) when that is on the
device; a batch of them gathers or launches call by call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from logitserve import kernels
from logitserve.v1 import logitserve_pb2 as pb

from ..engine.staging import to_host
from ..tensors import FLOATS, NOT_IN_PLACE, HostTensor, decode, from_torch, tensor_field
from .batching import split
from .limits import MAX_RANK, Limits, answer_bytes
from .resident import Outputs, device_inputs


class _LaunchedOnThread:
    """An op whose batches launch eagerly with torch, on the device's launch thread
    (``launch_on_thread(calls, handle)``, one result per call)."""

    @classmethod
    async def run_batch(cls, calls: list, handle) -> list["TensorResult"]:
        return await handle.run(cls.launch_on_thread, calls, handle)


@dataclass
class TensorResult:
    out: torch.Tensor | None  # None: written into its region
    response: type
    outputs: Outputs | None = None

    @classmethod
    def of(cls, out: torch.Tensor, call, response: type) -> "TensorResult":
        """On the launch thread: ``out`` (one call's, on the device) put into the call's region,
        or brought to the host for the answer."""
        if call.outputs is not None and "out" in call.outputs:
            call.outputs.put("out", out)
            return cls(None, response, call.outputs)
        return cls(to_host(out), response)

    def to_pb(self):
        return self.response(out=from_torch(self.out) if self.out is not None else self.outputs.message("out"))


def _split_results(out: torch.Tensor, calls: list, sizes: list[int], response: type) -> list[TensorResult]:
    """A batch's ``out`` split into each call's result (one copy back to the host for a batch
    without output regions)."""
    if all(c.outputs is None for c in calls):
        out = to_host(out)
    return [TensorResult.of(o.reshape(c.x.shape), c, response) for o, c in zip(split(out, sizes), calls)]


def _direct_out(call, handle) -> torch.Tensor | None:
    """The region a lone call's kernel writes ``out`` into (``out=``), when there is one on the device."""
    return None if call.outputs is None else call.outputs.direct("out", handle.device)


def _outputs(msg, rpc: str, regions, path: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Outputs | None:
    return Outputs.of(msg, rpc, regions, path, {"out": (dtype, tuple(shape))})


def _rows_and_width(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    width = shape[axis]
    return math.prod(shape) // width, width


@dataclass(eq=False)
class SoftmaxCall(_LaunchedOnThread):
    """``kernels.softmax`` along ``dim`` of a tensor of any rank."""

    x: HostTensor
    dim: int
    outputs: Outputs | None = None
    regions: object = None  # the call's leases (server/regions/calls.py)
    answer_size: int = 0  # the answer's message size (limits.answer_bytes)

    op = "softmax"

    @classmethod
    def from_pb(cls, msg: pb.SoftmaxRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None) -> "SoftmaxCall":
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=tuple(range(1, MAX_RANK + 1)),
                         regions=regions)
        dim = msg.dim if msg.HasField("dim") else -1
        if not -x.ndim <= dim < x.ndim:
            raise ValueError(f"{path}dim: must be in [{-x.ndim}, {x.ndim}) for a rank-{x.ndim} x, got {dim}")
        dim %= x.ndim
        limits.check(f"{path}x", *_rows_and_width(tuple(x.shape), dim))
        outputs = _outputs(msg, "Softmax", regions, path, x.dtype, x.shape)
        size = answer_bytes(pb.SoftmaxResponse, {"out": (x.dtype, tuple(x.shape))}, outputs)
        limits.check_answer(f"{path}x", size)
        return cls(x, dim, outputs, regions, size)

    @property
    def inputs(self) -> tuple:
        return (self.x,)

    @property
    def rows(self) -> int:
        return _rows_and_width(tuple(self.x.shape), self.dim)[0]

    @property
    def key(self):
        # Only last-axis softmaxes stack as rows; another axis launches alone.
        return (self.op, self.x.dtype, self.x.shape[-1]) if self.dim == self.x.ndim - 1 else None

    @staticmethod
    def launch_on_thread(calls: list["SoftmaxCall"], handle) -> list[TensorResult]:
        if len(calls) == 1:  # into its output region where it has one on the device
            c = calls[0]
            x, = device_inputs(handle, [c.x])
            out = kernels.softmax(x, dim=c.dim, out=_direct_out(c, handle), backend=handle.backend)
            return [TensorResult.of(out, c, pb.SoftmaxResponse)]
        width = calls[0].x.shape[-1]
        x, = device_inputs(handle, [c.x.reshape(-1, width) for c in calls])
        out = kernels.softmax(x, dim=-1, backend=handle.backend)
        return _split_results(out, calls, [c.rows for c in calls], pb.SoftmaxResponse)


@dataclass(eq=False)
class CausalSoftmaxCall(_LaunchedOnThread):
    """``kernels.causal_softmax`` on scores ``[S, T]`` or ``[B, S, T]``, ``T >= S``."""

    x: HostTensor
    outputs: Outputs | None = None
    regions: object = None  # the call's leases (server/regions/calls.py)
    answer_size: int = 0  # the answer's message size (limits.answer_bytes)

    op = "causal_softmax"

    @classmethod
    def from_pb(cls, msg: pb.CausalSoftmaxRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None) -> "CausalSoftmaxCall":
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=(2, 3), regions=regions)
        s, t = x.shape[-2:]
        if t < s:
            raise ValueError(f"{path}x.shape: needs T >= S (every row sees a column), got S = {s}, T = {t}")
        limits.check(f"{path}x", x.numel() // t, t)
        outputs = _outputs(msg, "CausalSoftmax", regions, path, x.dtype, x.shape)
        size = answer_bytes(pb.CausalSoftmaxResponse, {"out": (x.dtype, tuple(x.shape))}, outputs)
        limits.check_answer(f"{path}x", size)
        return cls(x, outputs, regions, size)

    @property
    def inputs(self) -> tuple:
        return (self.x,)

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    @property
    def key(self):
        return (self.op, self.x.dtype, *self.x.shape[-2:])

    @staticmethod
    def launch_on_thread(calls: list["CausalSoftmaxCall"], handle) -> list[TensorResult]:
        if len(calls) == 1:  # into its output region where it has one on the device
            c = calls[0]
            x, = device_inputs(handle, [c.x])
            out = kernels.causal_softmax(x, out=_direct_out(c, handle), backend=handle.backend)
            return [TensorResult.of(out, c, pb.CausalSoftmaxResponse)]
        s, t = calls[0].x.shape[-2:]
        stacked, = device_inputs(handle, [c.x.reshape(-1, s, t) for c in calls])
        out = kernels.causal_softmax(stacked, backend=handle.backend)
        sizes = [c.x.numel() // (s * t) for c in calls]
        return _split_results(out, calls, sizes, pb.CausalSoftmaxResponse)


@dataclass(eq=False)
class SiluCall(_LaunchedOnThread):
    """``kernels.silu(x)``, or ``kernels.swiglu(x, up)`` when ``up`` is given (broadcasting)."""

    x: HostTensor
    up: HostTensor | None
    outputs: Outputs | None = None
    regions: object = None  # the call's leases (server/regions/calls.py)
    answer_size: int = 0  # the answer's message size (limits.answer_bytes)

    op = "silu"

    @classmethod
    def from_pb(cls, msg: pb.SiluRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None) -> "SiluCall":
        ranks = tuple(range(1, MAX_RANK + 1))
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=ranks, regions=regions)
        up = None
        shape = tuple(x.shape)
        if msg.HasField("up"):
            up = decode(msg.up, f"{path}up", dtypes=FLOATS, ranks=ranks, data=in_place.get("up"), regions=regions)
            if up.dtype != x.dtype:
                raise TypeError(f"{path}up.dtype: must match x.dtype ({x.dtype}), got {up.dtype}".replace("torch.", ""))
            try:
                shape = tuple(torch.broadcast_shapes(x.shape, up.shape))
            except RuntimeError:
                raise ValueError(f"{path}up.shape: {list(up.shape)} does not broadcast with x.shape "
                                 f"{list(x.shape)}") from None
        limits.check(f"{path}x", *_rows_and_width(shape, -1))
        outputs = _outputs(msg, "Silu", regions, path, x.dtype, shape)
        size = answer_bytes(pb.SiluResponse, {"out": (x.dtype, shape)}, outputs)
        limits.check_answer(f"{path}x", size)
        return cls(x, up, outputs, regions, size)

    @property
    def inputs(self) -> tuple:
        return (self.x,) if self.up is None else (self.x, self.up)

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    @property
    def key(self):
        if self.up is None:
            return ("silu", self.x.dtype, self.x.shape[-1])
        # SwiGLU stacks only when nothing broadcasts; broadcasting calls launch alone.
        return ("swiglu", self.x.dtype, self.x.shape[-1]) if self.up.shape == self.x.shape else None

    @staticmethod
    def launch_on_thread(calls: list["SiluCall"], handle) -> list[TensorResult]:
        backend = handle.backend
        if len(calls) == 1:  # into its output region where it has one on the device
            c = calls[0]
            x, *up = device_inputs(handle, [c.x]) if c.up is None else device_inputs(handle, [c.x], [c.up])
            direct = _direct_out(c, handle)
            out = (kernels.silu(x, out=direct, backend=backend) if c.up is None
                   else kernels.swiglu(x, up[0], out=direct, backend=backend))
            return [TensorResult.of(out, c, pb.SiluResponse)]
        width = calls[0].x.shape[-1]
        if calls[0].up is None:
            x, = device_inputs(handle, [c.x.reshape(-1, width) for c in calls])
            out = kernels.silu(x, backend=backend)
        else:
            x, up = device_inputs(handle, [c.x.reshape(-1, width) for c in calls],
                                  [c.up.reshape(-1, width) for c in calls])
            out = kernels.swiglu(x, up, backend=backend)
        return _split_results(out, calls, [c.rows for c in calls], pb.SiluResponse)
