"""Page-locking a system region on a CUDA server (``cudaHostRegister``, once, at registration).

A pageable region reaches the device in two copies: the CPU copies its bytes into a page-locked
staging buffer, then the copy engine moves that buffer. Page-locked where it is mapped, the region
is read by the copy engine directly (one DMA copy per call, no CPU copy): at 64 x 128256 float32
the CPU copy alone cost more than the rest of the call. Where CUDA refuses (no device memory
mapping for this range, a locked-memory limit), the region is left pageable and its calls are
staged as before: slower, never wrong.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

log = logging.getLogger("logitserve.regions")

# cudaHostRegister flags (CUDA runtime API): usable from every context, with a device address
# (the host's own under unified addressing), and read only where the object was opened so.
_PORTABLE, _MAPPED, _READ_ONLY = 0x01, 0x02, 0x08


def pin(mapping: mmap.mmap, writable: bool, what: str):
    """Page-lock the whole of ``mapping``; the function that undoes it (call it before the
    mapping closes), or None where CUDA refuses."""
    import torch

    cudart = torch.cuda.cudart()
    view = np.frombuffer(mapping, dtype=np.uint8)  # only for the address: dropped at once, so the
    ptr, size = view.ctypes.data, view.nbytes       # mapping can still close
    del view
    err = cudart.cudaHostRegister(ptr, size, _PORTABLE | _MAPPED | (0 if writable else _READ_ONLY))
    if err != cudart.cudaError.success:
        log.warning("region %s: cudaHostRegister of %d bytes failed (%s); its tensors are staged", what, size,
                    cudart.cudaGetErrorString(err))
        return None

    def unpin() -> None:
        cudart.cudaHostUnregister(ptr)

    return unpin
