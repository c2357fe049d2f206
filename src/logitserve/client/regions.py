"""Client side of shared-memory regions: memory to share with the server, and the messages of the
``logitserve.v1.SharedMemory`` service.

System shared memory: :func:`shared_array` (numpy) and :func:`shared_tensor` (torch, CPU)
allocate a tensor in a new POSIX shared-memory object; :func:`shared_copy` places a copy of an
existing one there. Register the buffer, then write and read the tensor in place::

    buf = shared_array((8, 128256), "float32")        # buf.array: numpy over the shared bytes
    client.register_system("logits", buf)             # key and byte_size from the buffer
    buf.array[:] = logits                             # the server reads these very bytes
    ...
    client.unregister("logits"); buf.close(); buf.unlink()

CUDA memory: :func:`cuda_ipc_handle` gives the IPC handle of a torch CUDA tensor's allocation and
the tensor's offset inside it (torch's caching allocator places tensors inside larger
allocations, and a handle names the whole allocation, from its base)::

    client.register_cuda("logits", logits_cuda)       # a tensor, or a CudaIpcHandle, or raw bytes

Ordering: the caller's writes are complete before the call that reads them (synchronize the
stream that produced a CUDA tensor, e.g. ``torch.cuda.current_stream().synchronize()``).

The client's table of what it registered (found by address) is :mod:`.region_table`'s.

Needs numpy; torch only for :func:`shared_tensor` and torch inputs, cuda-python
(``cuda.bindings``, the ``cuda`` extra) only for :func:`cuda_ipc_handle`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import codec

SYSTEM = "system"
CUDA = "cuda"
_KIND_ENUMS = {None: pb.REGION_KIND_UNSPECIFIED, "": pb.REGION_KIND_UNSPECIFIED, SYSTEM: pb.REGION_KIND_SYSTEM,
               CUDA: pb.REGION_KIND_CUDA}
_KIND_NAMES = {pb.REGION_KIND_SYSTEM: SYSTEM, pb.REGION_KIND_CUDA: CUDA}
CUDA_IPC_HANDLE_BYTES = 64
# The RPCs of the SharedMemory service (the others are LogitServe's).
SHARED_MEMORY_RPCS = frozenset(("RegisterSystemSharedMemory", "RegisterCudaSharedMemory", "SharedMemoryStatus",
                                "UnregisterSharedMemory"))


# ------------------------------------------------------------------------- system shared memory


class SharedHostBuffer:
    """A tensor in a POSIX shared-memory object this process created.

    ``key`` is the object's name (what ``register_system`` takes), ``byte_size`` the tensor's
    bytes, ``shm`` the ``multiprocessing.shared_memory.SharedMemory``, and ``array`` (numpy) or
    ``tensor`` (torch, CPU) the tensor over its bytes. :meth:`close` unmaps it here (drop every
    view of it first), :meth:`unlink` removes the object (after the server unregistered it, or it
    keeps it mapped until then); a ``with`` block does both.
    """

    def __init__(self, shm: shared_memory.SharedMemory, byte_size: int, array=None, tensor=None):
        self.shm, self.byte_size, self.array, self.tensor = shm, byte_size, array, tensor
        self.key = shm.name.lstrip("/")

    def ref(self, region: str, offset: int = 0, byte_size: int | None = None) -> pb.RegionRef:
        """A reference to ``byte_size`` bytes (default: the rest) from ``offset`` of this buffer,
        registered as ``region`` from its start."""
        return pb.RegionRef(region=region, offset=offset,
                            byte_size=self.byte_size - offset if byte_size is None else byte_size)

    def close(self) -> None:
        self.array = self.tensor = None
        try:
            self.shm.close()
        except BufferError:
            raise BufferError(f"shared-memory object {self.key!r}: views of its array or tensor are still alive; "
                              f"delete them before close()") from None

    def unlink(self) -> None:
        self.shm.unlink()

    def __enter__(self) -> "SharedHostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self.unlink()

    def __repr__(self) -> str:
        return f"SharedHostBuffer(key={self.key!r}, byte_size={self.byte_size})"


def _create(nbytes: int, key: str | None) -> shared_memory.SharedMemory:
    if nbytes <= 0:
        raise ValueError(f"shape: a region holds at least one byte, got {nbytes}")
    return shared_memory.SharedMemory(name=key, create=True, size=nbytes)


def shared_array(shape, dtype="float32", *, key: str | None = None) -> SharedHostBuffer:
    """A zeroed numpy array of ``shape`` and ``dtype`` in a new shared-memory object (named
    ``key``, or a fresh name)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in np.atleast_1d(shape)) if not isinstance(shape, int) else (shape,)
    nbytes = math.prod(shape) * dtype.itemsize
    shm = _create(nbytes, key)
    array = np.ndarray(shape, dtype=dtype, buffer=shm.buf[:nbytes])
    return SharedHostBuffer(shm, nbytes, array=array)


