"""Batched launches replayed from CUDA graphs: a batch's host work is one buffer fill and one replay.

Launched eagerly, a Sample batch costs about forty torch and Triton calls on the host: the
page-locked staging buffer and its copy, the plan lookup, three kernel launches and the copy
back. In the server each of them releases the GIL and waits to take it back from the event
loop, so the launch thread's host work, not the GPU, sets the pace (bench/service_breakdown.py).

A :class:`CapturedLaunch` is one op's launch for one batch size, captured once together with
its inputs' copy to the device and its outputs' copy back (kernels reading and writing the
page-locked buffers: ``logitserve.kernels.copy``, which trades each memcpy node for a cheaper
kernel node), over a static page-locked buffer and a static device
buffer. A batch is padded up to the next power of two of its rows (:func:`bucket_rows`), so a
few graphs per op key serve every batch; the padding rows hold whatever an earlier batch left
there, and their outputs are never read. :class:`LaunchGraphs` keeps them per (key, bucket),
captured on first use and dropped least recently used beyond a byte budget of page-locked
memory. A graph is captured on the device's launch thread (the first run compiles); a replay
starts on the launch thread or on the event loop, as the batch's ``wait`` says
(:meth:`.device.DeviceHandle.run_batch`).

A captured launch replays what the launch function did while it was captured: only its input
tensors' contents change between replays, so the function must depend on nothing but its
inputs and the key (dtype, row width, static options), which is what the ops' batching keys hold.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

from logitserve.kernels.copy import copy_by_kernel

from .staging import Staging

# Batches whose staged inputs exceed this launch eagerly: there the copies, not the host calls,
# take the time, and graphs of that size would pin a lot of memory. 16 MiB is 64 rows of a
# 128256-token vocabulary in bfloat16.
GRAPH_MAX_BYTES = 16 << 20
# Page-locked input buffers kept for graphs, all keys together (device memory is as much again).
GRAPH_BUDGET_BYTES = 1 << 30
# Graphs kept, all keys together: launches on a client's memory in place (server/ops/resident.py)
# are keyed by its addresses, and stage a few bytes each, so the byte budget alone would not
# bound them.
GRAPH_MAX_COUNT = 256

Launch = Callable[..., tuple[torch.Tensor, ...]]


def bucket_rows(rows: int) -> int:
    """The batch size a graph is captured for: the next power of two of ``rows``."""
    return 1 << (rows - 1).bit_length()


class CapturedLaunch:
    """``launch`` over the inputs laid out as ``stage``, captured as a CUDA graph on ``stream``."""

    def __init__(self, stage: Staging, launch: Launch, device: torch.device, stream: torch.cuda.Stream):
        self.layout = stage.layout
        self.nbytes = stage.nbytes
        self._stream = stream
        self._host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self._host_bytes = memoryview(self._host.numpy())
        self._device = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        inputs = stage.views(self._device)
        # Run once before capturing, copies included: it compiles the kernels and builds their
        # plans, which a capture cannot (the inputs are zeros; the outputs are discarded).
        with torch.cuda.stream(stream):
            copy_by_kernel(self._host, self._device)
            outputs = launch(*inputs)
            # Page-locked outputs, read through numpy: outputs are of dtypes numpy has (token
            # ids, expert weights and indices).
            self._outputs = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in outputs]
            for host, out in zip(self._outputs, outputs):
                copy_by_kernel(out.contiguous(), host)
        stream.synchronize()
        self._output_arrays = [o.numpy() for o in self._outputs]
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: the capture tolerates CUDA calls other threads may make meanwhile.
        with torch.cuda.graph(self._graph, stream=stream, capture_error_mode="thread_local"):
            copy_by_kernel(self._host, self._device)
            for host, out in zip(self._outputs, launch(*inputs)):
                copy_by_kernel(out.contiguous(), host)

    def start(self, stage: Staging) -> None:
        """Queue the graph on its stream over ``stage`` (laid out as captured); returns at once.

        One byte copy into the page-locked input buffer and one torch call: cheap enough for the
        event loop. Until the stream is done, the buffers belong to this replay.
        """
        if stage.layout != self.layout:
            raise RuntimeError(f"staged inputs {stage.layout} do not match the captured layout {self.layout}")
        stage.write(self._host_bytes)
        self._graph.replay()

    def outputs(self, rows: int) -> list[np.ndarray]:
        """The finished replay's outputs, their first ``rows`` rows (read once the stream is done)."""
        # Copies: the static outputs are overwritten by the next replay.
        return [out[:rows].copy() for out in self._output_arrays]


class LaunchGraphs:
    """Captured launches of one device, per (op key, bucket), least recently used dropped first."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, *, max_bytes: int = GRAPH_MAX_BYTES,
                 budget_bytes: int = GRAPH_BUDGET_BYTES):
        self.device, self.stream = device, stream
        self.max_bytes, self.budget_bytes = max_bytes, budget_bytes
        self._graphs: OrderedDict[tuple, CapturedLaunch] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # keys launched once (seen_again)
        self._bytes = 0
        self.captures = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key, bucket: int) -> CapturedLaunch | None:
        """The graph captured for ``key`` at ``bucket`` rows, now the most recently used; None if none."""
        graph = self._graphs.get((key, bucket))
        if graph is not None:
            self._graphs.move_to_end((key, bucket))
        return graph

    def seen_again(self, key) -> bool:
        """Whether ``key`` was asked about before (among the last :data:`GRAPH_MAX_COUNT` keys);
        records it. For keys a client chooses (addresses in its memory): capturing on a key's
        first use would cost a capture per call to a client that never reuses a buffer, so those
        launch eagerly once and capture on the second use."""
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        while len(self._seen) > GRAPH_MAX_COUNT:
            self._seen.popitem(last=False)
        return False

    def capture(self, key, bucket: int, stage: Staging, launch: Launch) -> CapturedLaunch:
        """Capture ``launch`` over ``stage`` (``bucket`` rows) for ``key``, on the device's launch thread."""
        while self._graphs and (self._bytes + stage.nbytes > self.budget_bytes
                                or len(self._graphs) >= GRAPH_MAX_COUNT):
            _, dropped = self._graphs.popitem(last=False)
            self._bytes -= dropped.nbytes
        graph = self._graphs[(key, bucket)] = CapturedLaunch(stage, launch, self.device, self.stream)
        self._bytes += graph.nbytes
        self.captures += 1
        return graph
