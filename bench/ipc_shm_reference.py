"""A hand-written same-host channel, the reference point of ``bench.ipc_candidates`` only.

Two slots in ``multiprocessing.shared_memory`` (requests, replies), each a sequence number and a
64-byte payload, polled for a bounded time; a byte in a FIFO wakes a peer that stopped polling
and sleeps in select(). Issue 35 asks for a kept IPC library rather than this: the figures show
how far each library's own machinery sits above the floor of shared memory and one syscall per
message, not a design to adopt.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import select
from multiprocessing import shared_memory

from bench.ipc_candidates import PAYLOAD_BYTES, poll_then_block


class _Slots(ctypes.Structure):
    """Slot 0 carries requests, slot 1 replies; a message is in when its sequence number is."""
    _fields_ = [("seq", ctypes.c_uint64 * 2), ("payload", (ctypes.c_char * PAYLOAD_BYTES) * 2)]


@contextlib.contextmanager
def shm_endpoint(directory: str, side: str, poll_ns: int):
    """Each side numbers its messages 1, 2, ... and expects its peer's in turn. The writer stores
    the payload, then the number (an aligned 8-byte store): under x86's total store order a reader
    that sees the number sees the payload. x86 only: the reasoning a kept library does for us. A
    wake byte follows every message; a full FIFO means a wake is pending, so writers never block."""
    server = side == "server"
    if server:
        for fifo in ("to_server", "to_client"):
            os.mkfifo(os.path.join(directory, fifo))
    shm = shared_memory.SharedMemory(os.path.basename(directory), create=server, size=ctypes.sizeof(_Slots))
    slots = _Slots.from_buffer(shm.buf)
    inbox, outbox = (0, 1) if server else (1, 0)
    # O_RDWR: opening a FIFO so does not wait for the other end (Linux).
    fds = [os.open(os.path.join(directory, f), os.O_RDWR | os.O_NONBLOCK) for f in ("to_server", "to_client")]
    wake_in, wake_out = fds if server else fds[::-1]
    sent, received = itertools.count(1), itertools.count(1)

    def send(payload: bytes) -> None:
        slots.payload[outbox].raw = payload
        slots.seq[outbox] = next(sent)
        with contextlib.suppress(BlockingIOError):
            os.write(wake_out, b"\0")

    def block() -> None:
        select.select([wake_in], [], [])
        with contextlib.suppress(BlockingIOError):
            os.read(wake_in, 4096)  # every pending wake at once

    def receive() -> bytes:
        seq = next(received)
        return poll_then_block(lambda: slots.payload[inbox].raw if slots.seq[inbox] == seq else None, block, poll_ns)

    try:
        yield send, receive
    finally:
        for fd in fds:
            os.close(fd)
        del slots  # a ctypes view pins the buffer: close() refuses while it lives
        shm.close()
        if server:
            shm.unlink()
