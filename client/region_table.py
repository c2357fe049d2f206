"""The table of the regions one client registered, and finding the region a tensor lies in.

:class:`RegionTable` keeps every name a client registered (it unregisters them when it closes)
and, where the client knows it, the memory behind each (a SharedHostBuffer's mapping, a torch
CUDA tensor's allocation), so that a contiguous numpy array or torch tensor inside one is sent
as a reference to it (:class:`Located`) instead of as bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import codec
from .regions import CUDA, SYSTEM, SharedHostBuffer


@dataclass(frozen=True)
class Located:
    """Where a tensor lies in a region registered through the client: the region, the tensor's
    offset from the region's start and its length in bytes; ``device`` the CUDA device index
    (this process's) for a CUDA region, None for system memory."""

    region: str
    kind: str
    offset: int
    byte_size: int
    device: int | None

    def ref(self) -> pb.RegionRef:
        return pb.RegionRef(region=self.region, offset=self.offset, byte_size=self.byte_size)


@dataclass(frozen=True)
class _Span:
    """The memory of a region in this process: ``[start, end)`` addresses (host, or device
    ``device``), and what keeps it valid (the SharedHostBuffer, checked open; the CUDA tensor,
    kept alive while registered)."""

    name: str
    kind: str
    start: int
    end: int
    device: int | None
    keep: object = None


def host_address(buf: SharedHostBuffer) -> int:
    """The address of a SharedHostBuffer's first byte in this process."""
    probe = np.frombuffer(buf.shm.buf, dtype=np.uint8, count=1)
    try:
        return probe.__array_interface__["data"][0]
    finally:
        del probe


def _address(x) -> tuple[int, int, str, int | None] | None:
    """``(address, byte_size, kind, device)`` of a contiguous numpy array or torch tensor with a
    wire dtype, in the wire's layout (little-endian); None for anything else."""
    if codec.is_torch(x):
        if not x.is_contiguous() or codec.wire_dtype(x) is None or x.is_conj() or x.is_neg():
            return None
        nbytes = x.numel() * x.element_size()
        if x.device.type == "cuda":
            return x.data_ptr(), nbytes, CUDA, x.device.index
        if x.device.type == "cpu":
            return x.data_ptr(), nbytes, SYSTEM, None
        return None
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous or codec.wire_dtype(x) is None or x.dtype.byteorder == ">":
            return None
        return x.__array_interface__["data"][0], x.nbytes, SYSTEM, None
    return None


class RegionTable:
    """The regions one client registered: every name (a client unregisters them when it closes)
    and, where the client knows it, the memory behind each (a SharedHostBuffer's mapping, a torch
    CUDA tensor's allocation), so that :meth:`locate` finds the region a tensor lies in by its
    address. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._names: dict[str, str] = {}  # name -> kind, in registration order
        self._spans: list[_Span] = []

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def add(self, name: str, kind: str, span: _Span | None = None) -> None:
        with self._lock:
            self._names[name] = kind
            self._spans = [s for s in self._spans if s.name != name]
            if span is not None:
                self._spans.append(span)

    def add_system(self, name: str, buf: SharedHostBuffer | None, offset: int, byte_size: int) -> None:
        """Region ``name``: ``[offset, offset + byte_size)`` of ``buf`` (None: a key this
        process has no mapping of; the name is still kept)."""
        span = None
        if buf is not None:
            start = host_address(buf) + offset
            span = _Span(name, SYSTEM, start, start + byte_size, None, buf)
        self.add(name, SYSTEM, span)

    def add_cuda(self, name: str, start: int | None, byte_size: int, device: int, keep=None) -> None:
        """Region ``name``: ``byte_size`` bytes from device address ``start`` on ``device``
        (None: unknown here; the name is still kept)."""
        span = None if start is None else _Span(name, CUDA, start, start + byte_size, device, keep)
        self.add(name, CUDA, span)

    def remove(self, names) -> None:
        names = set(names)
        with self._lock:
            for name in names:
                self._names.pop(name, None)
            self._spans = [s for s in self._spans if s.name not in names]

    def locate(self, x) -> Located | None:
        """The region ``x`` (a numpy array or torch tensor) lies in, contiguous and whole, or
        None (then it travels as bytes)."""
        found = _address(x)
        if found is None:
            return None
        ptr, nbytes, kind, device = found
        if nbytes == 0:
            return None
        with self._lock:
            spans = list(self._spans)
        for span in spans:
            if span.kind != kind or span.device != device or not span.start <= ptr or ptr + nbytes > span.end:
                continue
            if kind == SYSTEM and span.keep is not None and span.keep.shm.buf is None:
                continue  # closed (unmapped) here: its addresses may be reused
            return Located(span.name, kind, ptr - span.start, nbytes, device)
        return None
