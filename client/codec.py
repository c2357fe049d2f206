"""numpy / torch arrays <-> ``logitserve.v1.Tensor`` messages.

A Tensor message is ``{dtype, shape, data}`` with ``data`` the little-endian, C-order bytes of
the elements. :func:`encode` takes a numpy array (or anything ``numpy.asarray`` takes) or a torch
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


def encode(x, name: str = "tensor") -> pb.Tensor:
    """A Tensor message holding ``x`` (numpy array, array-like, or torch tensor)."""
    if is_torch(x):
        return _encode_torch(x, name)
    arr = np.asarray(x)
    kind = "bfloat16" if arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2 else arr.dtype.name
    dtype = _BY_NAME.get(kind)
    if dtype is None:
        raise TypeError(f"{name}: dtype {arr.dtype} has no wire dtype; use one of {', '.join(_BY_NAME)}")
    if dtype == pb.DTYPE_BFLOAT16:  # ml_dtypes.bfloat16 arrays: raw 16-bit patterns
        data = np.ascontiguousarray(arr).view("<u2").tobytes()
    else:
        data = np.ascontiguousarray(arr, dtype=NUMPY_DTYPES[dtype]).tobytes()
    return pb.Tensor(dtype=dtype, shape=arr.shape, data=data)


def _encode_torch(t, name: str) -> pb.Tensor:
    import torch

    kind = str(t.dtype).removeprefix("torch.")
    dtype = _BY_NAME.get(kind)
    if dtype is None:
        raise TypeError(f"{name}: dtype {t.dtype} has no wire dtype; use one of {', '.join(_BY_NAME)}")
    t = t.detach().to("cpu").contiguous()
    flat = t.reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    if sys.byteorder != "little" and t.element_size() > 1:
        data = np.frombuffer(data, dtype=f">u{t.element_size()}").astype(f"<u{t.element_size()}").tobytes()
    return pb.Tensor(dtype=dtype, shape=list(t.shape), data=data)


def _check(msg: pb.Tensor, name: str) -> tuple[int, ...]:
    if msg.dtype not in ITEMSIZE:
        raise ValueError(f"{name}.dtype: unknown value {msg.dtype}")
    shape = tuple(msg.shape)
    need = math.prod(shape) * ITEMSIZE[msg.dtype]
    if len(msg.data) != need:
        raise ValueError(f"{name}.data: {len(msg.data)} bytes, but shape {list(shape)} of "
                         f"{dtype_name(msg.dtype)} needs {need}")
    return shape


def decode(msg: pb.Tensor, name: str = "tensor") -> np.ndarray:
    """A numpy array (a writable copy) of ``msg``; bfloat16 becomes float32."""
    shape = _check(msg, name)
    if msg.dtype == pb.DTYPE_BFLOAT16:
        bits = np.frombuffer(msg.data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(msg.data, dtype=NUMPY_DTYPES[msg.dtype]).reshape(shape).astype(
        NUMPY_DTYPES[msg.dtype].newbyteorder("="))


def decode_torch(msg: pb.Tensor, name: str = "tensor"):
    """A CPU torch tensor of ``msg``, bfloat16 kept (imports torch)."""
    import torch

    shape = _check(msg, name)
    raw = np.frombuffer(msg.data, dtype=np.uint8).copy()
    if sys.byteorder != "little" and ITEMSIZE[msg.dtype] > 1:
        size = ITEMSIZE[msg.dtype]
        raw = raw.view(f"<u{size}").astype(f">u{size}").view(np.uint8)
    dtype = getattr(torch, dtype_name(msg.dtype))
    return torch.from_numpy(raw).view(dtype).reshape(shape)
