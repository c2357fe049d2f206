"""Reading and writing a system region's bytes through its object's descriptor, never through a
mapping, so that an object its client shrinks cannot fault the server.

A POSIX shared-memory object belongs to its client, who may ``ftruncate`` it at any moment. Bytes
of a mapping past the object's new end fault (SIGBUS) when touched, and no check made before a
launch can close the window between the check and the touch: the server died so (exit -7) with
an input and with an output region (issue 32). Through the descriptor nothing can fault:
``os.preadv`` reads the bytes into the server's own memory (a read short of the slice's end means
the object shrank: the call is answered with an error), and ``os.pwritev`` writes an output (after
a size check, so that a shrunk object is answered with an error rather than grown back).

On the CPU the kernels then read the server's copy (staged like a request's bytes). For Sample's
64 x 32000 float32 logits (8.2 MB) the read took 0.8 ms (about 10 GB/s) on the 2-core CPU machine
of 2026-11-27, within the noise of the call's 131 ms there (p50 131.5 ms before, 132.0 after,
bytes path control 133.7 / 133.1). On a CUDA server a page-locked region
(server/regions/pinning.py) is read and written by the device alone, by kernels over pages that
``cudaHostRegister`` holds (a truncation takes them from the object, not from the device, and
the CPU never touches them, so nothing faults): :meth:`SystemSlice.pinned_tensor` gives the
device its host tensor, which no CPU code reads or writes; the CPU reads and writes even such a
region through the descriptor.
"""

from __future__ import annotations

import os

import torch


def shrunk_error(field: str, region, size: int) -> ValueError:
    """The error of a call whose region's object is now ``size`` bytes, under the region's end."""
    return ValueError(f"{field}.region: the shared-memory object {region.key!r} of region {region.name!r} shrank to "
                      f"{size} bytes, under the {region.object_end} the region needs (a client must not shrink a "
                      f"registered object); unregister it")


def detached_error(field: str, region) -> ValueError:
    """The error of a call on a page-locked region whose object was cut under it (pinning.py)."""
    return ValueError(f"{field}.region: the shared-memory object {region.key!r} of region {region.name!r} shrank "
                      f"while registered, and the device still holds the pages the region had, not the object's "
                      f"(a client must not shrink a registered object); unregister it and register it again")


def byte_view(data) -> memoryview:
    """``data`` (bytes-like, a numpy array, or a CPU torch tensor) as a flat byte view, copied only
    where it is not contiguous."""
    if isinstance(data, torch.Tensor):
        data = data.detach().to("cpu").contiguous().reshape(-1)
        return memoryview(data.view(torch.uint8).numpy()) if data.numel() else memoryview(b"")
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class SystemSlice:
    """``nbytes`` bytes of a system region from byte ``at`` of the region, for one lease; valid
    until the lease is released (then every use raises ``RuntimeError``).

    ``field`` names the tensor in errors (``logits``, ``output_regions[out]``). ``mapped`` is the
    slice's bytes in the page-locked mapping, only where the region is page-locked: for the device.
    """

    __slots__ = ("_region", "at", "nbytes", "field", "_mapped")

    def __init__(self, region, at: int, nbytes: int, field: str, mapped: memoryview | None = None):
        self._region, self.at, self.nbytes, self.field, self._mapped = region, at, nbytes, field, mapped

    def __len__(self) -> int:
        return self.nbytes

    @property
    def pinned(self) -> bool:
        return self._mapped is not None

    def _live(self):
        region = self._region
        if region is None:
            raise RuntimeError(f"{self.field}.region: lease already released")
        return region

    def read_into(self, buffer) -> None:
        """Fill ``buffer`` (a writable byte buffer of exactly ``nbytes``) with the slice's bytes;
        ``ValueError`` when the object has shrunk under them."""
        region = self._live()
        view = memoryview(buffer).cast("B")
        if len(view) != self.nbytes:
            raise ValueError(f"{self.field}: a buffer of {len(view)} bytes for a slice of {self.nbytes}")
        start, done = region.offset + self.at, 0
        while done < self.nbytes:  # a regular file reads short only at its end (then 0 bytes)
            got = os.preadv(region.fd, [view[done:]], start + done)
            if got == 0:
                raise shrunk_error(self.field, region, os.fstat(region.fd).st_size)
            done += got

    def read(self) -> bytearray:
        """The slice's bytes, copied."""
        out = bytearray(self.nbytes)
        self.read_into(out)
        return out

    def copy_out(self, dtype: torch.dtype, shape) -> torch.Tensor:
        """A new CPU tensor of ``dtype`` and ``shape`` holding the slice's bytes."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.nbytes:
            self.read_into(flat.numpy())
        return flat.view(dtype).view(tuple(shape))

    def pinned_tensor(self, dtype: torch.dtype, shape) -> torch.Tensor:
        """The page-locked slice as a host tensor over the mapping, for the device's own copies
        (kernels reading or writing host memory) only: no CPU code may read or write it (a shrunk
        object would fault it). ``RuntimeError`` where the region is not page-locked."""
        self._live()
        if self._mapped is None:
            raise RuntimeError(f"{self.field}.region: not mapped (not page-locked); read it with copy_out(), "
                               f"write it with write_from()")
        if not self.nbytes:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(self._mapped, dtype=dtype).view(tuple(shape))

    def write_from(self, data) -> None:
        """Write ``data`` (exactly ``nbytes``: bytes-like, a numpy array or a CPU torch tensor) into
        the slice; ``ValueError`` when the object has shrunk under it (checked first: a write past
        the end would grow the object back)."""
        region = self._live()
        view = byte_view(data)
        if len(view) != self.nbytes:
            raise ValueError(f"{self.field}: {len(view)} bytes to write into a slice of {self.nbytes}")
        size = os.fstat(region.fd).st_size
        if size < region.object_end:
            raise shrunk_error(self.field, region, size)
        start, done = region.offset + self.at, 0
        while done < self.nbytes:
            done += os.pwritev(region.fd, [view[done:]], start + done)

    def close(self) -> None:
        """End of the lease: no more reads or writes."""
        mapped, self._mapped, self._region = self._mapped, None, None
        if mapped is not None:
            try:
                mapped.release()
            except BufferError:  # a tensor made by pinned_tensor() is still alive: it keeps the bytes
                pass
