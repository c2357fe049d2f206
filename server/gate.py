"""A graph launched before its call comes: held on the GPU by a page-locked flag, let go by a store.

Inside the server on the H100 host a lone call's graph launch (``cudaGraphLaunch``) took about
45 us of host time: the call comes after the request's bytes have been copied twice and finds
the driver's state cold (the same call takes 9-16 us in a loop). So after a lone call, the device
handle launches that call's graph again at once, queued behind a wait on a flag in page-locked
memory (``cuStreamWaitValue32``: the GPU's front end watches the flag, no SM spins). The next
lone call of the same key writes its inputs into the graph's page-locked buffer and stores the
flag's new value: the GPU goes on with no driver call on the call's way. Measured on the H100
host (``python -m bench.service_ablation``, Sample 1x128256 bf16 at concurrency 1, 20 rounds,
2026-11-25): -67 us p50 against launching at the call, lower in 14 of 20 rounds.

While a graph is held its stream is blocked, so everything else that uses the device lets it go
first (server/device.py): it then runs once more over the inputs its buffer holds, and nobody
reads its outputs. A hold no call takes within HOLD_LIMIT_S is let go too, so that a wait for
the whole device (``cudaDeviceSynchronize``, from any thread) waits no longer than that.

The inputs must be in memory before the flag: x86-64 makes stores visible in program order, so
the flag's store after the input copy is enough there. Elsewhere (weaker memory orders, where it
would take a fence) and where the driver lacks stream waits, :func:`launch_gate` gives None and
calls are launched as they come.
"""

from __future__ import annotations

import ctypes
import platform

import torch

# A lone client's next call comes within its round trip (about 1 ms on the H100 host); a hold
# lasting longer is let go, so nothing waits long behind it.
HOLD_LIMIT_S = 0.02

_WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_X86_64 = ("x86_64", "AMD64")


def _driver_stream_wait():
    """The driver's ``cuStreamWaitValue32``, or None where it cannot be loaded."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # torch has loaded it already
        wait = driver.cuStreamWaitValue32_v2
    except (OSError, AttributeError):
        return None
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    return wait


class LaunchGate:
    """A page-locked flag that ``stream`` waits on before a held graph; one graph at a time.

    ``hold(graph)`` queues the wait and the graph's replay (``graph.replay()``) behind it;
    ``let_go()`` stores the flag's awaited value, and the GPU runs the graph.
    """

    def __init__(self, stream: torch.cuda.Stream, stream_wait):
        self._stream = stream
        self._stream_wait = stream_wait
        self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=True).numpy()
        self._value = 0  # the value the latest hold waits for
        self.held = None  # the graph launched and held, if any

    def hold(self, graph) -> int:
        """Launch ``graph`` behind a wait for the flag's next value; returns that hold's number."""
        self._value = (self._value + 1) & 0x7FFFFFFF
        status = self._stream_wait(self._stream.cuda_stream, self._flag.ctypes.data, self._value, _WAIT_VALUE_EQ)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {status})")
        graph.replay()
        self.held = graph
        return self._value

    def let_go(self, hold: int | None = None) -> None:
        """Let the held graph run (over the inputs in its buffer); with ``hold``, only that hold."""
        if self.held is not None and hold in (None, self._value):
            self._flag[0] = self._value
            self.held = None


def launch_gate(stream: torch.cuda.Stream) -> LaunchGate | None:
    """A gate on ``stream``, or None where this host cannot have one (see the module's notes)."""
    if platform.machine() not in _X86_64:
        return None
    stream_wait = _driver_stream_wait()
    return None if stream_wait is None else LaunchGate(stream, stream_wait)
