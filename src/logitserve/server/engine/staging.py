"""Moving a launch's inputs to the device in one transfer, and its outputs back without a wait.

A batch's inputs are many small host tensors: each request's rows (the bytes of its message)
and the per-row parameters. Copied one by one from pageable memory, each is a synchronous
transfer through the driver's staging buffer. :class:`Staging` packs them into one
page-locked buffer and sends that with one asynchronous copy; :func:`to_host` queues a result's
copy back into page-locked memory, read once the launch's stream is done
(:meth:`.device.DeviceHandle.run` waits for it). On the CPU both are plain copies.

The packing is byte copies through a memoryview, not torch calls: each torch call releases the
GIL, and in the busy server the launch thread then waits for the event loop to give it back. A
piece in a system region is read from its object straight into the buffer (``os.preadv``,
server/regions/access.py), never through a mapping: its client may shrink the object meanwhile,
and the read then fails the call (``ValueError``) where touching a mapping would fault.
"""

from __future__ import annotations

import math

import torch

from ..regions.access import SystemSlice
from ..tensors import HostTensor

# Every part starts on a 16-byte boundary: Triton specialises on a pointer's 16-byte alignment,
# so an unaligned part would compile (and warm up) a second kernel.
ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """Host tensors laid out in one buffer; :meth:`to` copies it to a device.

        stage = Staging()
        stage.add([c.logits for c in calls])                    # one part: the pieces stacked on dim 0
        stage.add([c.params for c in calls], rows=8, zero_padding=True)   # padded to 8 rows
        logits, params = stage.to(device)                       # the parts, in the order added

    or, into a buffer that outlives it (a CUDA graph's inputs, server/engine/graphs.py),
    ``stage.write(memoryview_of_host_buffer)`` and ``stage.views(device_buffer)``.
    """

    def __init__(self):
        # Each part: the byte strings to write one after the other, shape, dtype, byte offset.
        self._parts: list[tuple[list, tuple[int, ...], torch.dtype, int]] = []
        self._size = 0

    def add(self, pieces: list[HostTensor], rows: int | None = None, zero_padding: bool = False) -> None:
        """One part: ``pieces`` (same dtype and trailing shape, rank >= 1) stacked along dim 0.

        ``rows`` (at least the pieces' rows) pads the part to that many (a padded batch for a
        CUDA graph of that size): the rows past the pieces are zeros with ``zero_padding``, else
        left as the buffer holds them.
        """
        first = pieces[0]
        stacked = sum(p.shape[0] for p in pieces)
        shape = (stacked if rows is None else rows, *first.shape[1:])
        chunks = [p.data for p in pieces]
        if zero_padding and rows is not None and rows > stacked:
            chunks.append(bytes((rows - stacked) * math.prod(first.shape[1:]) * first.dtype.itemsize))
        self._parts.append((chunks, shape, first.dtype, self._size))
        self._size = _aligned(self._size + math.prod(shape) * first.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        """Size of the buffer the parts fill."""
        return max(self._size, ALIGN)

    @property
    def layout(self) -> tuple[tuple[tuple[int, ...], torch.dtype, int], ...]:
        """Each part's shape, dtype and byte offset: buffers of equal layout take each other's parts."""
        return tuple((shape, dtype, offset) for _, shape, dtype, offset in self._parts)

    def write(self, host: memoryview) -> None:
        """Copy the parts into ``host``, a writable byte view of at least :attr:`nbytes`;
        ``ValueError`` naming the region when a region's object has shrunk under its piece."""
        for chunks, _, _, offset in self._parts:
            for chunk in chunks:
                if type(chunk) is SystemSlice:
                    chunk.read_into(host[offset:offset + len(chunk)])
                else:
                    host[offset:offset + len(chunk)] = chunk
                offset += len(chunk)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The parts as tensors viewing ``buffer`` (uint8, laid out as :meth:`write` fills it)."""
        return [_view(buffer, offset, shape, dtype) for shape, dtype, offset in self.layout]

    def to(self, device: torch.device) -> list[torch.Tensor]:
        pinned = device.type == "cuda"
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.write(memoryview(host.numpy()))
        # From page-locked memory the copy is asynchronous; the caching host allocator keeps the
        # buffer from reuse until the stream has read it.
        return self.views(host.to(device, non_blocking=True) if pinned else host)


def _view(buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: on CUDA an asynchronous copy into page-locked memory, valid once the
    current stream has finished; a CPU tensor as it is."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
