"""Page-locking a system region on a CUDA server (``cudaHostRegister``, once, at registration).

A pageable region reaches the device in two copies: the CPU copies its bytes into a page-locked
staging buffer, then the copy engine moves that buffer. Page-locked where it is mapped, the region
is read by the device directly (one copy per call, by a kernel reading the locked pages, no CPU
copy): at 64 x 128256 float32 the CPU copy alone cost more than the rest of the call. Where CUDA refuses (no device memory
mapping for this range, a locked-memory limit), the region is left pageable and its calls are
staged as before: slower, never wrong.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading

import numpy as np

log = logging.getLogger("logitserve.regions")

# cudaHostRegister flags (CUDA runtime API): usable from every context, with a device address
# (the host's own under unified addressing), and read only where the object was opened so.
_PORTABLE, _MAPPED, _READ_ONLY = 0x01, 0x02, 0x08


def pin(mapping: mmap.mmap, writable: bool, what: str):
    """Page-lock the whole of ``mapping``; ``(unpin, still_attached)``, or None where CUDA refuses.
    Call ``unpin`` before the mapping closes; ``still_attached(start, end)`` tells whether bytes
    ``[start, end)`` of the mapping are still on the object's pages (see :func:`_present`)."""
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

    def still_attached(start: int, end: int) -> bool:
        return end <= start or (_present(ptr + start) and _present(ptr + end - 1))

    return unpin, still_attached


# A client that truncates its object takes the pages from the object, but the device keeps the
# ones it locked: from then on the region's device view is not the object's, even once the
# object grows back. Truncation also clears the server's page-table entries for those pages,
# and nothing sets them again, since the server's CPU never touches a locked region (its bytes
# go by kernels only): so a page not present in /proc/self/pagemap (bit 63) is a page
# cut off. A truncation cuts everything past its new size, so the last page of a slice tells.
_PAGE = mmap.PAGESIZE
_pagemap: int | None = None
_pagemap_lock = threading.Lock()


def _present(address: int) -> bool:
    global _pagemap
    with _pagemap_lock:
        if _pagemap is None:
            _pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    entry, = struct.unpack("<Q", os.pread(_pagemap, 8, address // _PAGE * 8))
    return bool(entry >> 63)
