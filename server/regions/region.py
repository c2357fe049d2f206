"""A mapped region, what status reports of it, and the lease a call holds on a slice of it."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from .names import CUDA, SYSTEM

@dataclass(frozen=True)
class RegionInfo:
    """What status reports of a region."""

    name: str
    kind: str  # SYSTEM or CUDA
    key: str  # system: the object's plain name; CUDA: ""
    offset: int  # into the object (system) or the allocation (CUDA)
    byte_size: int
    device_id: int  # CUDA: the allocation's device; system: 0
    in_use: int  # leases held now
    writable: bool


class Region:
    """One mapped region; its memory is released by :meth:`close`, once."""

    def __init__(self, name: str, owner, kind: str, key: str, offset: int, byte_size: int, device_id: int,
                 mapped_bytes: int, writable: bool):
        self.name, self.owner, self.kind, self.key = name, owner, kind, key
        self.offset, self.byte_size, self.device_id = offset, byte_size, device_id
        self.mapped_bytes = mapped_bytes
        self.writable = writable
        self.leases = 0
        self.registered = True
        # system
        self.fd: int | None = None
        self.mmap: mmap.mmap | None = None
        self.buf: memoryview | None = None  # the region's bytes, [offset, offset + byte_size) of the object
        self.object_end = offset + byte_size  # the object must stay at least this long
        self.unpin = None  # set where the mapping is page-locked (server/regions/pinning.py)
        # CUDA
        self.base_ptr = 0  # the opened allocation's base
        self.device_bytes = None  # torch uint8 tensor over [base, base + offset + byte_size)
        self.closer = None  # closes the IPC mapping

    def info(self) -> RegionInfo:
        return RegionInfo(self.name, self.kind, self.key, self.offset, self.byte_size, self.device_id, self.leases,
                          self.writable)

    def close(self) -> None:
        if self.kind == SYSTEM:
            buf, mapping, fd, unpin = self.buf, self.mmap, self.fd, self.unpin
            self.buf = self.mmap = self.fd = self.unpin = None
            if unpin is not None:  # before the mapping can go
                unpin()
            if buf is not None:
                buf.release()
            if mapping is not None:
                try:
                    mapping.close()
                except BufferError:
                    # A view made from a lease outlived it (a bug of its holder): the mapping goes
                    # when the last such view does, never under it.
                    pass
            if fd is not None:
                os.close(fd)
        else:
            self.device_bytes = None
            closer, self.closer = self.closer, None
            if closer is not None:
                closer()


class RegionLease:
    """A checked view of one slice of a region, holding the region mapped until :meth:`release`
    (or the end of a ``with`` block).

    ``view`` is a ``memoryview`` of the slice's bytes (system; format ``B``, writable when the
    object was opened read-write) or a torch tensor of ``dtype`` and ``shape`` on the region's
    device (CUDA). :meth:`tensor` gives a torch tensor of either kind.
    """

    __slots__ = ("view", "kind", "dtype", "shape", "region", "_registry", "_region")

    def __init__(self, registry, region: Region, view, dtype, shape):
        self._registry, self._region = registry, region
        self.view, self.kind, self.dtype, self.shape = view, region.kind, dtype, shape
        self.region = region.name

    @property
    def released(self) -> bool:
        return self._region is None

    @property
    def pinned(self) -> bool:
        """Whether the slice is page-locked system memory (the device copies it by DMA)."""
        return self._region is not None and self._region.unpin is not None

    def tensor(self):
        """The slice as a torch tensor of ``dtype`` and ``shape``, sharing its memory (CPU for
        system memory, the region's device for CUDA). Valid until the lease is released."""
        import torch

        if self._region is None:
            raise RuntimeError(f"region {self.region!r}: lease already released")
        if self.kind == CUDA:
            return self.view
        if len(self.view) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self.view, dtype=self.dtype).view(self.shape)

    def release(self) -> None:
        """End the lease (idempotent). The region is unmapped now if it was unregistered and this
        was its last lease."""
        region, self._region = self._region, None
        if region is None:
            return
        view, self.view = self.view, None
        if isinstance(view, memoryview):
            try:
                view.release()
            except BufferError:  # a tensor made by tensor() is still alive: it keeps the bytes
                pass
        self._registry._release(region)

    def __enter__(self) -> "RegionLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._region is None else "held"
        return f"RegionLease({self.region!r}, {self.kind}, {self.dtype}, {list(self.shape)}, {state})"

