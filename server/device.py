"""One device the kernels run on: torch device, backend, stream, launch thread, warm-up.

Launches for a device run one at a time (an asyncio lock, so warm-up and requests never
interleave). Most run on the handle's launch thread, which waits for the device while the event
loop goes on receiving calls; they join the next launch, so batches grow with load. On CUDA
launches go to the handle's own stream.

A Sample or RouteExperts batch replays a CUDA graph (server/graphs.py) when its graph is
captured: one byte copy and one replay call, which return at once. A batch of one call whose rows
fill a captured graph (:meth:`DeviceHandle.replay_alone`) is written into the graph's input
buffer part by part, with no staging built. How the replay is waited for
is the caller's choice (:class:`Wait`): the batcher has it polled on the event loop
(``Wait.POLL``) when the batch holds every call in the server: then there is nothing to wait
for, and the two thread hand-overs are saved; a call that finds the server idle and launches
at once (server/batcher.py) spins for it (``Wait.SPIN``). Measured on
the H100 host, Sample 1x128256 bf16, medians of 4 rounds (``python -m bench.service_ablation
--variants echo,full,full+thread,full+poll --rounds 4``, 2026-11-22):

===========  =========  =====================  =====================  =====================
in flight    echo       this rule              always the thread      always polled
===========  =========  =====================  =====================  =====================
1            689 us     1,166 us               1,283 us               1,179 us
8            4,427/s    1,655/s, 1.3 a launch  1,725/s, 2.3 a launch  1,473/s, 1.0 a launch
64           4,733/s    1,697/s, 2.3 a launch  1,927/s, 3.1 a launch  1,605/s, 1.0 a launch
===========  =========  =====================  =====================  =====================

Always polled, a loaded server launched every call alone: the replay is done before gRPC has
handed the loop the next call, so each call paid a launch's host work. Through the thread the
hand-overs give the next batch time to fill. The rule keeps most of the latency gain, and gives
up part of the throughput of one process (``--workers`` serves more than one process can).

Launching eagerly from the event loop was measured and rejected: each launch held the loop for
its host work (about forty torch calls), batches stayed at one request and 64 calls in flight got
590 calls/s against 1,150 through the thread.
"""

from __future__ import annotations

import asyncio
import enum
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from logitserve import kernels

from .graphs import Launch, LaunchGraphs, bucket_rows
from .logs import get_logger, log_event
from .staging import Staging, to_host
from .tensors import HostTensor

log = get_logger("device")

# Row widths warm-up compiles on the compiled backend unless --warmup-widths says otherwise: the
# vocabularies of Llama 2 (32000), Llama 3 (128256) and Qwen 2 (151936); block and chunk sizes
# are chosen per width, so each width a deployment serves should be warmed.
# Interpreted and torch backends compile nothing, so a tiny width only checks the path works.
TRITON_WARMUP_WIDTHS = (32000, 128256, 151936)
CPU_WARMUP_WIDTHS = (64,)

# Longest a spinning wait (Wait.SPIN) holds the event loop before it polls instead: many times a
# lone call's replay (about 50 us for Sample 1x128256 on the H100), short enough that a stuck
# replay does not stall the loop's other calls and health checks.
SPIN_LIMIT_S = 2e-3

# The handle whose device and stream the current thread launches on (DeviceHandle._bind).
_bound = threading.local()


