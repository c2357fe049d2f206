"""System shared memory: a POSIX shared-memory object mapped by the server itself (``os.open`` +
``mmap``), never through ``multiprocessing.shared_memory``, whose resource tracker would unlink a
client's object when the server's process ends. Opened with ``O_NOFOLLOW | O_NONBLOCK`` and
refused unless a regular file: nothing outside the shared-memory namespace is ever opened."""

from __future__ import annotations

import mmap
import os
import stat

from .names import SYSTEM
from .pinning import pin
from .region import Region


def map_system(shm_dir: str, name, owner, plain, offset, byte_size, page_start, length, pinned: bool) -> Region:
    """Map ``[page_start, page_start + length)`` of the object ``plain`` in ``shm_dir`` as region ``name``
    (its bytes from ``offset``, ``byte_size`` long), page-locked with ``pinned`` (server/regions/pinning.py);
    ``ValueError`` naming the key when it cannot be."""
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
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapping = mmap.mmap(fd, length, mmap.MAP_SHARED, prot, offset=page_start)
    except BaseException:
        os.close(fd)
        raise
    region = Region(name, owner, SYSTEM, plain, offset, byte_size, 0, length, writable)
    region.fd, region.mmap = fd, mapping
    if pinned:
        region.unpin = pin(mapping, writable, repr(name))
    region.buf = memoryview(mapping)[offset - page_start:]
    return region
