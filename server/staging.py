"""Moving a launch's inputs to the device in one transfer, and its outputs back without a wait.

A batch's inputs are many small host tensors: each request's rows (viewing its message's bytes)
and the per-row parameters. Copied one by one from pageable memory, each is a synchronous
transfer through the driver's staging buffer: 98 us for one 1x128256 bfloat16 row and 4 ms for
64 of them on the H100 host (bench/service_breakdown.py). :class:`Staging` packs them into one
page-locked buffer (a memcpy each) and sends that with one asynchronous copy; :func:`to_host`
queues a result's copy back into page-locked memory, read once the launch's stream is done
(:meth:`.device.DeviceHandle.run` waits for it). On the CPU both are plain copies.
"""

from __future__ import annotations

import torch

from .tensors import pack

# Every part starts on a 16-byte boundary: Triton specialises on a pointer's 16-byte alignment,
# so an unaligned part would compile (and warm up) a second kernel.
ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """Host tensors and Python numbers laid out in one buffer; :meth:`to` copies it to a device.

        stage = Staging()
        stage.add([c.logits for c in calls])                    # one part: the pieces stacked on dim 0
        stage.add_values([0.8, 1.0, 0.9, 0.9], torch.float32, (2, 2))
        logits, params = stage.to(device)                       # the parts, in the order added

    Every torch call costs microseconds of host time (tens inside the busy server), so the
    parts are few: numbers are packed with ``struct``, not made into tensors one by one.
    """

    def __init__(self):
        self._parts: list[tuple[object, torch.Size, torch.dtype, int]] = []
        self._size = 0

    def add(self, pieces: list[torch.Tensor]) -> None:
        """One part: ``pieces`` (same dtype and trailing shape, rank >= 1) stacked along dim 0."""
        first = pieces[0]
        shape = torch.Size((sum(p.shape[0] for p in pieces), *first.shape[1:]))
        self._append(pieces, shape, first.dtype)

    def add_values(self, values: list, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """One part: ``values`` (Python numbers, C order) as a ``dtype`` tensor of ``shape``."""
        # A bytearray, not bytes: torch.frombuffer warns on read-only memory.
        self._append(bytearray(pack(values, dtype)), torch.Size(shape), dtype)

    def _append(self, source, shape: torch.Size, dtype: torch.dtype) -> None:
        self._parts.append((source, shape, dtype, self._size))
        self._size = _aligned(self._size + shape.numel() * dtype.itemsize)

    def to(self, device: torch.device) -> list[torch.Tensor]:
        pinned = device.type == "cuda"
        host = torch.empty(max(self._size, ALIGN), dtype=torch.uint8, pin_memory=pinned)
        for source, shape, dtype, offset in self._parts:
            if isinstance(source, bytearray):
                host[offset:offset + len(source)].copy_(torch.frombuffer(source, dtype=torch.uint8))
            elif len(source) == 1:
                _view(host, offset, shape, dtype).copy_(source[0])
            else:
                torch.cat(source, out=_view(host, offset, shape, dtype))
        # From page-locked memory the copy is asynchronous; the caching host allocator keeps the
        # buffer from reuse until the stream has read it.
        moved = host.to(device, non_blocking=True) if pinned else host
        return [_view(moved, offset, shape, dtype) for _, shape, dtype, offset in self._parts]


def _view(buffer: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return buffer[offset:offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: on CUDA an asynchronous copy into page-locked memory, valid once the
    current stream has finished; a CPU tensor as it is."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
