"""Room in ``/dev/shm`` for a same-host channel's message, reserved before the message is written.

iceoryx2 (0.10) keeps each port's messages in segments it creates under ``/dev/shm``
(``iox2_*.data``): ``ftruncate``d to their size and never filled, so their pages are taken from
the tmpfs only when first written. On a full tmpfs that first write is a SIGBUS, not an error:
a 64 MiB answer in Docker's default 64 MiB ``/dev/shm`` killed the server (exit -7), and an
80 MiB request its client. So whoever writes a message into a loaned slice (the server its
answer, the client its request) first

1. checks, for a slice larger than a port's first slots (one that may make iceoryx2 create a
   larger segment), that ``/dev/shm`` has room for it and :data:`HEADROOM_BYTES` more
   (:func:`check_room`): a clear refusal before iceoryx2 writes a new segment's header;
2. reserves the slice's pages (:func:`reserve`): ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14)
   allocates every page as a write would and answers EFAULT where a write would be a SIGBUS;
   older kernels get ``posix_fallocate`` on the segment's file, found in ``/proc/self/maps``.
   A failed reservation gives back the pages it took (wholly inside the slice: no other
   message lies there).

What this guarantees: the bytes of a message are never written to an unreserved page, so a
message that does not fit ends as :class:`NoRoom` (the server answers RESOURCE_EXHAUSTED naming
``/dev/shm``, the client sends the request by gRPC), however large it is and whoever else fills
``/dev/shm`` meanwhile. What it does not: iceoryx2's own writes (a channel's connection, about
50 KB per ``--max-channels`` when a client's ports are made; a new segment's header when a
loan grows one) are made by iceoryx2 with nothing reserved. :func:`check_room` before them
(the server's at OpenChannel, and step 1) makes them fail cleanly when ``/dev/shm`` is short,
but another process filling it between that check and iceoryx2's write can still end a process
by SIGBUS; a tmpfs sized for the channels (docs/SERVICE.md) leaves no such window.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

SHM_DIR = "/dev/shm"
# Free bytes a large message must leave in /dev/shm: room for what iceoryx2 itself writes when
# the loan grows a port's segment (its header and allocator bookkeeping: a few KB for a port's
# few slots) and for the next small messages.
HEADROOM_BYTES = 64 << 10

_PAGE = mmap.PAGESIZE
_MADV_REMOVE = 9
_MADV_POPULATE_WRITE = 23  # Linux 5.14; EINVAL before
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_populate_write = True  # False once the kernel has said it lacks MADV_POPULATE_WRITE


class NoRoom(Exception):
    """A message that ``/dev/shm`` has no room for; its text names ``/dev/shm`` and the sizes."""


def free_bytes() -> int:
    """Bytes of ``/dev/shm`` this process may still take."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def check_room(what: str, size: int, more: int = HEADROOM_BYTES) -> None:
    """NoRoom unless ``/dev/shm`` has ``size`` + ``more`` bytes free (a check, not a reservation:
    another process may take them next)."""
    free = free_bytes()
    if free < size + more:
        raise NoRoom(f"{what}: {size} bytes do not fit {SHM_DIR} ({free} bytes free, {more} kept for the channel's "
                     f"own bookkeeping)")


def reserve(what: str, address: int, size: int) -> None:
    """Allocate the pages of the ``size`` bytes at ``address`` (a slice of an iceoryx2 segment,
    mapped shared and writable here) before they are written; NoRoom where they do not fit, with
    the pages this call took given back."""
    global _populate_write
    if size <= 0:
        return
    start = address - address % _PAGE
    length = address + size - start
    if _populate_write:
        if _libc.madvise(start, length, _MADV_POPULATE_WRITE) == 0:
            return
        error = ctypes.get_errno()
        if error != errno.EINVAL:  # EFAULT (a write would have been a SIGBUS) or ENOMEM
            _give_back(address, size)
            raise NoRoom(f"{what}: {size} bytes do not fit {SHM_DIR} ({free_bytes()} bytes free): "
                         f"{os.strerror(error)} while reserving them")
        _populate_write = False
    fallocate_mapped(what, start, length)


def _give_back(address: int, size: int) -> None:
    """Free the pages wholly inside the slice (a failed reservation's): only this message was to
    lie there, so nothing is lost; the tmpfs has them back."""
    first = -(-address // _PAGE) * _PAGE
    end = (address + size) // _PAGE * _PAGE
    if end > first:
        _libc.madvise(first, end - first, _MADV_REMOVE)


def fallocate_mapped(what: str, start: int, length: int) -> None:
    """``posix_fallocate`` the file range mapped at ``start`` (page-aligned) for ``length`` bytes:
    the reservation of kernels without MADV_POPULATE_WRITE. A tmpfs gives back what a failed
    fallocate took."""
    path, offset = _mapped_file(start)
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        raise NoRoom(f"{what}: {length} bytes do not fit {SHM_DIR} ({free_bytes()} bytes free): "
                     f"{exc.strerror} while reserving them") from None
    finally:
        os.close(fd)


def _mapped_file(address: int) -> tuple[str, int]:
    """The file mapped at ``address`` in this process, and the offset in it of ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, _, high = fields[0].partition("-")
            if int(low, 16) <= address < int(high, 16) and len(fields) == 6:
                return fields[5].rstrip("\n"), int(fields[2], 16) + address - int(low, 16)
    raise NoRoom(f"no file is mapped at {address:#x}: its pages cannot be reserved in {SHM_DIR}")
