"""The row-wise tensor ops: Softmax, CausalSoftmax, Silu / SwiGLU.

Compatible calls are stacked as rows of one 2-D (3-D for causal softmax) tensor, launched
eagerly with torch on the device's launch thread, and split again after the launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from logitserve import kernels
from logitserve.v1 import logitserve_pb2 as pb

from ..staging import to_host
from ..tensors import FLOATS, NOT_IN_PLACE, HostTensor, decode, from_torch, tensor_field
from .batching import split, to_device
from .limits import MAX_RANK, Limits


class _LaunchedOnThread:
    """An op whose batches launch eagerly with torch, on the device's launch thread
    (``launch_on_thread(calls, handle)``, one result per call)."""

    @classmethod
    async def run_batch(cls, calls: list, handle) -> list["TensorResult"]:
        return await handle.run(cls.launch_on_thread, calls, handle)


@dataclass
class TensorResult:
    out: torch.Tensor
    response: type

    def to_pb(self):
        return self.response(out=from_torch(self.out))


def _rows_and_width(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    width = shape[axis]
    return math.prod(shape) // width, width


@dataclass(eq=False)
class SoftmaxCall(_LaunchedOnThread):
    """``kernels.softmax`` along ``dim`` of a tensor of any rank."""

    x: HostTensor
    dim: int

    op = "softmax"

    @classmethod
    def from_pb(cls, msg: pb.SoftmaxRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "SoftmaxCall":
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=tuple(range(1, MAX_RANK + 1)))
        dim = msg.dim if msg.HasField("dim") else -1
        if not -x.ndim <= dim < x.ndim:
            raise ValueError(f"{path}dim: must be in [{-x.ndim}, {x.ndim}) for a rank-{x.ndim} x, got {dim}")
        dim %= x.ndim
        limits.check(f"{path}x", *_rows_and_width(tuple(x.shape), dim))
        return cls(x, dim)

    @property
    def rows(self) -> int:
        return _rows_and_width(tuple(self.x.shape), self.dim)[0]

    @property
    def key(self):
        # Only last-axis softmaxes stack as rows; another axis launches alone.
        return (self.op, self.x.dtype, self.x.shape[-1]) if self.dim == self.x.ndim - 1 else None

    @staticmethod
    def launch_on_thread(calls: list["SoftmaxCall"], handle) -> list[TensorResult]:
        if len(calls) == 1:
            c = calls[0]
            x, = to_device(handle, [c.x])
            return [TensorResult(to_host(kernels.softmax(x, dim=c.dim, backend=handle.backend)), pb.SoftmaxResponse)]
        width = calls[0].x.shape[-1]
        x, = to_device(handle, [c.x.reshape(-1, width) for c in calls])
        out = to_host(kernels.softmax(x, dim=-1, backend=handle.backend))
        return [TensorResult(o.reshape(c.x.shape), pb.SoftmaxResponse)
                for o, c in zip(split(out, [c.rows for c in calls]), calls)]


@dataclass(eq=False)
class CausalSoftmaxCall(_LaunchedOnThread):
    """``kernels.causal_softmax`` on scores ``[S, T]`` or ``[B, S, T]``, ``T >= S``."""

    x: HostTensor

    op = "causal_softmax"

    @classmethod
    def from_pb(cls, msg: pb.CausalSoftmaxRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "CausalSoftmaxCall":
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=(2, 3))
        s, t = x.shape[-2:]
        if t < s:
            raise ValueError(f"{path}x.shape: needs T >= S (every row sees a column), got S = {s}, T = {t}")
        limits.check(f"{path}x", x.numel() // t, t)
        return cls(x)

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    @property
    def key(self):
        return (self.op, self.x.dtype, *self.x.shape[-2:])

    @staticmethod
    def launch_on_thread(calls: list["CausalSoftmaxCall"], handle) -> list[TensorResult]:
        s, t = calls[0].x.shape[-2:]
        stacked, = to_device(handle, [c.x.reshape(-1, s, t) for c in calls])
        out = to_host(kernels.causal_softmax(stacked, backend=handle.backend))
        sizes = [c.x.numel() // (s * t) for c in calls]
        return [TensorResult(o.reshape(c.x.shape), pb.CausalSoftmaxResponse)
                for o, c in zip(split(out, sizes), calls)]


@dataclass(eq=False)
class SiluCall(_LaunchedOnThread):
    """``kernels.silu(x)``, or ``kernels.swiglu(x, up)`` when ``up`` is given (broadcasting)."""

    x: HostTensor
    up: HostTensor | None

    op = "silu"

    @classmethod
    def from_pb(cls, msg: pb.SiluRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "SiluCall":
        ranks = tuple(range(1, MAX_RANK + 1))
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=ranks)
        up = None
        shape = tuple(x.shape)
        if msg.HasField("up"):
            up = decode(msg.up, f"{path}up", dtypes=FLOATS, ranks=ranks, data=in_place.get("up"))
            if up.dtype != x.dtype:
                raise TypeError(f"{path}up.dtype: must match x.dtype ({x.dtype}), got {up.dtype}".replace("torch.", ""))
            try:
                shape = tuple(torch.broadcast_shapes(x.shape, up.shape))
            except RuntimeError:
                raise ValueError(f"{path}up.shape: {list(up.shape)} does not broadcast with x.shape "
                                 f"{list(x.shape)}") from None
        limits.check(f"{path}x", *_rows_and_width(shape, -1))
        limits.check_output(f"{path}x", shape, x.element_size())
        return cls(x, up)

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
        if len(calls) == 1:
            c = calls[0]
            x, *up = to_device(handle, [c.x]) if c.up is None else to_device(handle, [c.x], [c.up])
            out = kernels.silu(x, backend=backend) if c.up is None else kernels.swiglu(x, up[0], backend=backend)
            return [TensorResult(to_host(out), pb.SiluResponse)]
        width = calls[0].x.shape[-1]
        if calls[0].up is None:
            x, = to_device(handle, [c.x.reshape(-1, width) for c in calls])
            out = kernels.silu(x, backend=backend)
        else:
            x, up = to_device(handle, [c.x.reshape(-1, width) for c in calls],
                               [c.up.reshape(-1, width) for c in calls])
            out = kernels.swiglu(x, up, backend=backend)
        out = to_host(out)
        return [TensorResult(o.reshape(c.x.shape), pb.SiluResponse)
                for o, c in zip(split(out, [c.rows for c in calls]), calls)]
