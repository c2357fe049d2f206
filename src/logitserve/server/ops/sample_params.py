"""The sampling parameters of a request: each a scalar field or a per-row tensor ``<name>_rows``,
checked by the rules of ``kernels/sampling/params.py`` (per-row values at once, with numpy), and
packed into the per-row float32 and int64 columns the kernels read. Sample and VerifyDraft take
them alike, but for Sample's per-row tensors in CUDA regions: those are copied to the host and
checked on a worker thread before the call queues (:class:`DeviceRows`), not on the event loop."""

from __future__ import annotations

import math
import secrets
import struct
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from logitserve.kernels.sampling.params import SEED_BITS, SamplingParam

from ..tensors import INTS, DeviceTensor, HostTensor, pack, rows_tensor
from .processor_checks import in_float32

Param = Union[int, float, list]  # a scalar, or one value per row

_FLOAT32 = struct.Struct("f")


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as the kernels read it (beyond float32's range: infinity)."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_values(name: str, values: list, ok, rule: str, dtype=None) -> None:
    """Every value keeps ``ok``, checked at once (numpy; ``dtype``: as rounded to it first); a
    ``ValueError`` names the first that does not."""
    array = np.asarray(values)
    if dtype is not None:
        with np.errstate(over="ignore"):  # beyond float32's range: infinity, as the kernels read it
            array = array.astype(dtype)
    bad = ~ok(array)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"{name}[{i}]: {rule}, got {values[i]}")


@dataclass(frozen=True)
class DeviceRows:
    """A per-row parameter ``<name>_rows`` in a CUDA region, to be copied to the host and checked
    off the event loop (:func:`read_device_rows`, before the call queues): a copy from the device
    on the loop made it wait for the device."""

    path: str
    param: SamplingParam
    values: DeviceTensor

    @property
    def name(self) -> str:
        return self.path + self.param.rows_field


def _checked_rows(name: str, param: SamplingParam, values: list) -> list:
    _check_values(name, values, param.ok, f"must be {param.rule}")
    if param.kind is float:
        _check_values(name, values, param.ok, in_float32(param), np.float32)
    return values


def wire_param(msg, param, rows: int, path: str, regions=None, device_rows: bool = False) -> Param | DeviceRows | None:
    """A sampling parameter from its scalar field or its per-row tensor ``<name>_rows``; unset,
    its default. A float must keep its rule in float32 too, the precision the kernels read it in
    (a temperature of 1e300 is inf there, a top_p of 1e-300 is 0). ``device_rows``: a per-row
    tensor in a CUDA region comes back unread, as :class:`DeviceRows` (else it is read here)."""
    if msg.HasField(param.rows_field):
        name = path + param.rows_field
        t = rows_tensor(getattr(msg, param.rows_field), name, rows,
                        dtypes=(torch.float32, torch.float64) if param.kind is float else INTS, regions=regions)
        if device_rows and type(t) is DeviceTensor:
            return DeviceRows(path, param, t)
        return _checked_rows(name, param, t.tolist())
    if not msg.HasField(param.name):
        return param.default
    value = getattr(msg, param.name)
    if not param.ok(value):
        raise ValueError(f"{path}{param.name}: must be {param.rule}, got {value}")
    if param.kind is float and not param.ok(as_float32(value)):
        raise ValueError(f"{path}{param.name}: {in_float32(param)}, got {value}")
    return value


def take_device_rows(values: dict[str, Param | DeviceRows]) -> dict[str, DeviceRows]:
    """The parameters of ``values`` left in CUDA regions, taken out: 0 stands in their place
    until :func:`read_device_rows` reads them."""
    deferred = {name: v for name, v in values.items() if type(v) is DeviceRows}
    values.update(dict.fromkeys(deferred, 0))
    return deferred


def read_device_rows(deferred: dict[str, DeviceRows]) -> dict[str, list]:
    """On a worker thread: each parameter of ``deferred`` copied to the host and checked
    (``ValueError`` naming the field, the row and the rule)."""
    return {name: _checked_rows(d.name, d.param, d.values.tolist()) for name, d in deferred.items()}


def draw_seeds(rows: int) -> list[int]:
    """``rows`` seeds of ``SEED_BITS`` random bits, drawn at once (a ``secrets.randbits`` a row
    took 0.2 ms of the event loop for 256 rows)."""
    words = np.frombuffer(secrets.token_bytes(8 * rows), dtype=np.uint64)
    return (words >> np.uint64(64 - SEED_BITS)).tolist()


_NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64}


def param_rows(columns: list[Param], rows: int, dtype: torch.dtype) -> HostTensor:
    """``columns`` (each a scalar or one value per row) as a ``[rows, len(columns)]`` tensor. With
    a per-row column, the table is filled a column at a time (numpy: each column's rows at once,
    rounded to float32 as ``pack`` rounds them), not a row at a time."""
    if list not in map(type, columns):
        return HostTensor(pack(columns, dtype) * rows, dtype, (rows, len(columns)))
    table = np.empty((rows, len(columns)), dtype=_NUMPY_DTYPES[dtype])
    for j, column in enumerate(columns):
        table[:, j] = column
    return HostTensor(table.tobytes(), dtype, (rows, len(columns)))
