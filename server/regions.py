"""Shared-memory regions: memory a client shares with the server, mapped once at registration.

A region is a slice of a POSIX shared-memory object (system memory) or of a CUDA allocation
opened from its IPC handle (device memory). Tensors of a call name a slice of a region
(``logitserve.v1.RegionRef``) instead of carrying their bytes; :meth:`RegionRegistry.resolve`
turns such a reference into a view of exactly that slice, checked, without copying:

    registry = RegionRegistry(max_regions=256, max_mapped_bytes=16 << 30)
    registry.register_system("logits", key="psm_1234", offset=0, byte_size=8 * 128256 * 4, owner=owner)
    with registry.resolve(ref, torch.float32, (8, 128256), owner, "logits") as lease:
        lease.view       # memoryview of the slice's bytes (system) or a torch tensor on the device (CUDA)
        lease.tensor()   # a torch tensor of dtype and shape over the same memory, either kind

The semantics are those of Triton Inference Server's shared-memory extension (its
``SystemSharedMemory*`` / ``CudaSharedMemory*`` RPCs map onto :meth:`~RegionRegistry.register_system`,
:meth:`~RegionRegistry.register_cuda`, :meth:`~RegionRegistry.status` and
:meth:`~RegionRegistry.unregister` with a ``kind``): a name registered twice fails
(:class:`RegionExists`), status and unregister of an empty name cover all of the caller's
regions, status of an unknown name fails (:class:`RegionNotFound`), unregistering an unknown name
unregisters nothing.

**Owners.** Every region belongs to an owner, :func:`owner_of` the caller's ``authorization``
metadata (None without a token). An owner sees, resolves and unregisters only its own regions;
two owners may use the same name. Limits (:class:`~.errors.TooLarge`) count every owner's.

**Leases.** :meth:`~RegionRegistry.resolve` returns a :class:`RegionLease`; a region unregistered
while leased leaves the table at once (its name is free) and stays mapped until its last lease is
released. Whoever launches work on a lease's view releases the lease only once that work is
complete (for CUDA, after the stream synchronization that precedes the answer), and keeps no view
of it afterwards: the memory may be unmapped then.

**Safety.** A key is a plain name in the shared-memory namespace (``/dev/shm`` on Linux, where
``shm_open`` keeps its objects), opened with ``O_NOFOLLOW | O_NONBLOCK`` and refused unless a
regular file: nothing outside that namespace is ever opened. The server maps objects itself
(``os.open`` + ``mmap``), never through ``multiprocessing.shared_memory``, whose resource tracker
would unlink a client's object when the server's process ends. A client that shrinks an object
after registering it would make reads past its new end fault (SIGBUS); :meth:`resolve` checks the
object's size on every call so a shrunk object is refused instead, short of a shrink racing a
launch.

**Threads.** Every method may be called from the event loop and from a launch thread; a lock
guards the table, leases and counters. Opening a CUDA handle happens outside the lock.

Errors: :class:`RegionNotFound` (NOT_FOUND), :class:`RegionExists` (ALREADY_EXISTS), ``ValueError``
(INVALID_ARGUMENT; the message names the field and the rule), :class:`~.errors.TooLarge`
(RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import TooLarge

SYSTEM = "system"
CUDA = "cuda"
KINDS = (SYSTEM, CUDA)

DEFAULT_MAX_REGIONS = 256
DEFAULT_MAX_MAPPED_BYTES = 16 << 30
SHM_DIR = "/dev/shm"
CUDA_IPC_HANDLE_BYTES = 64

# A region's name: what a RegionRef names, also in messages and logs.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
NAME_RULE = "1 to 128 of A-Z a-z 0-9 . _ : -, starting with a letter or digit"
# A shared-memory object's name as shm_open takes it, without its optional leading '/'.
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
KEY_RULE = "1 to 255 of A-Z a-z 0-9 . _ -, not starting with '.', after at most one leading '/'"


# The outputs each operator can write into regions (its request's output_regions keys): the
# fields of its answer.
OUTPUTS = {
    "Sample": ("token_ids", "seeds", "valid"),
    "RouteExperts": ("weights", "indices"),
    "Softmax": ("out",),
    "CausalSoftmax": ("out",),
    "Silu": ("out",),
}


class RegionNotFound(Exception):
    """No region of that name visible to the caller: NOT_FOUND."""


class RegionExists(Exception):
    """A region of that name is already registered by the caller: ALREADY_EXISTS."""


def owner_of(authorization: str | None) -> str | None:
    """The owner of a caller's regions, from its ``authorization`` metadata value (``Bearer
    <token>``): a digest of the token, so the token itself is never kept; None without one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else authorization.strip()
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest() if token else None


