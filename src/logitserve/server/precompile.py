"""Warm-up's compilation spread over processes, so that a fresh GPU host serves within a minute.

Warm-up compiles one Triton kernel variant after another (server/engine/device.py ``warm_up``): on a
host whose Triton cache is empty that took 218 s (3 dtypes x 3 widths, H200), the compiler's own
passes holding one core. :func:`precompile` first runs the same warm-up cases in spawned
processes, each one (dtype, width) share of them on the same device with the same backend, so
that their kernels compile side by side into Triton's on-disk cache (``TRITON_CACHE_DIR``,
``--compile-cache-dir``); the server's own warm-up then loads each variant from the cache, and
captures its graphs, in seconds. The cases are the server's (``ops.warmup_calls``) and run through
the same launch path, so the variants compiled are the ones the server asks for. A share that
fails only costs its time: the server's warm-up compiles what is missing, as before.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from .logs import get_logger, log_event

log = get_logger("precompile")


def processes_for(requested: int | None, shares: int) -> int:
    """How many processes compile ``shares`` shares: ``requested`` (None: one a share, one of the
    cores this process may run on left over: a container's cpuset, not the node's count; 8
    processes for 9 shares took 70 s to SERVING on a 16-core H200 host, the ninth share compiled
    after the rest)."""
    if requested is not None:
        return min(requested, shares)
    return max(1, min(shares, len(os.sched_getaffinity(0)) - 1))  # the cores this process may use


def _compile_share(device: str, backend: str, dtype_name: str, width: int) -> float:
    """In a spawned process: the warm-up cases of one dtype and width, launched once each."""
    import torch  # noqa: F401 - after spawn: this process's own CUDA context

    from . import ops
    from .engine.device import DeviceHandle

    start = time.perf_counter()
    handle = DeviceHandle(device, backend, cuda_graphs=False)
    try:
        asyncio.run(handle.warm_up((getattr(torch, dtype_name),), ops.warmup_calls, (width,)))
    finally:
        handle.close()
    return time.perf_counter() - start


def precompile(device: str, backend: str, dtype_names: tuple[str, ...], widths: tuple[int, ...],
               processes: int | None) -> None:
    """Compile every (dtype, width) share of warm-up in its own spawned process, ``processes``
    at a time (:func:`processes_for`); logs one line when done."""
    shares = [(d, w) for d in dtype_names for w in widths]
    workers = processes_for(processes, len(shares))
    if workers <= 1 or not shares:
        return
    start = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_compile_share, device, backend, d, w) for d, w in shares]
        for (d, w), future in zip(shares, futures):
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - the server's own warm-up compiles what is missing
                failed += 1
                log_event(log, "precompile share failed", level=logging.WARNING, dtype=d, width=w, error=repr(exc))
    log_event(log, "precompiled", processes=workers, shares=len(shares), failed=failed,
              seconds=round(time.perf_counter() - start, 1))
