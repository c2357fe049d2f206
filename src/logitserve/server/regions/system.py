"""System shared memory: a POSIX shared-memory object opened by the server itself (``os.open``),
never through ``multiprocessing.shared_memory``, whose resource tracker would unlink a client's
object when the server's process ends. Opened with ``O_NOFOLLOW | O_NONBLOCK`` and refused unless
a regular file: nothing outside the shared-memory namespace is ever opened.

The region is read and written through the descriptor (server/regions/access.py): a client may
shrink its object at any moment, and a mapping would then fault. It is mapped only to be
page-locked (``pinned``, a CUDA server), for the device's copies (kernels reading and writing
the locked pages, which no CPU code touches, so truncation cannot fault the server); where CUDA
refuses to page-lock it, the mapping goes at once.
"""

from __future__ import annotations

import mmap
import os
import stat

from .names import SYSTEM
from .pinning import pin
from .region import Region


def open_system(shm_dir: str, name, owner, plain, offset, byte_size, page_start, length, pinned: bool) -> Region:
    """Open the object ``plain`` in ``shm_dir`` as region ``name`` (its bytes from ``offset``,
    ``byte_size`` long); with ``pinned``, map ``[page_start, page_start + length)`` of it and
    page-lock that (server/regions/pinning.py). ``ValueError`` naming the key when it cannot be."""
    path = os.path.join(shm_dir, plain)
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
        region = Region(name, owner, SYSTEM, plain, offset, byte_size, 0, length, writable)
        region.fd, region.memory = fd, (SYSTEM, st.st_dev, st.st_ino)
        if pinned:
            _map_pinned(region, page_start, length)
    except BaseException:
        os.close(fd)
        raise
    return region


def _map_pinned(region: Region, page_start: int, length: int) -> None:
    """Map the region's pages and page-lock them; where CUDA refuses, unmap them again."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if region.writable else 0)
    mapping = mmap.mmap(region.fd, length, mmap.MAP_SHARED, prot, offset=page_start)
    try:
        pinned = pin(mapping, region.writable, repr(region.name))
    except BaseException:
        mapping.close()
        raise
    if pinned is None:
        mapping.close()
        return
    unpin, attached = pinned
    region.mmap, region.unpin = mapping, unpin
    # The registry asks in the object's offsets; the mapping starts at page_start of the object.
    region.still_attached = lambda start, end: attached(start - page_start, end - page_start)
    region.buf = memoryview(mapping)[region.offset - page_start:]
