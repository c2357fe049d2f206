"""The registry of every owner's regions: register, status, unregister, and resolving a
reference into a lease on a checked view (see the package's docstring)."""

from __future__ import annotations

import math
import mmap
import os
import threading
from typing import Iterable, Sequence

from ..errors import TooLarge
from ..tenancy import per_token_bound
from .cuda import open_cuda
from .names import (CUDA_IPC_HANDLE_BYTES, DEFAULT_MAX_MAPPED_BYTES, DEFAULT_MAX_REGIONS, KEY_SCOPE_ANY, KEY_SCOPES,
                    SHM_DIR, SYSTEM, RegionExists, RegionNotFound, kinds_of, shown, check_key, check_key_scope,
                    check_name)
from .access import SystemSlice, detached_error, shrunk_error
from .region import SLICES_KEPT, CheckedSlice, Region, RegionInfo, RegionLease
from .system import open_system


def _not_this_device(device_id: int, devices: frozenset[int]) -> str:
    """Why a CUDA region on ``device_id`` is refused by a server of ``devices``, and where it goes."""
    if not devices:
        return (f"device_id: {device_id} is not a device of this server (none): it runs on the CPU; register "
                f"host memory (register_system) instead, or the region with a server on cuda:{device_id}")
    here = ", ".join(f"cuda:{d}" for d in sorted(devices))
    return (f"device_id: {device_id} is not a device of this server ({here}): the region's memory is on "
            f"cuda:{device_id}, and this process runs on {here} (its --device); register it with the process of "
            f"cuda:{device_id} (a server started with --devices names it in GetServerInfo's device_endpoints, "
            f"and the logitserve client sends it there itself)")


