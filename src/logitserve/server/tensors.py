"""Tensor messages <-> host tensors, validated at the edge.

A ``logitserve.v1.Tensor`` is ``{dtype, shape, data}`` with ``data`` the little-endian, C-order
bytes of ``prod(shape)`` elements. :func:`decode` checks everything a malformed message can
get wrong and raises ``ValueError`` / ``TypeError`` naming the field, e.g.
``logits.data: 1000 bytes, but shape [2, 300] of float32 needs 2400``. Hosts are assumed
little-endian (x86-64, aarch64), so the bytes are used as they come.

Decoding makes a :class:`HostTensor`, not a torch tensor: it runs on the event loop, where every
torch call releases the GIL, and under load the loop then waits for the launch thread to give it
back.

A Tensor may instead name a slice of a registered region (``Tensor.region``): :func:`decode`
checks it by the same dtype and shape rules, resolves it through the call's
:class:`~.regions.CallRegions` (which holds the lease) and returns a :class:`HostTensor` over
the region's bytes (system shared memory, ``in_region``) or a :class:`DeviceTensor` viewing the
client's CUDA memory.
"""

from __future__ import annotations

import math
import struct
import types
import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from logitserve.v1 import logitserve_pb2 as pb

from .regions import CUDA, region_of
from .regions.access import SystemSlice

TORCH_DTYPES: dict[int, torch.dtype] = {
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_FLOAT64: torch.float64,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_INT64: torch.int64,
    pb.DTYPE_BOOL: torch.bool,
}
PB_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int32, torch.int64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# No tensor bytes read in place: every Tensor field reads its own data.
NOT_IN_PLACE: Mapping[str, memoryview] = types.MappingProxyType({})


def field(message, name: str, path: str = "") -> pb.Tensor:
    """The Tensor field ``name`` of ``message``; ``ValueError`` when it is not set."""
    if not message.HasField(name):
        raise ValueError(f"{path}{name}: required")
    return getattr(message, name)


class _Shaped:
    """Shape arithmetic shared by :class:`HostTensor` and :class:`DeviceTensor`, without torch."""

    __slots__ = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def _shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.numel() // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel():
            raise ValueError(f"cannot reshape {list(self.shape)} to {list(shape)}")
        return shape


@dataclass(eq=False, slots=True)
class HostTensor(_Shaped):
    """A checked tensor as it arrived: C-order little-endian ``data``, ``dtype`` and ``shape``.

    ``data`` is bytes, or a read-only view of the request's bytes (server/wire.py). Shape
    arithmetic and :meth:`reshape` need no torch; :meth:`torch` makes the CPU tensor viewing the
    bytes (on the launch thread), and :class:`~.staging.Staging` copies the bytes.

    Never changed once made (treat it as frozen): a frozen dataclass costs twice as much to make,
    and a Sample call makes three on its way to the GPU.
    """

    data: bytes | memoryview | SystemSlice  # SystemSlice: a system region's, read through its descriptor
    dtype: torch.dtype
    shape: tuple[int, ...]
    # The bytes are a registered system shared-memory region's (a lease of the call holds it):
    # staged like bytes, read from the object through its descriptor (server/regions/access.py).
    in_region: bool = False
    # ... page-locked (a CUDA server's region): the device's kernels copy them, never staged.
    pinned: bool = False

    @classmethod
    def of(cls, t: torch.Tensor) -> "HostTensor":
        """A copy of ``t`` (in-process callers: warm-up, tests)."""
        t = t.detach().to("cpu").contiguous()
        return cls(t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, tuple(t.shape))

    def reshape(self, *shape: int) -> "HostTensor":
        """The same bytes under another shape (one size may be -1)."""
        return HostTensor(self.data, self.dtype, self._shape_of(shape), self.in_region, self.pinned)

    def torch(self) -> torch.Tensor:
        """A CPU tensor viewing the bytes; read it, never write it (the bytes are immutable). A
        system region's bytes are read from its object into a new tensor: never viewed, since
        its client may shrink it under the view (server/regions/access.py)."""
        if type(self.data) is SystemSlice:
            return self.data.copy_out(self.dtype, self.shape)
        with warnings.catch_warnings():
            # torch warns that bytes are not writable; the tensor is only ever read.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.data, dtype=self.dtype)
        return flat.reshape(self.shape)

    def tolist(self) -> list:
        """The elements as Python numbers (int32, int64, float32, float64), in C order."""
        data = self.data.read() if type(self.data) is SystemSlice else self.data
        return list(struct.unpack(f"<{self.numel()}{_STRUCT_CODES[self.dtype]}", data))


@dataclass(eq=False, slots=True)
class DeviceTensor(_Shaped):
    """A checked tensor in a client's CUDA region: ``tensor`` views the region's memory (contiguous,
    on the region's device; a lease of the call holds it mapped). The kernels read it in place:
    it is never staged."""

    tensor: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]

    def reshape(self, *shape: int) -> "DeviceTensor":
        """The same memory under another shape (one size may be -1); no torch call until :meth:`torch`."""
        return DeviceTensor(self.tensor, self.dtype, self._shape_of(shape))

    def torch(self) -> torch.Tensor:
        """The device tensor, of this shape (on the launch thread)."""
        return self.tensor.view(self.shape)

    def tolist(self) -> list:
        """The elements as Python numbers: a copy to the host, synchronous (a few per-row values)."""
        return self.tensor.reshape(-1).tolist()


