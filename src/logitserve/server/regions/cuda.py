"""CUDA memory: an allocation opened from its IPC handle through cuda-python (``cuda.bindings``,
the ``cuda`` extra, imported when a CUDA region is registered, not before)."""

from __future__ import annotations

from .names import CUDA
from .region import Region

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



def open_cuda(name, owner, raw_handle, device_id, offset, byte_size) -> Region:
    """Open the allocation of ``raw_handle`` on ``device_id`` and make ``[offset, offset + byte_size)``
    of it region ``name``; ``ValueError`` with the CUDA error when it cannot be."""
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
            # The runtime's pointer attributes, not the driver's DEVICE_ORDINAL: on a 2-GPU H200
            # host that answered 0 for memory on device 1 (also in the process that allocated it),
            # refusing every region of a GPU but the first.
            err, attributes = runtime.cudaPointerGetAttributes(base)
            owner_device = attributes.device if err == success else device_id
            if int(owner_device) != device_id:
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
    region = Region(name, owner, CUDA, "", offset, byte_size, device_id, offset + byte_size, True)
    region.base_ptr, region.device_bytes, region.closer = base, device_bytes, close
    # Device addresses are unique in the process: two names over one allocation (the same handle
    # opens at the same address) overlap where their address ranges do.
    region.memory = (CUDA, device_id)
    return region