def shared_tensor(shape, dtype=None, *, key: str | None = None) -> SharedHostBuffer:
    """A zeroed torch CPU tensor of ``shape`` and ``dtype`` (default float32, bfloat16 included)
    in a new shared-memory object (named ``key``, or a fresh name)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    shm = _create(nbytes, key)
    tensor = torch.frombuffer(shm.buf, dtype=dtype, count=math.prod(shape)).view(shape)
    return SharedHostBuffer(shm, nbytes, tensor=tensor)


def shared_copy(x, *, key: str | None = None) -> SharedHostBuffer:
    """A copy of ``x`` (numpy array or torch tensor, copied once) in a new shared-memory object:
    the buffer's ``tensor`` for torch, ``array`` otherwise."""
    if codec.is_torch(x):
        buf = shared_tensor(tuple(x.shape), x.dtype, key=key)
        buf.tensor.copy_(x)
        return buf
    x = np.asarray(x)
    buf = shared_array(x.shape, x.dtype.newbyteorder("<") if x.dtype.byteorder == ">" else x.dtype, key=key)
    buf.array[...] = x
    return buf


# ---------------------------------------------------------------------------------- CUDA memory


@dataclass(frozen=True)
class CudaIpcHandle:
    """What ``register_cuda`` sends for a CUDA tensor: the IPC handle of its allocation (64
    bytes), the device, the tensor's offset inside the allocation and its size in bytes; and,
    from :func:`cuda_ipc_handle`, the allocation's base address in this process (what lets a
    client find tensors inside the region: None when unknown)."""

    raw_handle: bytes
    device_id: int
    offset: int
    byte_size: int
    base_ptr: int | None = None


def _cuda_bindings():
    try:
        from cuda.bindings import driver, runtime
    except ImportError as exc:
        raise ImportError("CUDA regions need cuda-python: pip install 'logitserve[cuda]' (cuda-bindings)") from exc
    return runtime, driver


def handle_bytes(handle) -> bytes:
    """The 64 bytes of a ``cudaIpcMemHandle_t`` from cuda.bindings."""
    reserved = handle.reserved
    raw = bytes(reserved) if isinstance(reserved, (bytes, bytearray)) else bytes(int(b) & 0xFF for b in reserved)
    if len(raw) != CUDA_IPC_HANDLE_BYTES:
        raise ValueError(f"cudaIpcMemHandle_t: {len(raw)} bytes, expected {CUDA_IPC_HANDLE_BYTES}")
    return raw


def cuda_ipc_handle(tensor) -> CudaIpcHandle:
    """The IPC handle, device, offset and size of a contiguous torch CUDA tensor.

    The handle is taken on the base of the tensor's allocation (``cuMemGetAddressRange``) and the
    offset is the tensor's distance from it. Memory from torch's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) has no IPC handle.
    """
    if not codec.is_torch(tensor) or not tensor.is_cuda:
        raise TypeError("cuda_ipc_handle: needs a torch CUDA tensor")
    if not tensor.is_contiguous():
        raise ValueError("cuda_ipc_handle: the tensor must be contiguous (call .contiguous() first)")
    import torch

    runtime, driver = _cuda_bindings()
    ptr = tensor.data_ptr()
    with torch.cuda.device(tensor.device):
        err, base, size = driver.cuMemGetAddressRange(ptr)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemGetAddressRange failed: {err}")
        base = int(base)
        err, handle = runtime.cudaIpcGetMemHandle(base)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaIpcGetMemHandle failed: {err} (memory from expandable segments or "
                               f"cudaMallocAsync pools has no IPC handle)")
    return CudaIpcHandle(handle_bytes(handle), tensor.device.index, ptr - base, tensor.numel() * tensor.element_size(),
                         base)