def decode(msg: pb.Tensor, name: str, *, dtypes: tuple[torch.dtype, ...], ranks: tuple[int, ...],
           data: memoryview | None = None, regions=None) -> HostTensor | DeviceTensor:
    """Check ``msg`` (the field called ``name``) and return it as a :class:`HostTensor` (or a
    :class:`DeviceTensor` for a CUDA region).

    ``dtypes`` and ``ranks`` are what the field accepts; ``data``, when given, is the field's
    bytes as read in place from the request (server/wire.py), ``msg.data`` being empty.
    ``regions``: the call's :class:`~.regions.CallRegions`, which resolves ``msg.region`` (None:
    the caller takes no regions, and a reference is refused).
    """
    ref = region_of(msg, name, None if data is None else len(data))
    code = msg.dtype
    if code == pb.DTYPE_UNSPECIFIED:
        raise ValueError(f"{name}.dtype: not set (DTYPE_UNSPECIFIED)")
    dtype = TORCH_DTYPES.get(code)
    if dtype is None:
        raise ValueError(f"{name}.dtype: unknown value {code}")
    if dtype not in dtypes:
        allowed = ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}.dtype: must be one of {allowed}, got {dtype_name(dtype)}")
    shape = tuple(msg.shape)
    if len(shape) not in ranks:
        allowed = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name}.shape: rank must be {allowed}, got {len(shape)} (shape {list(shape)})")
    if shape and min(shape) < 1:
        axis = next(i for i, size in enumerate(shape) if size < 1)
        raise ValueError(f"{name}.shape: dimension {axis} is {shape[axis]}; sizes must be >= 1 (no empty tensors)")
    if ref is not None:
        return region_tensor(regions, ref, dtype, shape, name)
    need = math.prod(shape) * dtype.itemsize
    if data is None:
        data = msg.data  # each read of a bytes field makes a new bytes object: read it once
    if len(data) != need:
        raise ValueError(f"{name}.data: {len(data)} bytes, but shape {list(shape)} of {dtype_name(dtype)} needs {need}")
    return HostTensor(data, dtype, shape)


def region_tensor(regions, ref, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> HostTensor | DeviceTensor:
    """The tensor of ``dtype`` and ``shape`` at ``ref``, leased by the call's ``regions``."""
    if regions is None:
        raise ValueError(f"{name}.region: this call takes no shared-memory regions; send the elements in data")
    lease = regions.resolve(ref, dtype, shape, name)
    if lease.kind == CUDA:
        return DeviceTensor(lease.view, dtype, shape)
    return HostTensor(lease.view, dtype, shape, True, lease.pinned)


def tensor_field(message, name: str, path: str, in_place: Mapping[str, memoryview], *,
                 dtypes: tuple[torch.dtype, ...], ranks: tuple[int, ...], regions=None) -> HostTensor | DeviceTensor:
    """The required Tensor field ``name`` of ``message``, checked by :func:`decode`; its bytes
    from ``in_place`` when the request was read with them in place (server/wire.py), or from
    its region (resolved by the call's ``regions``)."""
    return decode(field(message, name, path), f"{path}{name}", dtypes=dtypes, ranks=ranks, data=in_place.get(name),
                  regions=regions)


def from_torch(t: torch.Tensor) -> pb.Tensor:
    """Encode a tensor (any device, any strides) as a Tensor message."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    shape = list(t.shape)
    flat = t.reshape(-1)
    # bytes of any dtype, numpy included or not (it has no bfloat16): view as raw bytes.
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return pb.Tensor(dtype=PB_DTYPES[t.dtype], shape=shape, data=data)


# struct format codes of the dtypes Python numbers are packed as (pack, HostTensor.tolist).
_STRUCT_CODES = {torch.float32: "f", torch.float64: "d", torch.int32: "i", torch.int64: "q", torch.bool: "?"}


# Compiled layouts of pack, by (count, dtype): a call packs the same few every time. Counts are
# a call's rows times its parameters at most, so the cache stays small.
_PACKERS: dict[tuple[int, torch.dtype], struct.Struct] = {}


def packer(count: int, dtype: torch.dtype) -> struct.Struct:
    """The compiled layout that packs ``count`` Python numbers as a ``dtype`` tensor's bytes."""
    layout = _PACKERS.get((count, dtype))
    if layout is None:
        layout = _PACKERS[count, dtype] = struct.Struct(f"<{count}{_STRUCT_CODES[dtype]}")
    return layout


def pack(values: list, dtype: torch.dtype) -> bytes:
    """Python numbers as the little-endian bytes of a ``dtype`` tensor, without a torch call
    (each costs microseconds, tens inside the busy server)."""
    return packer(len(values), dtype).pack(*values)


# The wire dtypes numpy has (all but bfloat16), keyed by numpy dtype: results come back as arrays.
_NUMPY_PB_DTYPES = {torch.empty(0, dtype=t).numpy().dtype: code for t, code in PB_DTYPES.items()
                    if t != torch.bfloat16}


def from_array(a: np.ndarray) -> pb.Tensor:
    """Encode a numpy array (of any wire dtype but bfloat16) as a Tensor message."""
    return pb.Tensor(dtype=_NUMPY_PB_DTYPES[a.dtype], shape=list(a.shape), data=np.ascontiguousarray(a).tobytes())


def rows_tensor(msg: pb.Tensor, name: str, rows: int, *, dtypes: tuple[torch.dtype, ...],
                regions=None) -> HostTensor | DeviceTensor:
    """A per-row parameter: a ``[rows]`` tensor of one of ``dtypes`` (bytes, or in a region)."""
    t = decode(msg, name, dtypes=dtypes, ranks=(1,), regions=regions)
    if t.shape[0] != rows:
        raise ValueError(f"{name}.shape: must be [{rows}] (one value per row), got {list(t.shape)}")
    return t
