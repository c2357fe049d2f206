"""One device the kernels run on: torch device, backend, stream, launch thread, warm-up.

Launches for a device run one at a time (an asyncio lock, so warm-up and requests never
interleave). Most run on the handle's launch thread, which waits for the device while the event
loop goes on receiving calls; they join the next launch, so batches grow with load. On CUDA
launches go to the handle's own stream.

Every batch launches through :meth:`DeviceHandle.run_batch`: the fault-injection hook
(:attr:`DeviceHandle.before_launch`), then the op's ``run_batch``. A Sample or RouteExperts
batch replays a CUDA graph (server/engine/graphs.py) once its graph is captured: one byte copy and one
replay call, which return at once. The caller of ``run_batch`` says how the replay is waited
for (:class:`Wait`): on the launch thread, or polled on the event loop.

An eager launch (no graph: the CPU, an uncaptured shape) runs on the launch thread while other
calls are in the server: on the loop it would hold the loop for its host work (about forty torch
calls), and calls arriving meanwhile could not join the next batch. A batch holding every call in
the server (Wait.POLL) launches on the loop instead, as its replay would: no one is there to wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import logging
import platform
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from logitserve import kernels

from .graphs import Launch, LaunchGraphs, bucket_rows
from ..logs import get_logger, log_event
from .staging import Staging, to_host

log = get_logger("device")

# Row widths warm-up compiles on the compiled backend unless --warmup-widths says otherwise: the
# vocabularies of Llama 2 (32000), Llama 3 (128256) and Qwen 2 (151936); block and chunk sizes
# are chosen per width, so each width a deployment serves should be warmed.
# Interpreted and torch backends compile nothing, so a tiny width only checks the path works.
TRITON_WARMUP_WIDTHS = (32000, 128256, 151936)
CPU_WARMUP_WIDTHS = (64,)

# The handle whose device and stream the current thread launches on (DeviceHandle._bind).
_bound = threading.local()


class Wait(enum.Enum):
    """How a graph replay is started and waited for (:meth:`DeviceHandle.run_batch`)."""

    # On the launch thread, which waits for the stream while the event loop goes on receiving
    # calls: they fill the next batch.
    THREAD = "thread"
    # On the event loop, polling the stream between the loop's other callbacks: when no other
    # call is in the server, this saves the two thread hand-overs.
    POLL = "poll"


# The wait of the batch the current task is launching (set by DeviceHandle.run_batch for the
# op's run_batch, read by DeviceHandle.launch): a task's own, so warm-up and requests never mix.
_wait: contextvars.ContextVar[Wait] = contextvars.ContextVar("logitserve_wait", default=Wait.THREAD)


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
        # Launch-thread work whose caller was cancelled and left (submit): the next launch waits
        # for it (_after_detached), and its leases are released only once it is done (run_batch).
        self._detached: set[Future] = set()
        self._lock = asyncio.Lock()  # one launch at a time: warm-up and the batcher share the device
        # The fault-injection point for tests and benchmarks, set in-process only (never from the
        # wire): called with a batch's calls on the launch thread before each launch of a batch
        # (run_batch). It may raise (a device fault: those calls fail, INTERNAL) or sleep (a slow
        # device).
        self.before_launch: Callable[[list], None] | None = None

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
        """Whether a thread works for the server's calls: the launch thread, or a call's checks
        off the loop (:meth:`checking`). The event loop then does not busy-poll
        (server/engine/busy_poll.py): polling would take a core and the GIL from that thread."""
        return self._thread_work > 0

    @contextlib.contextmanager
    def checking(self):
        """While a call's checks run on a worker thread (ops' ``checked``): counted as thread work."""
        self._thread_work += 1
        try:
            yield
        finally:
            self._thread_work -= 1

    @property
    def plan_cache_size(self) -> int:
        """Kernel descriptors cached in this process (every op's bounded cache)."""
        return kernels.plan_cache_size()

    async def run_batch(self, calls: list, wait: Wait = Wait.THREAD) -> list:
        """Launch ``calls`` (compatible calls of one op) as one batch; one result per call.

        The one way a batch reaches the device: :attr:`before_launch` (when set) on the launch
        thread, then the op's ``run_batch(calls, handle)``, whose graph replay is waited for as
        ``wait`` says (a capture or an eager launch always runs on the launch thread).

        Calls with regions (``call.regions``, server/regions/calls.py) hold their leases from
        here until the device has finished with them, so a client that cancels meanwhile cannot
        have its memory unmapped under a kernel. A caller cancelled while the launch thread works
        for it returns at once (the drain's answer must not wait for a slow launch); its leases
        are released, and the next launch starts, only once the thread is done (:meth:`submit`).
        """
        held = []
        try:
            for call in calls:
                regions = getattr(call, "regions", None)
                if regions is not None and regions.leases:
                    regions.hold()
                    held.append(regions)
            if self.before_launch is not None:
                await self.run(self.before_launch, calls)
            token = _wait.set(wait)
            try:
                return await type(calls[0]).run_batch(calls, self)
            finally:
                _wait.reset(token)
        finally:
            detached = [work for work in self._detached if not work.done()]
            if held and detached:
                asyncio.ensure_future(_release_after(detached, held))
            else:
                for regions in held:
                    regions.release()

    async def launch(self, key, rows: int, stage_for: Callable[[int], Staging], launch: Launch) -> list[np.ndarray]:
        """An op's batched launch, alone on the device; its outputs on the host, as arrays.

        ``stage_for(n)`` lays out the batch's inputs for ``n`` rows (``n >= rows``: the rows past
        the batch are padding); ``launch`` maps their device tensors to output tensors (of dtypes
        numpy has) whose dim 0 is rows. Calls with equal ``key`` have the same launch (see
        server/engine/graphs.py). Returns the outputs' first ``rows`` rows. A graph replay is waited
        for as the batch's :meth:`run_batch` says.
        """
        async with self._lock:
            await self._after_detached()
            if self.graphs is not None:
                bucket = bucket_rows(rows)
                stage = stage_for(bucket)
                if stage.nbytes <= self.graphs.max_bytes:
                    graph = self.graphs.get(key, bucket)
                    if graph is None:
                        graph = await self.submit(self.graphs.capture, key, bucket, stage, launch)
                    await self._replay(graph, stage, _wait.get())
                    return graph.outputs(rows)
            if _wait.get() is Wait.POLL:
                return await self._launch_eagerly_polled(rows, stage_for, launch)
            return await self.submit(self._launch_eagerly, rows, stage_for, launch)

    async def _replay(self, graph, stage: Staging, wait: Wait) -> None:
        """Replay ``graph`` over ``stage`` and wait for it as ``wait`` says."""
        if wait is Wait.THREAD:
            await self.submit(graph.start, stage)  # the thread waits for the stream
        else:
            self._bind()
            graph.start(stage)
            await self._polled()
        self.graphs.replays += 1

    async def _polled(self) -> None:
        """Wait for the stream on the event loop, its other callbacks running between polls."""
        try:
            while not self.stream.query():
                await asyncio.sleep(0)
        except BaseException:
            self.stream.synchronize()  # cancelled: the next replay may reuse this one's buffers
            raise

    def _enqueue_eagerly(self, rows: int, stage_for: Callable[[int], Staging], launch: Launch) -> list:
        """The launch's inputs staged and its kernels enqueued on the current stream; its outputs'
        host copies, valid once the stream is done (on the CPU: the outputs, done)."""
        return [to_host(out) for out in launch(*stage_for(rows).to(self.device))]

    def _launch_eagerly(self, rows: int, stage_for: Callable[[int], Staging], launch: Launch) -> list[np.ndarray]:
        return [out.numpy() for out in self._enqueue_eagerly(rows, stage_for, launch)]

    async def _launch_eagerly_polled(self, rows: int, stage_for: Callable[[int], Staging],
                                     launch: Launch) -> list[np.ndarray]:
        """:meth:`_launch_eagerly` on the event loop, the stream polled: for a batch holding every
        call in the server (no one is there to receive meanwhile), the two thread hand-overs
        saved. On the CPU the kernels run on the loop itself (a lone RouteExperts 1x8 through the
        channel on the 2-core machine: 1,470 us p50 through the launch thread, 469 on the loop)."""
        if self.stream is not None:
            self._bind()
        outputs = self._enqueue_eagerly(rows, stage_for, launch)
        if self.stream is not None:
            await self._polled()
        return [out.numpy() for out in outputs]

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

    def _run(self, fn: Callable, *args, synchronize: bool = True):
        if self.stream is None:
            return fn(*args)
        self._bind()
        result = fn(*args)
        if synchronize:
            self.stream.synchronize()
        return result

    async def submit(self, fn: Callable, *args, synchronize: bool = True):
        """Run ``fn(*args)`` on the launch thread (and stream), not waiting for other launches.

        The thread hands the outcome to the loop once (:meth:`_settle`, one
        ``call_soon_threadsafe``), straight into the future the caller awaits: no executor
        future copied over, no shield in between.

        A caller cancelled meanwhile gets its CancelledError at once; the thread goes on with
        ``fn`` and the stream, so the work is kept as detached: the next launch waits for it
        (:meth:`_after_detached`) before the device passes to a replay on the event loop, and the
        leases of its calls are released once it is done (:meth:`run_batch`).

        ``synchronize=False``: the thread returns once ``fn`` has enqueued its work, not waiting
        for the handle's stream (:meth:`enqueue`).
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        job = [loop, done, fn, args, synchronize]
        work = self._executor.submit(self._run_and_settle, job)
        self._thread_work += 1
        work.add_done_callback(functools.partial(self._never_ran, job))
        try:
            return await done
        except asyncio.CancelledError:
            if done.cancelled() and not work.done():  # the caller left: the thread still holds the stream
                self._detached.add(work)
            raise

    async def _after_detached(self) -> None:
        """Wait until no cancelled caller's work is left on the launch thread (under the lock)."""
        while self._detached:
            self._detached = {work for work in self._detached if not work.done()}
            if self._detached:
                await asyncio.wait([asyncio.wrap_future(work) for work in self._detached])

    def _run_and_settle(self, job: list) -> None:
        """On the launch thread: ``job``'s ``fn(*args)``, its result or exception handed to its
        future ``done``.

        A failure's traceback holds the frames that ran ``fn``, and through theirs (``f_back``)
        this frame and the executor's, which outlive their return: none may keep ``done`` (the
        failure) or ``args`` (the launch's calls), or they would stay in a reference cycle until
        a garbage collection. So ``job`` is a list, emptied here, and this frame lets go of it
        all before it returns."""
        loop, done, fn, args, synchronize = job
        job.clear()
        try:
            result, failure = self._run(fn, *args, synchronize=synchronize), None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
            result, failure = None, exc
        loop.call_soon_threadsafe(self._settle, done, result, failure)
        del done, fn, args, result, failure

    def _never_ran(self, job: list, _work: Future) -> None:
        """A job's work ended: when it was dropped unrun (:meth:`close` cancels what is queued;
        ``job`` still full, the thread empties it), its caller is cancelled, not left waiting for
        ever."""
        if job:
            loop, done = job[0], job[1]
            job.clear()
            with contextlib.suppress(RuntimeError):  # the loop is closed: no one is waiting
                loop.call_soon_threadsafe(self._settle, done, None, None, True)

    def _settle(self, done: asyncio.Future, result, failure: BaseException | None, dropped: bool = False) -> None:
        self._thread_work -= 1
        if done.cancelled():  # the caller left: what fn returned or raised goes nowhere
            return
        if dropped:
            done.cancel()
        elif failure is not None:
            done.set_exception(failure)
        else:
            done.set_result(result)

    async def run(self, fn: Callable, *args):
        """Run ``fn(*args)`` alone on the device's launch thread (and stream); return its result
        once the device has finished it."""
        async with self._lock:
            await self._after_detached()
            return await self.submit(fn, *args)

    async def enqueue(self, fn: Callable, *args):
        """Run ``fn(*args)`` alone on the launch thread and return once it has enqueued its work,
        which it puts on a stream of its own (a stream-ordered session's, server/ordered/): the
        device is not waited for."""
        async with self._lock:
            await self._after_detached()
            return await self.submit(fn, *args, synchronize=False)

    def check(self) -> None:
        """On the launch thread: raise if the device can no longer run anything (a sticky CUDA
        error, such as an illegal memory access, fails every later call on the context). The
        handle's stream, not the device: a stream-ordered session's stream may be waiting for its
        caller's mark (server/ordered/), and a device-wide synchronisation would wait with it."""
        if self.stream is not None:
            self.stream.synchronize()

    async def warm_up(self, dtypes: tuple[torch.dtype, ...], make_cases: Callable,
                      widths: tuple[int, ...] | None = None) -> None:
        """Launch every case ``make_cases(dtype, widths)`` returns: a debug line per case, then
        one info line (cases, seconds, dtypes, widths) so that start-up at info stays short.

        ``widths``: the row widths to compile for (None: the backend's own list, above).

        ``make_cases`` returns ``(label, call)`` pairs (server.ops.warmup_calls); each call runs
        through :meth:`run_batch` exactly as a request would, compiling its kernels (and
        capturing its graph).
        """
        if widths is None:
            widths = TRITON_WARMUP_WIDTHS if self.backend == "triton" else CPU_WARMUP_WIDTHS
        plan = [(dtype, label, call) for dtype in dtypes for label, call in make_cases(dtype, widths)]
        start = time.perf_counter()
        for i, (dtype, label, call) in enumerate(plan, 1):
            t0 = time.perf_counter()
            await self.run_batch([call])
            log_event(log, "warmup", level=logging.DEBUG, step=f"{i}/{len(plan)}",
                      dtype=str(dtype).removeprefix("torch."), op=label, seconds=round(time.perf_counter() - t0, 3))
            if dtype not in self.warmed_dtypes and all(d != dtype for d, _, _ in plan[i:]):
                self.warmed_dtypes.append(dtype)
        log_event(log, "warmup done", device=str(self.device), backend=self.backend, cases=len(plan),
                  seconds=round(time.perf_counter() - start, 3), dtypes=[str(d).removeprefix("torch.") for d in dtypes],
                  widths=list(widths), plans=self.plan_cache_size)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


async def _release_after(works: list[Future], held: list) -> None:
    """Release ``held`` leases once the launch thread is done with ``works`` (a cancelled
    caller's launch, which may still read the regions)."""
    try:
        await asyncio.wait([asyncio.wrap_future(work) for work in works])
    finally:
        for regions in held:
            regions.release()