# ------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class RegionStatus:
    """One region as ``shared_memory_status`` reports it: ``name`` the caller's name for a region
    registered through the client, ``server_name`` the server's (:mod:`.region_names`)."""

    name: str
    kind: str  # "system" or "cuda"
    key: str
    offset: int
    byte_size: int
    device_id: int
    in_use: int
    server_name: str = ""


def region_ref(region: str, byte_size: int, offset: int = 0) -> pb.RegionRef:
    return pb.RegionRef(region=region, offset=offset, byte_size=byte_size)


def region_tensor(region: str, dtype, shape, offset: int = 0) -> pb.Tensor:
    """A Tensor message of ``dtype`` (a wire dtype, a name such as ``"bfloat16"``, or a numpy /
    torch dtype) and ``shape`` whose elements are at ``offset`` of ``region``."""
    wire = _wire_dtype(dtype)
    shape = [int(n) for n in shape]
    byte_size = math.prod(shape) * codec.ITEMSIZE[wire]
    return pb.Tensor(dtype=wire, shape=shape, region=region_ref(region, byte_size, offset))


def _wire_dtype(dtype) -> int:
    if isinstance(dtype, int) and dtype in codec.ITEMSIZE:
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in codec._BY_NAME:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    try:
        return codec._BY_NAME[name]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no wire dtype") from None


def kind_enum(kind: str | None) -> int:
    try:
        return _KIND_ENUMS[kind]
    except KeyError:
        raise ValueError(f"kind: {kind!r} is not 'system', 'cuda' or None") from None


def system_request(name: str, key, byte_size: int | None, offset: int) -> pb.RegisterSystemSharedMemoryRequest:
    """``key`` a shared-memory object's name or a :class:`SharedHostBuffer` (whose byte_size is
    the default)."""
    if isinstance(key, SharedHostBuffer):
        byte_size = key.byte_size - offset if byte_size is None else byte_size
        key = key.key
    if byte_size is None:
        raise TypeError("register_system: byte_size is required with a key")
    return pb.RegisterSystemSharedMemoryRequest(name=name, key=key, offset=offset, byte_size=byte_size)


def cuda_request(name: str, handle, device_id: int | None, byte_size: int | None,
                 offset: int) -> pb.RegisterCudaSharedMemoryRequest:
    """``handle`` a torch CUDA tensor, a :class:`CudaIpcHandle` or the 64 raw bytes (with
    ``device_id`` and ``byte_size``); a tensor or CudaIpcHandle brings its own offset, to which
    ``offset`` adds."""
    if codec.is_torch(handle):
        handle = cuda_ipc_handle(handle)
    if isinstance(handle, CudaIpcHandle):
        return pb.RegisterCudaSharedMemoryRequest(
            name=name, raw_handle=handle.raw_handle, device_id=handle.device_id if device_id is None else device_id,
            byte_size=handle.byte_size - offset if byte_size is None else byte_size, offset=handle.offset + offset)
    if device_id is None or byte_size is None:
        raise TypeError("register_cuda: device_id and byte_size are required with a raw handle")
    return pb.RegisterCudaSharedMemoryRequest(name=name, raw_handle=bytes(handle), device_id=device_id,
                                              byte_size=byte_size, offset=offset)


def status_result(msg: pb.SharedMemoryStatusResponse) -> list[RegionStatus]:
    """The regions of a status answer, under the server's names."""
    return [RegionStatus(r.name, _KIND_NAMES.get(r.kind, str(r.kind)), r.key, r.offset, r.byte_size, r.device_id,
                         r.in_use, r.name) for r in msg.regions]


def registered(msg) -> None:
    return None
