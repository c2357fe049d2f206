"""Page-locked regions whose object shrinks (issue 32, item 3, on a CUDA server): which copy of a
region's input can fault, and what each costs.

    python -m bench.pinned_shrink          # on a GPU machine, about 20 s

A client may truncate a registered object at any time; the pages it had stay locked (the driver
holds them) but the server's mapping of them is gone, so a CPU touch faults (SIGBUS). Part 1
copies a page-locked input to the device after its object was truncated, once by
``Tensor.to(device, non_blocking=True)`` (the copy engine, through the driver) and once by
``kernels.copy.copy_by_kernel`` (the GPU reading the pages through their device address), each
in a process of its own, and reports how each process ended. Part 2 times both copies on the
device (CUDA events, median of 50) at the sizes a call moves.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20)


def _pinned(nbytes: int):
    """A page-locked tensor over a fresh shared-memory object: (tensor, fd, unpin)."""
    import torch

    from logitserve.server.regions.pinning import pin

    fd = os.memfd_create("pinned-shrink")
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes)
    unpin = pin(mapping, True, "bench")
    assert unpin is not None, "cudaHostRegister failed"
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    host.fill_(7)
    return host, fd, unpin


def shrunk(method: str, nbytes: int) -> None:
    """In a process of its own: truncate, then copy by ``method``; exit 0 if nothing faulted."""
    import torch

    from logitserve.kernels.copy import copy_by_kernel

    host, fd, _ = _pinned(nbytes)
    os.ftruncate(fd, 0)
    if method == "dma":
        out = host.to("cuda", non_blocking=True)
    else:
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        copy_by_kernel(host, out)
    torch.cuda.synchronize()
    print(f"{method} {nbytes}: no fault; first byte {int(out[0])}")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--shrunk":
        shrunk(sys.argv[2], int(sys.argv[3]))
        return
    import torch

    from logitserve.kernels.copy import copy_by_kernel

    print("| copy after the object shrank | bytes | exit |")
    print("|---|---:|---:|")
    for method in ("dma", "kernel"):
        for nbytes in (4 << 10, 1 << 20):
            code = subprocess.run([sys.executable, "-m", "bench.pinned_shrink", "--shrunk", method, str(nbytes)],
                                  capture_output=True).returncode
            print(f"| {method} | {nbytes} | {code}{' (SIGBUS)' if code == -7 else ''} |")

    print("\n| bytes | DMA (.to) us | kernel copy us |")
    print("|---:|---:|---:|")
    for nbytes in SIZES:
        host, fd, unpin = _pinned(nbytes)
        out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        times = {}
        for method in ("dma", "kernel"):
            samples = []
            for i in range(60):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if method == "dma":
                    out.copy_(host, non_blocking=True)
                else:
                    copy_by_kernel(host, out)
                end.record()
                end.synchronize()
                if i >= 10:
                    samples.append(start.elapsed_time(end) * 1000)
            times[method] = sorted(samples)[len(samples) // 2]
        print(f"| {nbytes} | {times['dma']:.1f} | {times['kernel']:.1f} |")
        del host
        unpin()
        os.close(fd)


if __name__ == "__main__":
    main()
