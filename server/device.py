"""One device the kernels run on: torch device, backend, stream, executor thread, warm-up.

Every launch for a device goes through :meth:`DeviceHandle.run`, one at a time (an asyncio
lock, so warm-up and requests never interleave) on the handle's executor thread: the event
loop goes on receiving calls meanwhile, and they join the next launch, so batches grow with
load. On CUDA the launches run on the handle's own stream and the thread waits for them before
the results are read.

Launching from the event loop instead was measured on the H100 host (Sample 1x128256 bf16): a
lone call gained 0.5 ms (no thread hand-overs), but under load each launch held the loop for
its host work, no call could be received meanwhile, batches stayed at one request and 64 calls
in flight got 590 calls/s against 1,150 through the thread. Choosing per launch (the loop when
no call waits) fell into the same single-request pattern under load.

Ops launch through :meth:`DeviceHandle.launch`: on CUDA with the compiled backend a batch
replays a CUDA graph of its launch (server/graphs.py) unless it is too large for one; otherwise,
and on the CPU, it runs eagerly.
"""

from __future__ import annotations

import asyncio
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from logitserve import kernels

from .graphs import Launch, LaunchGraphs
from .logs import get_logger, log_event
from .staging import Staging, to_host

log = get_logger("device")

# Row widths warm-up compiles on the compiled backend: the vocabularies of Llama 2 (32000),
# Llama 3 (128256) and Qwen 2 (151936); block and chunk sizes are chosen per width, so each
# width a deployment serves should be here.
# Interpreted and torch backends compile nothing, so a tiny width only checks the path works.
TRITON_WARMUP_WIDTHS = (32000, 128256, 151936)
CPU_WARMUP_WIDTHS = (64,)

# The handle whose device and stream the current thread launches on (DeviceHandle._run).
_bound = threading.local()


class DeviceHandle:
    """A torch device with its backend, CUDA stream (None on the CPU) and launch thread."""

    def __init__(self, device: str, backend: str = "auto", cuda_graphs: bool = True):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device: {device} asked for, but torch sees no CUDA device")
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            if self.device.index >= torch.cuda.device_count():
                raise ValueError(f"device: {device} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
        self.backend = kernels.resolve_backend(backend, self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The interpreter and torch backends have no kernels a graph could capture.
        self.graphs = (LaunchGraphs(self.device, self.stream)
                       if cuda_graphs and self.stream is not None and self.backend == "triton" else None)
        self.name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                     else platform.processor() or platform.machine() or "cpu")
        self.warmed_dtypes: list[torch.dtype] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"logitserve-{self.device}")
        self._lock = asyncio.Lock()  # one launch at a time: warm-up and the batcher share the device

    @property
    def properties(self) -> dict:
        """What the device is: name, backend, and for a GPU its memory and SM count."""
        props = {"device": str(self.device), "name": self.name, "backend": self.backend}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            props.update(total_memory=p.total_memory, multi_processor_count=p.multi_processor_count,
                         capability=f"{p.major}.{p.minor}")
        return props

    @property
    def plan_cache_size(self) -> int:
        """Kernel descriptors cached in this process (every op's bounded cache)."""
        return kernels.plan_cache_size()

    def launch(self, key, rows: int, stage_for: Callable[[int], Staging], launch: Launch) -> list[np.ndarray]:
        """On the executor thread: an op's batched launch; its outputs on the host, as arrays.

        ``stage_for(n)`` lays out the batch's inputs for ``n`` rows (``n >= rows``: the rows past
        the batch are padding); ``launch`` maps their device tensors to output tensors (of dtypes
        numpy has) whose dim 0 is rows. Calls with equal ``key`` have the same launch (see
        server/graphs.py). Returns the outputs' first ``rows`` rows, valid once the stream is
        done (:meth:`run` waits for it).
        """
        if self.graphs is not None:
            outputs = self.graphs.run(key, rows, stage_for, launch)
            if outputs is not None:
                return outputs
        return [to_host(out).numpy() for out in launch(*stage_for(rows).to(self.device))]

    def _run(self, fn: Callable, *args):
        if self.stream is None:
            return fn(*args)
        if getattr(_bound, "handle", None) is not self:
            # Triton launches on the thread's current device and stream, not the tensors': make
            # them this handle's, once per thread (the executor's is this handle's alone), instead
            # of two context managers, a few torch calls each, around every launch.
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
            _bound.handle = self
        result = fn(*args)
        self.stream.synchronize()
        return result

    async def submit(self, fn: Callable, *args):
        """Run ``fn(*args)`` on this device's executor thread (and stream) without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, fn, *args)

    async def run(self, fn: Callable, *args):
        """Run the launch ``fn(*args)`` alone on this device's executor thread (and stream);
        return its result once the device has finished it."""
        async with self._lock:
            return await self.submit(fn, *args)

    async def warm_up(self, dtypes: tuple[torch.dtype, ...], make_cases: Callable) -> None:
        """Launch every case ``make_cases(dtype, widths)`` returns, logging progress per case.

        ``make_cases`` returns ``(label, call)`` pairs (server.ops.warmup_calls); each call runs
        through its op's ``run_batch`` exactly as a request would, compiling its kernels.
        """
        widths = TRITON_WARMUP_WIDTHS if self.backend == "triton" else CPU_WARMUP_WIDTHS
        plan = [(dtype, label, call) for dtype in dtypes for label, call in make_cases(dtype, widths)]
        start = time.perf_counter()
        for i, (dtype, label, call) in enumerate(plan, 1):
            t0 = time.perf_counter()
            await self.run(type(call).run_batch, [call], self)
            log_event(log, "warmup", step=f"{i}/{len(plan)}", dtype=str(dtype).removeprefix("torch."), op=label,
                      seconds=round(time.perf_counter() - t0, 3))
            if dtype not in self.warmed_dtypes and all(d != dtype for d, _, _ in plan[i:]):
                self.warmed_dtypes.append(dtype)
        log_event(log, "warmup done", device=str(self.device), backend=self.backend, cases=len(plan),
                  seconds=round(time.perf_counter() - start, 3), plans=self.plan_cache_size)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