def _shown(text: str, limit: int = 64) -> str:
    """``repr(text)``, cut short: a hostile name can be long."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_name(name: str, field: str = "name") -> str:
    """``name`` when it is a valid region name, else ``ValueError``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{field}: {_shown(str(name))} is not a valid region name ({NAME_RULE})")
    return name


def check_key(key: str, field: str = "key") -> str:
    """The shared-memory object's plain name for ``key`` (its leading '/' dropped), else
    ``ValueError``: never a path, never '.' or '..'."""
    plain = key[1:] if isinstance(key, str) and key.startswith("/") else key
    if not isinstance(plain, str) or not _KEY.fullmatch(plain):
        raise ValueError(f"{field}: {_shown(str(key))} is not a plain shared-memory name ({KEY_RULE})")
    return plain


def region_of(tensor, field: str, data_bytes: int | None = None):
    """The ``RegionRef`` of a ``logitserve.v1.Tensor`` whose elements live in a region, or None
    for one that carries them in ``data``; ``ValueError`` when it has both. ``data_bytes``: the
    length of its data when read apart from the message (server/wire.py), else ``len(tensor.data)``."""
    if not tensor.HasField("region"):
        return None
    if (len(tensor.data) if data_bytes is None else data_bytes):
        raise ValueError(f"{field}: both data and region are set; exactly one holds the elements")
    return tensor.region


def check_outputs(output_regions, rpc: str, field: str = "output_regions") -> None:
    """``ValueError`` unless every key of a request's ``output_regions`` is an output of ``rpc``
    (:data:`OUTPUTS`) and every reference names a region."""
    known = OUTPUTS[rpc]
    for name, ref in output_regions.items():
        if name not in known:
            raise ValueError(f"{field}: {_shown(name)} is not an output of {rpc} ({', '.join(known)})")
        if not ref.region:
            raise ValueError(f"{field}[{name}].region: required")


def _kinds(kind: str | None) -> tuple[str, ...]:
    if kind is None or kind == "":
        return KINDS
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    return (kind,)


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


class _Region:
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
        # CUDA
        self.base_ptr = 0  # the opened allocation's base
        self.device_bytes = None  # torch uint8 tensor over [base, base + offset + byte_size)
        self.closer = None  # closes the IPC mapping

    def info(self) -> RegionInfo:
        return RegionInfo(self.name, self.kind, self.key, self.offset, self.byte_size, self.device_id, self.leases,
                          self.writable)

    def close(self) -> None:
        if self.kind == SYSTEM:
            buf, mapping, fd = self.buf, self.mmap, self.fd
            self.buf = self.mmap = self.fd = None
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

    def __init__(self, registry: "RegionRegistry", region: _Region, view, dtype, shape):
        self._registry, self._region = registry, region
        self.view, self.kind, self.dtype, self.shape = view, region.kind, dtype, shape
        self.region = region.name

    @property
    def released(self) -> bool:
        return self._region is None

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


class _CudaArray:
    """A device pointer as ``__cuda_array_interface__`` bytes, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


def _cuda_bindings():
    """cuda-python's runtime and driver bindings (the ``cuda`` extra), or ``ValueError``."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError as exc:
        raise ValueError("raw_handle: this server cannot open CUDA IPC handles: cuda-python is not installed "
                         "(pip install 'logitserve[cuda]', i.e. cuda-bindings)") from exc
    return runtime, driver