class Wait(enum.Enum):
    """How a graph replay is started and waited for (:meth:`DeviceHandle.launch`)."""

    # On the launch thread, which waits for the stream while the event loop goes on receiving
    # calls: they fill the next batch.
    THREAD = "thread"
    # On the event loop, polling the stream between the loop's other callbacks: a batch that holds
    # every call in the server saves two thread hand-overs.
    POLL = "poll"
    # On the event loop, spinning on the stream: nothing else runs until the replay is done, so
    # a call that has the server to itself is answered without its handler ever yielding.
    SPIN = "spin"


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
        self._thread_work = 0  # submitted to the launch thread and not yet done
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
    def thread_busy(self) -> bool:
        """Whether the launch thread has work (the event loop then does not busy-poll: server/busy_poll.py)."""
        return self._thread_work > 0

    @property
    def plan_cache_size(self) -> int:
        """Kernel descriptors cached in this process (every op's bounded cache)."""
        return kernels.plan_cache_size()

    async def launch(self, key, rows: int, stage_for: Callable[[int], Staging], launch: Launch, *,
                     wait: Wait = Wait.THREAD) -> list[np.ndarray]:
        """An op's batched launch, alone on the device; its outputs on the host, as arrays.

        ``stage_for(n)`` lays out the batch's inputs for ``n`` rows (``n >= rows``: the rows past
        the batch are padding); ``launch`` maps their device tensors to output tensors (of dtypes
        numpy has) whose dim 0 is rows. Calls with equal ``key`` have the same launch (see
        server/graphs.py). Returns the outputs' first ``rows`` rows. ``wait``: how a graph replay
        is started and waited for (:class:`Wait`; a capture or an eager launch always runs on the
        launch thread).
        """
        async with self._lock:
            if self.graphs is not None:
                bucket = bucket_rows(rows)
                stage = stage_for(bucket)
                if stage.nbytes <= self.graphs.max_bytes:
                    graph = self.graphs.get(key, bucket)
                    if graph is None:
                        graph = await self.submit(self.graphs.capture, key, bucket, stage, launch)
                    await self._replay(graph.start, stage, wait)
                    return graph.outputs(rows)
            return await self.submit(self._launch_eagerly, rows, stage_for, launch)

    async def replay_alone(self, key, parts: tuple[HostTensor, ...], wait: Wait,
                           meanwhile: Callable[[], None] | None = None) -> list[np.ndarray] | None:
        """:meth:`launch` for a batch of one call whose ``parts`` (its staged pieces, one per part,
        dim 0 its rows) fill the graph captured for ``key`` at their rows: written straight into
        the graph's input buffer, with no staging, layout or closures to build. The path of a
        call that finds the server idle. None when no graph was captured for them (graphs off,
        rows not a power of two, or not yet replayed): then the call goes through :meth:`launch`.

        ``meanwhile()``, when given, runs once the replay is queued, while the device works (not
        with ``Wait.THREAD``); what it raises is raised once the replay is done.
        """
        rows = parts[0].shape[0]
        graph = None if self.graphs is None else self.graphs.get(key, rows)
        if graph is None:
            return None
        async with self._lock:
            await self._replay(graph.start_alone, parts, wait, meanwhile)
            return graph.outputs(rows)

    async def _replay(self, start: Callable, inputs, wait: Wait, meanwhile: Callable[[], None] | None = None) -> None:
        """``start(inputs)`` queues a graph's replay; wait for it as ``wait`` says, running
        ``meanwhile()`` first where given (see :meth:`replay_alone`)."""
        if wait is Wait.THREAD:
            if meanwhile is not None:
                raise ValueError("meanwhile: needs a replay waited for on the event loop, not Wait.THREAD")
            await self.submit(start, inputs)  # the thread waits for the stream
            self.graphs.replays += 1
            return
        self._bind()
        start(inputs)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:  # the replay owns its buffers until it is done, whatever meanwhile raised
            if not (wait is Wait.SPIN and self._spun()):
                await self._polled()
            self.graphs.replays += 1

    def _spun(self) -> bool:
        """Spin on the stream, holding the event loop, for up to SPIN_LIMIT_S; whether it is done."""
        give_up = time.perf_counter() + SPIN_LIMIT_S
        while not self.stream.query():
            if time.perf_counter() >= give_up:
                return False
        return True

    async def _polled(self) -> None:
        """Wait for the stream on the event loop, its other callbacks running between polls."""
        try:
            while not self.stream.query():
                await asyncio.sleep(0)
        except BaseException:
            self.stream.synchronize()  # cancelled: the next replay may reuse this one's buffers
            raise

    def _launch_eagerly(self, rows: int, stage_for: Callable[[int], Staging], launch: Launch) -> list[np.ndarray]:
        return [to_host(out).numpy() for out in launch(*stage_for(rows).to(self.device))]

    def _bind(self) -> None:
        """Make this handle's device and stream the current thread's, once per thread.

        Triton launches and graph replays go to the thread's current device and stream, not the
        tensors'; binding once per thread (the launch thread is this handle's alone, the event
        loop's replays all go here) saves two context managers, a few torch calls each, per launch.
        """
        if getattr(_bound, "handle", None) is not self:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
            _bound.handle = self

    def _run(self, fn: Callable, *args):
        if self.stream is None:
            return fn(*args)
        self._bind()
        result = fn(*args)
        self.stream.synchronize()
        return result

    async def submit(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the launch thread (and stream), not waiting for other launches.

        A caller cancelled meanwhile (a client that left, whose call was launching in its own
        handler) gets its CancelledError once ``fn`` has returned, not before: until then the
        thread is using the stream, and the device must not pass to a replay on the event loop.
        """
        done = asyncio.get_running_loop().run_in_executor(self._executor, self._run, fn, *args)
        self._thread_work += 1
        done.add_done_callback(self._thread_work_done)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            while not done.done():
                try:
                    await asyncio.wait([done])
                except asyncio.CancelledError:
                    pass  # cancelled again: the thread still holds the stream
            done.exception()  # retrieved: what fn raised goes nowhere, the caller has left
            raise

    def _thread_work_done(self, _done: asyncio.Future) -> None:
        self._thread_work -= 1

    async def run(self, fn: Callable, *args):
        """Run ``fn(*args)`` alone on the device's launch thread (and stream); return its result
        once the device has finished it."""
        async with self._lock:
            return await self.submit(fn, *args)

    def check(self) -> None:
        """On the launch thread: raise if the device can no longer run anything (a sticky CUDA
        error, such as an illegal memory access, fails every later call on the context)."""
        if self.stream is not None:
            torch.cuda.synchronize(self.device)

    async def warm_up(self, dtypes: tuple[torch.dtype, ...], make_cases: Callable,
                      widths: tuple[int, ...] | None = None) -> None:
        """Launch every case ``make_cases(dtype, widths)`` returns, logging progress per case.

        ``widths``: the row widths to compile for (None: the backend's own list, above).

        ``make_cases`` returns ``(label, call)`` pairs (server.ops.warmup_calls); each call runs
        through its op's ``run_batch`` exactly as a request would, compiling its kernels (and
        capturing its graph).
        """
        if widths is None:
            widths = TRITON_WARMUP_WIDTHS if self.backend == "triton" else CPU_WARMUP_WIDTHS
        plan = [(dtype, label, call) for dtype in dtypes for label, call in make_cases(dtype, widths)]
        start = time.perf_counter()
        for i, (dtype, label, call) in enumerate(plan, 1):
            t0 = time.perf_counter()
            await type(call).run_batch([call], self)
            log_event(log, "warmup", step=f"{i}/{len(plan)}", dtype=str(dtype).removeprefix("torch."), op=label,
                      seconds=round(time.perf_counter() - t0, 3))
            if dtype not in self.warmed_dtypes and all(d != dtype for d, _, _ in plan[i:]):
                self.warmed_dtypes.append(dtype)
        log_event(log, "warmup done", device=str(self.device), backend=self.backend, cases=len(plan),
                  seconds=round(time.perf_counter() - start, 3), plans=self.plan_cache_size)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
