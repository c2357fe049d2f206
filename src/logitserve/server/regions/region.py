"""A registered region, what status reports of it, and the lease a call holds on a slice of it."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from .access import SystemSlice
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
    """One registered region; its descriptor or mapping is released by :meth:`close`, once."""

    def __init__(self, name: str, owner, kind: str, key: str, offset: int, byte_size: int, device_id: int,
                 mapped_bytes: int, writable: bool):
        self.name, self.owner, self.kind, self.key = name, owner, kind, key
        self.offset, self.byte_size, self.device_id = offset, byte_size, device_id
        self.mapped_bytes = mapped_bytes
        self.writable = writable
        self.leases = 0
        self.registered = True
        # The memory, for telling whether two regions share bytes (server/regions/overlap.py):
        # ("system", st_dev, st_ino) of the object, or ("cuda", device) of the allocation.
        self.memory: tuple = ()
        # system: read and written through fd (server/regions/access.py); mapped only where page-locked
        self.fd: int | None = None
        self.mmap: mmap.mmap | None = None  # page-locked regions only
        self.buf: memoryview | None = None  # ... their bytes, [offset, offset + byte_size) of the object
        self.object_end = offset + byte_size  # the object must stay at least this long
        self.unpin = None  # set where the mapping is page-locked (server/regions/pinning.py)
        self.still_attached = None  # ... with it: whether the object's bytes [start, end) are still on the locked pages
        self.detached = False  # the object was cut under the locked pages: refused until registered again
        # CUDA
        self.base_ptr = 0  # the opened allocation's base
        self.device_bytes = None  # torch uint8 tensor over [base, base + offset + byte_size)
        self.closer = None  # closes the IPC mapping
        # The slices calls resolved, checked (CheckedSlice), by what the rules read (offset,
        # byte_size, dtype, shape, writable, exact): a caller names the same slices call after call,
        # and checking one, with a CUDA view to make, costs microseconds a tensor (at most SLICES_KEPT).
        self.slices: dict = {}

    def info(self) -> RegionInfo:
        return RegionInfo(self.name, self.kind, self.key, self.offset, self.byte_size, self.device_id, self.leases,
                          self.writable)

    def close(self) -> None:
        self.slices = {}  # a CUDA slice's view keeps the mapping's memory referenced
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


SLICES_KEPT = 64  # a region's checked slices kept; past it they are checked afresh (a hostile caller's slices)


@dataclass(frozen=True, slots=True)
class CheckedSlice:
    """A slice of one region that passed every rule holding for the region's life (range,
    alignment, size, writability): kept with the region and used by every lease on it again."""

    start: int  # into the object (system) or the allocation (CUDA)
    nbytes: int
    span: tuple  # the memory it covers (server/regions/overlap.py)
    view: object  # CUDA: the torch tensor of its dtype and shape on the device; system: None


class RegionLease:
    """A checked slice of one region, holding the region until :meth:`release` (or the end of a
    ``with`` block).

    ``view`` is, for a CUDA region, a torch tensor of ``dtype`` and ``shape`` on the region's
    device; for a system region, a :class:`~.access.SystemSlice`, read and written through the
    object's descriptor (:meth:`read_into`, :meth:`copy_out`, :meth:`write_from`), never through
    a mapping the CPU could fault on. ``field`` names the tensor in errors, ``writable`` says it is
    an output, ``span`` is the memory it covers (server/regions/overlap.py).
    """

    __slots__ = ("view", "kind", "dtype", "shape", "region", "field", "writable", "span", "_registry", "_region")

    def __init__(self, registry, region: Region, view, dtype, shape, field: str, writable: bool, span: tuple):
        self._registry, self._region = registry, region
        self.view, self.kind, self.dtype, self.shape = view, region.kind, dtype, shape
        self.region, self.field, self.writable, self.span = region.name, field, writable, span

    @property
    def released(self) -> bool:
        return self._region is None

    @property
    def pinned(self) -> bool:
        """Whether the slice is page-locked system memory (the device's kernels copy it)."""
        return self._region is not None and self._region.unpin is not None

    def _system(self) -> SystemSlice:
        if self._region is None:
            raise RuntimeError(f"{self.field}.region: lease already released")
        if self.kind != SYSTEM:
            raise TypeError(f"{self.field}.region: a CUDA region is read and written on its device (tensor())")
        return self.view

    def read_into(self, buffer) -> None:
        """System: fill ``buffer`` (writable, exactly the slice's bytes) from the object;
        ``ValueError`` naming the region when the object has shrunk under the slice."""
        self._system().read_into(buffer)

    def copy_out(self):
        """System: a new CPU tensor of ``dtype`` and ``shape`` holding the slice's bytes."""
        return self._system().copy_out(self.dtype, self.shape)

    def write_from(self, data) -> None:
        """System: write ``data`` (the slice's bytes: bytes-like, numpy or a CPU torch tensor)
        into the object; ``ValueError`` naming the region when the object has shrunk."""
        self._system().write_from(data)

    def tensor(self):
        """The slice as a torch tensor of ``dtype`` and ``shape`` sharing its memory, where the
        device reaches it: a CUDA region's, or a page-locked system region's host tensor (for
        the device's copies only: no CPU code may read or write it). A pageable system region
        has none (``RuntimeError``): use :meth:`copy_out` and :meth:`write_from`. Valid until
        the lease is released."""
        if self._region is None:
            raise RuntimeError(f"{self.field}.region: lease already released")
        if self.kind == CUDA:
            return self.view
        return self.view.pinned_tensor(self.dtype, self.shape)

    def release(self) -> None:
        """End the lease (idempotent). The region is closed now if it was unregistered and this
        was its last lease."""
        region, self._region = self._region, None
        if region is None:
            return
        view, self.view = self.view, None
        if isinstance(view, SystemSlice):
            view.close()
        self._registry._release(region)

    def __enter__(self) -> "RegionLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._region is None else "held"
        return f"RegionLease({self.region!r}, {self.kind}, {self.dtype}, {list(self.shape)}, {state})"