class RegionRegistry:
    """The regions of every owner; see the module's docstring.

    ``max_regions`` bounds the regions mapped (registered or unregistered while leased) and
    ``max_mapped_bytes`` their bytes (system: from offset's page to the end, mapped only where
    page-locked; CUDA: offset + byte_size); registering past either raises
    :class:`~.errors.TooLarge`. ``devices``, when given, are the
    CUDA device indices a CUDA region may be on (the server's device); ``shm_dir`` is where the
    system's POSIX shared-memory objects are; ``pin_system`` page-locks each system region at
    registration (a CUDA server: server/regions/pinning.py); ``key_scope`` is which objects an
    owner may map (names.KEY_SCOPES: "token" confines each owner to keys with its own prefix).
    ``share`` with ``tokens_on`` (bearer tokens on: each owner a token) bounds each owner to its
    share of both limits (server/tenancy.py ``per_token_bound``): no token can take every region
    and lock the others out. Without tokens every owner is one identity and the limits alone apply.
    """

    def __init__(self, max_regions: int = DEFAULT_MAX_REGIONS, max_mapped_bytes: int = DEFAULT_MAX_MAPPED_BYTES,
                 *, devices: Iterable[int] | None = None, shm_dir: str = SHM_DIR, pin_system: bool = False,
                 key_scope: str = KEY_SCOPE_ANY, share: float = 1.0, tokens_on: bool = False):
        if max_regions < 0 or max_mapped_bytes < 0:
            raise ValueError("max_regions and max_mapped_bytes must be >= 0")
        if key_scope not in KEY_SCOPES:
            raise ValueError(f"key_scope: must be one of {', '.join(KEY_SCOPES)}, got {key_scope!r}")
        self.key_scope = key_scope
        self.max_regions = max_regions
        self.max_mapped_bytes = max_mapped_bytes
        self.share = share
        self.owner_max_regions = per_token_bound(max_regions, share, tokens_on)
        self.owner_max_bytes = per_token_bound(max_mapped_bytes, share, tokens_on)
        self.devices = None if devices is None else frozenset(devices)
        self.shm_dir = shm_dir
        self.pin_system = pin_system
        self._lock = threading.Lock()
        self._regions: dict[tuple[object, str], Region] = {}  # (owner, name) -> registered region
        self._reserved: set[tuple[object, str]] = set()  # names being registered (CUDA opens unlocked)
        self._mapped_count = 0  # regions mapped or being mapped, registered or not
        self._mapped_bytes = 0
        self._owners: dict[object, list[int]] = {}  # owner -> [regions, bytes] mapped, owners mapping some

    # ------------------------------------------------------------------------------ counters

    @property
    def mapped_count(self) -> int:
        """Regions mapped now (registered, or unregistered and still leased)."""
        return self._mapped_count

    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

    def holdings(self) -> dict:
        """Each owner mapping some regions -> {"regions": n, "region_bytes": b} (/metrics)."""
        with self._lock:
            return {owner: {"regions": n, "region_bytes": b} for owner, (n, b) in self._owners.items()}

    def _count(self, owner, regions: int, nbytes: int) -> None:
        """Under the lock: ``regions`` and ``nbytes`` more (fewer, when negative) mapped for ``owner``."""
        held = self._owners.setdefault(owner, [0, 0])
        held[0] += regions
        held[1] += nbytes
        self._mapped_count += regions
        self._mapped_bytes += nbytes
        if held == [0, 0]:
            del self._owners[owner]

    # ---------------------------------------------------------------------------- registering

    def _reserve(self, owner, name: str, nbytes: int) -> None:
        """Hold ``name`` and room for a region of ``nbytes`` (under the lock), or raise."""
        key = (owner, name)
        if key in self._regions or key in self._reserved:
            raise RegionExists(f"name: a region {name!r} is already registered; unregister it first")
        if self._mapped_count + 1 > self.max_regions:
            raise TooLarge(f"name: registering {name!r} would map {self._mapped_count + 1} regions, over the "
                           f"server's limit of {self.max_regions}; unregister some first")
        if self._mapped_bytes + nbytes > self.max_mapped_bytes:
            raise TooLarge(f"byte_size: registering {name!r} would map {self._mapped_bytes + nbytes} bytes, over "
                           f"the server's limit of {self.max_mapped_bytes} ({self._mapped_bytes} mapped now)")
        regions, nbytes_held = self._owners.get(owner, (0, 0))
        if regions + 1 > self.owner_max_regions:
            raise TooLarge(f"name: registering {name!r} would map {regions + 1} regions for this token, over its "
                           f"share of the server's limit (--token-share {self.share} of {self.max_regions}: "
                           f"{self.owner_max_regions}); unregister some first")
        if nbytes_held + nbytes > self.owner_max_bytes:
            raise TooLarge(f"byte_size: registering {name!r} would map {nbytes_held + nbytes} bytes for this token, "
                           f"over its share of the server's limit (--token-share {self.share} of "
                           f"{self.max_mapped_bytes}: {self.owner_max_bytes}; {nbytes_held} mapped now)")
        self._reserved.add(key)
        self._count(owner, 1, nbytes)

    def _unreserve(self, owner, name: str, nbytes: int) -> None:
        self._reserved.discard((owner, name))
        self._count(owner, -1, -nbytes)

    def _commit(self, region: Region, reserved_bytes: int) -> RegionInfo:
        with self._lock:
            self._reserved.discard((region.owner, region.name))
            self._count(region.owner, 0, region.mapped_bytes - reserved_bytes)
            self._regions[(region.owner, region.name)] = region
            return region.info()

    @staticmethod
    def _check_range(offset: int, byte_size: int) -> None:
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset: must be an integer >= 0, got {offset!r}")
        if not isinstance(byte_size, int) or byte_size <= 0:
            raise ValueError(f"byte_size: must be an integer > 0, got {byte_size!r}")

    def register_system(self, name: str, key: str, offset: int, byte_size: int, owner=None) -> RegionInfo:
        """Make ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` (its
        ``shm_open`` name, with or without the leading '/') region ``name`` of ``owner`` (opened,
        and mapped only where ``pin_system`` page-locks it).

        Opened read-write, or read-only when the object allows no more (such a region is refused
        as an output). Raises ``ValueError`` (bad name, key, range; a key outside the owner's
        scope; no such object; not a regular object; past its end), :class:`RegionExists`,
        :class:`~.errors.TooLarge`.
        """
        check_name(name)
        plain = check_key(key)
        check_key_scope(plain, owner, self.key_scope)
        self._check_range(offset, byte_size)
        page_start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset + byte_size - page_start
        with self._lock:
            self._reserve(owner, name, length)
            try:
                region = open_system(self.shm_dir, name, owner, plain, offset, byte_size, page_start, length,
                                     self.pin_system)
            except BaseException:
                self._unreserve(owner, name, length)
                raise
            self._reserved.discard((owner, name))
            self._regions[(owner, name)] = region
            return region.info()

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner=None,
                      offset: int = 0) -> RegionInfo:
        """Open the CUDA allocation whose IPC handle is ``raw_handle`` (the 64 bytes of a
        ``cudaIpcMemHandle_t``, naming the allocation from its base) on device ``device_id``, and
        make ``[offset, offset + byte_size)`` of it region ``name`` of ``owner``.

        Needs torch with CUDA and cuda-python (``cuda.bindings``, imported here, not before).
        Raises ``ValueError`` (bad name or range; no CUDA or cuda-python; a device not the
        server's; a handle that does not open, with the CUDA error; an allocation on another
        device or shorter than offset + byte_size), :class:`RegionExists`,
        :class:`~.errors.TooLarge`.
        """
        check_name(name)
        self._check_range(offset, byte_size)
        if not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device_id: must be an integer >= 0, got {device_id!r}")
        if self.devices is not None and device_id not in self.devices:
            raise ValueError(_not_this_device(device_id, self.devices))
        raw_handle = bytes(raw_handle)
        if len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"raw_handle: {len(raw_handle)} bytes, but a cudaIpcMemHandle_t has "
                             f"{CUDA_IPC_HANDLE_BYTES}")
        nbytes = offset + byte_size
        with self._lock:
            self._reserve(owner, name, nbytes)
        try:
            region = open_cuda(name, owner, raw_handle, device_id, offset, byte_size)
        except BaseException:
            with self._lock:
                self._unreserve(owner, name, nbytes)
            raise
        return self._commit(region, nbytes)

    # -------------------------------------------------------------------- status, unregister

    def status(self, name: str = "", owner=None, kind: str | None = None) -> list[RegionInfo]:
        """The regions of ``owner`` (of ``kind``, when given), sorted by name; ``name`` not empty:
        that one, or :class:`RegionNotFound`."""
        kinds = kinds_of(kind)
        with self._lock:
            if name:
                region = self._regions.get((owner, name))
                if region is None or region.kind not in kinds:
                    what = f"{kind} region" if kind else "region"
                    raise RegionNotFound(f"name: no {what} {shown(name)} registered")
                return [region.info()]
            return sorted((r.info() for (o, _), r in self._regions.items() if o == owner and r.kind in kinds),
                          key=lambda info: info.name)

    def unregister(self, name: str = "", owner=None, kind: str | None = None) -> list[str]:
        """Forget region ``name`` of ``owner`` (every region of ``owner`` when ``name`` is empty;
        only those of ``kind`` when given); returns the names forgotten, sorted (none for a name
        not registered). A leased region stays mapped until its last lease is released."""
        kinds = kinds_of(kind)
        with self._lock:
            if name:
                region = self._regions.get((owner, name))
                chosen = [region] if region is not None and region.kind in kinds else []
            else:
                chosen = [r for (o, _), r in self._regions.items() if o == owner and r.kind in kinds]
            for region in chosen:
                del self._regions[(owner, region.name)]
                region.registered = False
            closing = [r for r in chosen if r.leases == 0]
            self._forget(closing)
        for region in closing:
            region.close()
        return sorted(r.name for r in chosen)

    def regions_of(self, owner, names: Sequence[str], field: str) -> list[Region]:
        """The regions ``names`` of ``owner`` as registered now (each once), to unregister later
        with :meth:`unregister_these`; :class:`RegionNotFound` naming ``field[i]`` for a name
        ``owner`` has not registered."""
        with self._lock:
            found: dict[str, Region] = {}
            for i, name in enumerate(names):
                region = self._regions.get((owner, name))
                if region is None:
                    raise RegionNotFound(f"{field}[{i}]: no region {shown(name)} registered (by this caller)")
                found[name] = region
        return list(found.values())

    def unregister_these(self, owner, regions: Sequence[Region]) -> list[str]:
        """Unregister each of ``regions`` still registered under its name (a name unregistered
        and registered again since is another region, and stays); the names unregistered."""
        with self._lock:
            current = [r for r in regions if self._regions.get((owner, r.name)) is r]
        return [name for region in current for name in self.unregister(region.name, owner)]

    def close(self) -> None:
        """Unregister every owner's regions (leased ones stay mapped until released)."""
        for owner in {o for o, _ in list(self._regions)}:
            self.unregister("", owner)

    def _forget(self, regions: Sequence[Region]) -> None:
        """Take ``regions`` off the counters (under the lock), before closing them."""
        for region in regions:
            self._count(region.owner, -1, -region.mapped_bytes)

    # ---------------------------------------------------------------------------- resolving

    def resolve(self, ref, dtype, shape: Sequence[int], owner=None, field: str = "tensor", *,
                writable: bool = False, exact: bool = True, sizes: dict | None = None) -> RegionLease:
        """A lease on the slice ``ref`` (a ``logitserve.v1.RegionRef``, or anything with
        ``region``, ``offset`` and ``byte_size``) of one of ``owner``'s regions, holding a tensor
        of torch ``dtype`` and ``shape``; ``field`` names the tensor in messages (``logits``,
        ``output_regions[token_ids]``). ``writable``: the slice will be written (an output).
        ``exact``: byte_size must be the tensor's size; False: at least it (Triton's rule for
        outputs), the lease covering the tensor's bytes from offset. ``sizes``: the system objects'
        sizes read by this call's resolves so far (``CallRegions``), each object's read once a call.

        Raises :class:`RegionNotFound` (no such region of ``owner``) or ``ValueError`` naming
        ``field`` and the rule (range past the region's end, misaligned for ``dtype``, byte_size
        not the tensor's, a read-only region written, a system object shrunk since).
        """
        name, offset, byte_size = ref.region, int(ref.offset), int(ref.byte_size)
        shape = tuple(shape)
        key = (offset, byte_size, dtype, shape, writable, exact)
        with self._lock:
            region = self._regions.get((owner, name))
            # A slice this region checked before passes the same rules again: only what may have
            # changed since (its object's size) is checked per call. A name registered again is
            # another Region, with none checked yet.
            checked = None if region is None else region.slices.get(key)
            if checked is None:
                checked = self._checked(region, name, offset, byte_size, dtype, shape, field, writable, exact)
                if len(region.slices) < SLICES_KEPT:
                    region.slices[key] = checked
            if region.kind == SYSTEM:
                # Checked again by every read and write (access.py): the object may shrink later.
                # Read once per object a call: a call's tensors are often slices of one object, and
                # each fstat lets go of the event loop's GIL.
                size = None if sizes is None else sizes.get(region.memory)
                if size is None:
                    size = os.fstat(region.fd).st_size
                    if sizes is not None:
                        sizes[region.memory] = size
                if size < region.object_end:
                    region.detached = region.detached or region.unpin is not None
                    raise shrunk_error(field, region, size)
                start, end = checked.start, checked.start + checked.nbytes
                if region.unpin is not None:  # page-locked: the device's pages may be cut off the object
                    if region.detached or not region.still_attached(start, end):
                        region.detached = True
                        raise detached_error(field, region)
                mapped = None if region.buf is None else region.buf[offset:offset + checked.nbytes]
                view = SystemSlice(region, offset, checked.nbytes, field, mapped)
            else:
                view = checked.view
            region.leases += 1
        return RegionLease(self, region, view, dtype, shape, field, writable, checked.span)

    @staticmethod
    def _checked(region: Region | None, name: str, offset: int, byte_size: int, dtype, shape: tuple, field: str,
                 writable: bool, exact: bool) -> CheckedSlice:
        """Under the lock: the slice of ``region`` (None: ``name`` not registered) that
        :meth:`resolve` was asked for, once it passes every rule that holds for the region's
        life; the errors :meth:`resolve` names."""
        itemsize = dtype.itemsize
        need = math.prod(shape) * itemsize
        if byte_size != need and (exact or byte_size < need):
            rule = "" if exact else "at least "
            raise ValueError(f"{field}.region.byte_size: {byte_size}, but shape {list(shape)} of "
                             f"{str(dtype).removeprefix('torch.')} needs {rule}{need} bytes")
        if region is None:
            raise RegionNotFound(f"{field}.region: no region {shown(name)} registered (by this caller)")
        if offset + byte_size > region.byte_size:
            raise ValueError(f"{field}.region: offset {offset} + byte_size {byte_size} = {offset + byte_size}, "
                             f"past the end of region {name!r} ({region.byte_size} bytes)")
        if (region.offset + offset) % itemsize:
            where = f" (+ the region's own offset {region.offset})" if region.offset else ""
            raise ValueError(f"{field}.region.offset: {offset}{where} is not a multiple of the itemsize "
                             f"{itemsize} of {str(dtype).removeprefix('torch.')}")
        if writable and not region.writable:
            raise ValueError(f"{field}.region: region {name!r} is read-only to the server (its object "
                             f"{region.key!r} could not be opened for writing)")
        start = region.offset + offset
        if region.kind == SYSTEM:
            return CheckedSlice(start, need, (region.memory, start, start + need), None)
        # A view costs microseconds of torch: made once per slice, kept with it.
        view = region.device_bytes[start:start + need].view(dtype).view(shape)
        return CheckedSlice(start, need, (region.memory, region.base_ptr + start, region.base_ptr + start + need),
                            view)

    def _release(self, region: Region) -> None:
        with self._lock:
            region.leases -= 1
            closing = not region.registered and region.leases == 0
            if closing:
                self._forget((region,))
        if closing:
            region.close()