def _cuda_error_text(runtime, err) -> str:
    try:
        _, name = runtime.cudaGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - only words for a message
        return str(err)


class RegionRegistry:
    """The regions of every owner; see the module's docstring.

    ``max_regions`` bounds the regions mapped (registered or unregistered while leased) and
    ``max_mapped_bytes`` their bytes (system: the length mapped; CUDA: offset + byte_size);
    registering past either raises :class:`~.errors.TooLarge`. ``devices``, when given, are the
    CUDA device indices a CUDA region may be on (the server's device); ``shm_dir`` is where the
    system's POSIX shared-memory objects are.
    """

    def __init__(self, max_regions: int = DEFAULT_MAX_REGIONS, max_mapped_bytes: int = DEFAULT_MAX_MAPPED_BYTES,
                 *, devices: Iterable[int] | None = None, shm_dir: str = SHM_DIR):
        if max_regions < 0 or max_mapped_bytes < 0:
            raise ValueError("max_regions and max_mapped_bytes must be >= 0")
        self.max_regions = max_regions
        self.max_mapped_bytes = max_mapped_bytes
        self.devices = None if devices is None else frozenset(devices)
        self.shm_dir = shm_dir
        self._lock = threading.Lock()
        self._regions: dict[tuple[object, str], _Region] = {}  # (owner, name) -> registered region
        self._reserved: set[tuple[object, str]] = set()  # names being registered (CUDA opens unlocked)
        self._mapped_count = 0  # regions mapped or being mapped, registered or not
        self._mapped_bytes = 0

    # ------------------------------------------------------------------------------ counters

    @property
    def mapped_count(self) -> int:
        """Regions mapped now (registered, or unregistered and still leased)."""
        return self._mapped_count

    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

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
        self._reserved.add(key)
        self._mapped_count += 1
        self._mapped_bytes += nbytes

    def _unreserve(self, owner, name: str, nbytes: int) -> None:
        self._reserved.discard((owner, name))
        self._mapped_count -= 1
        self._mapped_bytes -= nbytes

    def _commit(self, region: _Region, reserved_bytes: int) -> RegionInfo:
        with self._lock:
            self._reserved.discard((region.owner, region.name))
            self._mapped_bytes += region.mapped_bytes - reserved_bytes
            self._regions[(region.owner, region.name)] = region
            return region.info()

    @staticmethod
    def _check_range(offset: int, byte_size: int) -> None:
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset: must be an integer >= 0, got {offset!r}")
        if not isinstance(byte_size, int) or byte_size <= 0:
            raise ValueError(f"byte_size: must be an integer > 0, got {byte_size!r}")

    def register_system(self, name: str, key: str, offset: int, byte_size: int, owner=None) -> RegionInfo:
        """Map ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` (its
        ``shm_open`` name, with or without the leading '/') as region ``name`` of ``owner``.

        Opened read-write, or read-only when the object allows no more (such a region is refused
        as an output). Raises ``ValueError`` (bad name, key, range; no such object; not a regular
        object; past its end), :class:`RegionExists`, :class:`~.errors.TooLarge`.
        """
        check_name(name)
        plain = check_key(key)
        self._check_range(offset, byte_size)
        page_start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset + byte_size - page_start
        with self._lock:
            self._reserve(owner, name, length)
            try:
                region = self._map_system(name, owner, plain, offset, byte_size, page_start, length)
            except BaseException:
                self._unreserve(owner, name, length)
                raise
            self._reserved.discard((owner, name))
            self._regions[(owner, name)] = region
            return region.info()

    def _map_system(self, name, owner, plain, offset, byte_size, page_start, length) -> _Region:
        path = os.path.join(self.shm_dir, plain)
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        writable = True
        try:
            try:
                fd = os.open(path, os.O_RDWR | flags)
            except PermissionError:
                fd = os.open(path, os.O_RDONLY | flags)
                writable = False
        except FileNotFoundError:
            raise ValueError(f"key: no shared-memory object {plain!r}") from None
        except PermissionError:
            raise ValueError(f"key: shared-memory object {plain!r}: permission denied") from None
        except OSError as exc:  # ELOOP: a symbolic link; anything else the open refuses
            raise ValueError(f"key: shared-memory object {plain!r} cannot be opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"key: {plain!r} is not a shared-memory object")
            if offset + byte_size > st.st_size:
                raise ValueError(f"offset + byte_size: {offset} + {byte_size} = {offset + byte_size} bytes, past the "
                                 f"end of shared-memory object {plain!r} ({st.st_size} bytes)")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, prot, offset=page_start)
        except BaseException:
            os.close(fd)
            raise
        region = _Region(name, owner, SYSTEM, plain, offset, byte_size, 0, length, writable)
        region.fd, region.mmap = fd, mapping
        region.buf = memoryview(mapping)[offset - page_start:]
        return region

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
            raise ValueError(f"device_id: {device_id} is not a device of this server "
                             f"({', '.join(map(str, sorted(self.devices))) or 'none'})")
        raw_handle = bytes(raw_handle)
        if len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(f"raw_handle: {len(raw_handle)} bytes, but a cudaIpcMemHandle_t has "
                             f"{CUDA_IPC_HANDLE_BYTES}")
        nbytes = offset + byte_size
        with self._lock:
            self._reserve(owner, name, nbytes)
        try:
            region = self._open_cuda(name, owner, raw_handle, device_id, offset, byte_size)
        except BaseException:
            with self._lock:
                self._unreserve(owner, name, nbytes)
            raise
        return self._commit(region, nbytes)

    def _open_cuda(self, name, owner, raw_handle, device_id, offset, byte_size) -> _Region:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device_id: this server has no CUDA device; register system shared memory instead")
        if device_id >= torch.cuda.device_count():
            raise ValueError(f"device_id: {device_id}, but this server sees {torch.cuda.device_count()} CUDA "
                             f"device(s)")
        runtime, driver = _cuda_bindings()
        success = runtime.cudaError_t.cudaSuccess
        with torch.cuda.device(device_id):  # creates torch's (primary) context on the device
            err, = runtime.cudaSetDevice(device_id)
            if err != success:
                raise ValueError(f"device_id: cudaSetDevice({device_id}) failed: {_cuda_error_text(runtime, err)}")
            handle = runtime.cudaIpcMemHandle_t()
            handle.reserved = raw_handle
            err, ptr = runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            if err != success:
                raise ValueError(f"raw_handle: cudaIpcOpenMemHandle failed: {_cuda_error_text(runtime, err)} "
                                 f"(a handle from another host, another device, this same process, or an "
                                 f"allocation already freed does not open)")
            base = int(ptr)

            def close() -> None:
                with torch.cuda.device(device_id):
                    runtime.cudaIpcCloseMemHandle(base)

            try:
                ok = driver.CUresult.CUDA_SUCCESS
                err, owner_device = driver.cuPointerGetAttribute(
                    driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, base)
                if err == ok and int(owner_device) != device_id:
                    raise ValueError(f"device_id: {device_id}, but the allocation of raw_handle is on device "
                                     f"{int(owner_device)}")
                err, _start, size = driver.cuMemGetAddressRange(base)
                if err != ok:
                    raise ValueError(f"raw_handle: cuMemGetAddressRange failed on the opened allocation: "
                                     f"{_cuda_error_text(runtime, err)}")
                size = int(size)
                if offset + byte_size > size:
                    raise ValueError(f"offset + byte_size: {offset} + {byte_size} = {offset + byte_size} bytes, "
                                     f"past the end of the allocation of raw_handle ({size} bytes)")
                device_bytes = torch.as_tensor(_CudaArray(base, offset + byte_size),
                                               device=torch.device("cuda", device_id))
            except BaseException:
                close()
                raise
        region = _Region(name, owner, CUDA, "", offset, byte_size, device_id, offset + byte_size, True)
        region.base_ptr, region.device_bytes, region.closer = base, device_bytes, close
        return region

    # -------------------------------------------------------------------- status, unregister

    def status(self, name: str = "", owner=None, kind: str | None = None) -> list[RegionInfo]:
        """The regions of ``owner`` (of ``kind``, when given), sorted by name; ``name`` not empty:
        that one, or :class:`RegionNotFound`."""
        kinds = _kinds(kind)
        with self._lock:
            if name:
                region = self._regions.get((owner, name))
                if region is None or region.kind not in kinds:
                    what = f"{kind} region" if kind else "region"
                    raise RegionNotFound(f"name: no {what} {_shown(name)} registered")
                return [region.info()]
            return sorted((r.info() for (o, _), r in self._regions.items() if o == owner and r.kind in kinds),
                          key=lambda info: info.name)

    def unregister(self, name: str = "", owner=None, kind: str | None = None) -> list[str]:
        """Forget region ``name`` of ``owner`` (every region of ``owner`` when ``name`` is empty;
        only those of ``kind`` when given); returns the names forgotten, sorted (none for a name
        not registered). A leased region stays mapped until its last lease is released."""
        kinds = _kinds(kind)
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

    def close(self) -> None:
        """Unregister every owner's regions (leased ones stay mapped until released)."""
        for owner in {o for o, _ in list(self._regions)}:
            self.unregister("", owner)

    def _forget(self, regions: Sequence[_Region]) -> None:
        """Take ``regions`` off the counters (under the lock), before closing them."""
        for region in regions:
            self._mapped_count -= 1
            self._mapped_bytes -= region.mapped_bytes

    # ---------------------------------------------------------------------------- resolving

    def resolve(self, ref, dtype, shape: Sequence[int], owner=None, field: str = "tensor", *,
                writable: bool = False, exact: bool = True) -> RegionLease:
        """A lease on the slice ``ref`` (a ``logitserve.v1.RegionRef``, or anything with
        ``region``, ``offset`` and ``byte_size``) of one of ``owner``'s regions, holding a tensor
        of torch ``dtype`` and ``shape``; ``field`` names the tensor in messages (``logits``,
        ``output_regions[token_ids]``). ``writable``: the slice will be written (an output).
        ``exact``: byte_size must be the tensor's size; False: at least it (Triton's rule for
        outputs), the view covering the tensor's bytes from offset.

        Raises :class:`RegionNotFound` (no such region of ``owner``) or ``ValueError`` naming
        ``field`` and the rule (range past the region's end, misaligned for ``dtype``, byte_size
        not the tensor's, a read-only region written, a system object shrunk since).
        """
        name, offset, byte_size = ref.region, int(ref.offset), int(ref.byte_size)
        itemsize = dtype.itemsize
        count = math.prod(shape)
        need = count * itemsize
        if byte_size != need and (exact or byte_size < need):
            rule = "" if exact else "at least "
            raise ValueError(f"{field}.region.byte_size: {byte_size}, but shape {list(shape)} of "
                             f"{str(dtype).removeprefix('torch.')} needs {rule}{need} bytes")
        with self._lock:
            region = self._regions.get((owner, name))
            if region is None:
                raise RegionNotFound(f"{field}.region: no region {_shown(name)} registered (by this caller)")
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
            if region.kind == SYSTEM:
                size = os.fstat(region.fd).st_size
                if size < region.object_end:
                    raise ValueError(f"{field}.region: the shared-memory object {region.key!r} of region {name!r} "
                                     f"shrank to {size} bytes since it was registered "
                                     f"({region.object_end} needed); unregister it")
                view = region.buf[offset:offset + need]
            else:
                start = region.offset + offset
                view = region.device_bytes[start:start + need].view(dtype).view(tuple(shape))
            region.leases += 1
        return RegionLease(self, region, view, dtype, tuple(shape))

    def _release(self, region: _Region) -> None:
        with self._lock:
            region.leases -= 1
            closing = not region.registered and region.leases == 0
            if closing:
                self._forget((region,))
        if closing:
            region.close()
