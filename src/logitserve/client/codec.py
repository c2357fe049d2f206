"""numpy / torch arrays <-> ``logitserve.v1.Tensor`` messages.

A Tensor message is ``{dtype, shape, data}`` with ``data`` the little-endian, C-order bytes of
the elements. :func:`tensor_parts` gives a tensor's dtype, shape and a byte view of its
elements without copying them where they already are in that layout (what the client frames
into a request, :mod:`.wire`); :func:`encode` takes a numpy array (or anything ``numpy.asarray`` takes) or a torch
tensor (any device, any strides, bfloat16 included); :func:`decode` returns a numpy array.
numpy has no bfloat16, so :func:`decode` widens bfloat16 to float32 (exactly: every bfloat16 is a
float32); :func:`decode_torch` keeps it. torch is optional: it is only imported to decode into
torch, and a torch tensor is recognised without importing it.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

# Wire dtype -> little-endian numpy dtype (bfloat16 has none: handled apart).
NUMPY_DTYPES = {
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_BOOL: np.dtype("|b1"),
}
ITEMSIZE = {**{k: v.itemsize for k, v in NUMPY_DTYPES.items()}, pb.DTYPE_BFLOAT16: 2}
_BY_NAME = {"float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16, "float32": pb.DTYPE_FLOAT32,
            "float64": pb.DTYPE_FLOAT64, "int32": pb.DTYPE_INT32, "int64": pb.DTYPE_INT64, "bool": pb.DTYPE_BOOL}


def dtype_name(dtype: int) -> str:
    """``pb.DTYPE_FLOAT32`` -> ``"float32"``."""
    return pb.DType.Name(dtype).removeprefix("DTYPE_").lower()


def is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


# numpy / torch dtype -> wire dtype (None: it has none), as first seen: a call asks about ten
# times, and numpy builds a dtype's name anew at each read.
_SEEN_DTYPES: dict = {}
_UNSEEN = object()


def wire_dtype(x) -> int | None:
    """The wire dtype of a numpy array or torch tensor's elements, or None when it has none."""
    dt = x.dtype
    wire = _SEEN_DTYPES.get(dt, _UNSEEN)
    if wire is not _UNSEEN:
        return wire
    if is_torch(x):
        wire = _BY_NAME.get(str(dt).removeprefix("torch."))
    else:
        wire = _BY_NAME.get("bfloat16" if dt.name == "bfloat16" and dt.itemsize == 2 else dt.name)
    if len(_SEEN_DTYPES) < 64:  # bounded: structured numpy dtypes are endless
        _SEEN_DTYPES[dt] = wire
    return wire


def tensor_parts(x, name: str = "tensor") -> tuple[int, tuple[int, ...], memoryview]:
    """``(dtype, shape, elements)`` of ``x`` (numpy array, array-like, or torch tensor), the
    elements a flat byte view in the wire's layout (little-endian, C order).

    The view is over ``x``'s own memory where that already is the wire's layout (a contiguous
    little-endian CPU array or tensor): nothing is copied. Otherwise ``x`` is converted once
    (strided, big-endian, another device, an integer list) and the view is over the result.
    """
    if is_torch(x):
        return _torch_parts(x, name)
    arr = np.asarray(x)
    dtype = wire_dtype(arr)
    if dtype is None:
        raise TypeError(f"{name}: dtype {arr.dtype} has no wire dtype; use one of {', '.join(_BY_NAME)}")
    if dtype == pb.DTYPE_BFLOAT16:  # ml_dtypes.bfloat16 arrays: raw 16-bit patterns
        flat = np.ascontiguousarray(arr).reshape(-1).view("<u2")
    else:
        flat = np.ascontiguousarray(arr, dtype=NUMPY_DTYPES[dtype]).reshape(-1)
    return dtype, arr.shape, memoryview(flat.view(np.uint8))


class _TensorMemory:
    """A contiguous CPU tensor's bytes as numpy sees them (``__array_interface__``), the tensor
    kept alive by the array made of it."""

    __slots__ = ("tensor", "__array_interface__")

    def __init__(self, t, nbytes: int):
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), True), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def _torch_parts(t, name: str) -> tuple[int, tuple[int, ...], memoryview]:
    dtype = wire_dtype(t)
    if dtype is None:
        raise TypeError(f"{name}: dtype {t.dtype} has no wire dtype; use one of {', '.join(_BY_NAME)}")
    shape = tuple(t.shape)
    # (No conjugate bit to check: it is complex's, which has no wire dtype.)
    if t.is_contiguous() and t.device.type == "cpu" and not t.is_neg() and (sys.byteorder == "little"
                                                                            or t.element_size() == 1):
        # The tensor's memory read by address: the six dispatcher calls of the general path below
        # (detach, to, contiguous, reshape, view, numpy) cost a bfloat16 tensor (numpy has none,
        # so bfloat16 always comes as torch) about 25 us a call, cache-cold more, against numpy's 2.
        nbytes = t.numel() * t.element_size()
        return dtype, shape, memoryview(np.asarray(_TensorMemory(t, nbytes)) if nbytes else np.empty(0, np.uint8))
    import torch

    flat = t.detach().to("cpu").resolve_neg().contiguous().reshape(-1)  # a negative view's values, not its memory
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    if sys.byteorder != "little" and t.element_size() > 1:
        size = t.element_size()
        raw = raw.view(f">u{size}").astype(f"<u{size}").view(np.uint8)
    return dtype, shape, memoryview(raw)


def encode(x, name: str = "tensor") -> pb.Tensor:
    """A Tensor message holding ``x`` (numpy array, array-like, or torch tensor)."""
    dtype, shape, data = tensor_parts(x, name)
    return pb.Tensor(dtype=dtype, shape=shape, data=bytes(data))


def _check(msg: pb.Tensor, name: str, data) -> tuple[int, ...]:
    if msg.dtype not in ITEMSIZE:
        raise ValueError(f"{name}.dtype: unknown value {msg.dtype}")
    shape = tuple(msg.shape)
    need = math.prod(shape) * ITEMSIZE[msg.dtype]
    if len(data) != need:
        raise ValueError(f"{name}.data: {len(data)} bytes, but shape {list(shape)} of "
                         f"{dtype_name(msg.dtype)} needs {need}")
    return shape


def decode(msg: pb.Tensor, name: str = "tensor", data=None) -> np.ndarray:
    """A numpy array (a writable copy, made in one pass) of ``msg``; bfloat16 becomes float32.
    ``data``: the elements when read apart from the message (:func:`logitserve.client.wire.split`),
    else ``msg.data``."""
    data = msg.data if data is None else data
    shape = _check(msg, name, data)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(data, dtype=NUMPY_DTYPES[msg.dtype]).reshape(shape).astype(
        NUMPY_DTYPES[msg.dtype].newbyteorder("="))


def decode_torch(msg: pb.Tensor, name: str = "tensor", data=None):
    """A CPU torch tensor of ``msg``, bfloat16 kept (imports torch); ``data`` as in :func:`decode`."""
    import torch

    data = msg.data if data is None else data
    shape = _check(msg, name, data)
    raw = np.frombuffer(data, dtype=np.uint8).copy()
    if sys.byteorder != "little" and ITEMSIZE[msg.dtype] > 1:
        size = ITEMSIZE[msg.dtype]
        raw = raw.view(f"<u{size}").astype(f">u{size}").view(np.uint8)
    dtype = getattr(torch, dtype_name(msg.dtype))
    return torch.from_numpy(raw).view(dtype).reshape(shape)
