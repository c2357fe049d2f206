"""The GPU side of a stream-ordered session: its marks, its stream, and the stream memory
operations that order work between the caller's process and this one.

A session's marks are int64 words in device memory this process allocates (``cudaMalloc``) and
exports over CUDA IPC (docs/SERVICE.md, "Calls ordered on the GPU"): ``ready`` (the caller writes
the mark of the step whose logits are complete, on its stream), ``done`` (written here, on the
session's stream, after each step's outputs), ``ended`` (set when the session ends). Each session
has an allocation of its own, so a caller mapping its handle can reach no other session's marks
(one allocation for all would let any caller release another's waits, and its kernels would read
logits not yet written). The allocation is freed only after the session's call ended (its caller
has then unmapped it, or died), and only while no session waits (``cudaFree`` synchronizes the
device).

The waits and writes are ``cuStreamWaitValue64`` / ``cuStreamWriteValue64`` through
``cuda.bindings.driver`` (the ``_v2`` entry points; a raw ``dlsym`` of the old names answers
NOT_SUPPORTED on Hopper). A wait is done by the GPU's front end, not by a kernel: a waiting
session spends no SM time. The server releases a wait from the host by writing :data:`RELEASED`
into the word from a stream of its own (:meth:`SessionGpu.release`): never from the CPU into
device memory, which needs no mapping.

Each session's stream is created here (``cuStreamCreate``, non-blocking), not taken from
torch's pool: torch hands out 32 streams per device round robin, so the 33rd session would share
a stream with another session or with the device handle's, and one client that never signals
would then hold up the others. Streams are kept in a pool and reused once idle, which bounds the
sampling kernels' per-stream workspaces (one per stream ever used) to the sessions' limit.
"""

from __future__ import annotations

import threading

import torch

READY, DONE, ENDED = 0, 1, 2
MARK_WORDS = 8
# Written into ready and done when a session ends: every wait on a mark below it passes.
RELEASED = 1 << 62
# A session's allocation: the driver maps device memory for IPC in 2 MiB pages; a smaller one
# may share its page with other allocations, which the caller's mapping would then expose.
ALLOCATION_BYTES = 2 << 20


def _bindings():
    from cuda.bindings import driver, runtime

    return driver, runtime


def _check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def available() -> str | None:
    """Why this process cannot run stream-ordered sessions (None: it can)."""
    try:
        _bindings()
    except ImportError:
        return "cuda-python is not installed (pip install 'logitserve[cuda]')"
    return None


class _DeviceWords:
    """Device memory as ``__cuda_array_interface__`` int64 words, for ``torch.as_tensor``."""

    def __init__(self, ptr: int, words: int):
        self.__cuda_array_interface__ = {"shape": (words,), "typestr": "<i8", "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


class StreamPool:
    """Non-blocking CUDA streams of one device, created on first need and reused once returned."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list[torch.cuda.ExternalStream] = []
        self._lock = threading.Lock()

    def take(self) -> torch.cuda.ExternalStream:
        with self._lock:
            if self._free:
                return self._free.pop()
        driver, _ = _bindings()
        with torch.cuda.device(self.device):
            torch.cuda.init()
            stream = _check(driver.cuStreamCreate(int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        return torch.cuda.ExternalStream(int(stream), device=self.device)

    def give_back(self, stream: torch.cuda.ExternalStream) -> None:
        """``stream``, whose work is done, for the next session."""
        with self._lock:
            self._free.append(stream)


class SessionGpu:
    """One session's marks allocation and stream (made by ``DeviceHandle.run`` on the device's
    launch thread, and used there)."""

    def __init__(self, device: torch.device, streams: StreamPool):
        driver, runtime = _bindings()
        self._driver = driver
        self.device = device
        self._streams = streams
        with torch.cuda.device(device):
            self._ptr = int(_check(runtime.cudaMalloc(ALLOCATION_BYTES), "cudaMalloc"))
            try:
                handle = _check(runtime.cudaIpcGetMemHandle(self._ptr), "cudaIpcGetMemHandle")
                reserved = handle.reserved
                self.ipc_handle = (bytes(reserved) if isinstance(reserved, (bytes, bytearray))
                                   else bytes(int(b) & 0xFF for b in reserved))
                self.words = torch.as_tensor(_DeviceWords(self._ptr, MARK_WORDS), device=device)
                self.words.zero_()  # on the launch thread's stream, which DeviceHandle.run waits for
            except BaseException:
                runtime.cudaFree(self._ptr)
                raise
        self.stream = streams.take()
        # Where release() writes from: the session's own stream may be blocked on a wait.
        self._side = streams.take()

    def address(self, word: int) -> int:
        return self._ptr + 8 * word

    def wait_ready(self, mark: int) -> None:
        """On the session's stream: wait until ready >= ``mark``."""
        d = self._driver
        _check(d.cuStreamWaitValue64(d.CUstream(self.stream.cuda_stream), d.CUdeviceptr(self.address(READY)), mark,
                                     d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue64")

    def write_done(self, mark: int) -> None:
        """On the session's stream: done = ``mark``, after the work enqueued before it."""
        d = self._driver
        _check(d.cuStreamWriteValue64(d.CUstream(self.stream.cuda_stream), d.CUdeviceptr(self.address(DONE)), mark,
                                      d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64")

    def release(self) -> None:
        """Let every wait on the marks pass and mark the session ended, from the side stream
        (the session's may be blocked); returns once written."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            # `ended` first: a caller whose wait passes on the release then finds it set.
            self.words[ENDED].fill_(1)
            self.words[READY:DONE + 1].fill_(RELEASED)
        self._side.synchronize()

    def give_back_streams(self) -> None:
        """The session's stream, whose work is done, and the side stream back to the pool."""
        self._streams.give_back(self.stream)
        self._streams.give_back(self._side)

    def free(self) -> None:
        """Free the marks (the caller's mapping is gone: its call ended). ``cudaFree`` waits for
        the whole device, so the table calls this only while no session has a step pending
        (server/ordered/table.py): a wait for a mark would hold it up."""
        _, runtime = _bindings()
        with torch.cuda.device(self.device):
            runtime.cudaFree(self._ptr)
