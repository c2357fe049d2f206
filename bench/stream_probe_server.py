"""The server's side of bench/stream_probe.py, and the stream memory operations both sides use.

Runs in a spawned process with its own CUDA context. Each mode's steps are enqueued on the
server's stream ahead of time, each behind a wait for the engine's "logits ready" mark, so the
host is out of the loop but for the inter-process events' mode, whose waits need their record
first.
"""

from __future__ import annotations

import ctypes
import time
from multiprocessing import shared_memory

READY, DONE = 0, 1  # the flags' words: "logits of step n ready" (engine), "step n sampled" (server)
FLAG_WORDS = 512


def host_flags(shm: shared_memory.SharedMemory):
    """The shared page as int64 words (a ctypes array: plain stores, seen by the GPU's waits)."""
    return (ctypes.c_int64 * FLAG_WORDS).from_buffer(shm.buf)


def sample_step(torch, logits, tokens, n: int) -> None:
    """The "sampler": argmax of the row into ``tokens[n]`` (one small kernel, as a greedy draw)."""
    torch.argmax(logits, dim=-1, out=tokens[n:n + 1])


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err!r}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class StreamOps:
    """``cuStreamWriteValue64`` / ``cuStreamWaitValue64`` (cuda.bindings' ``_v2`` entry points)
    on torch streams, and host memory mapped for the GPU."""

    def __init__(self):
        from cuda.bindings import driver as cu

        self.cu = cu
        _check(cu.cuInit(0))
        self._registered = {}

    def write(self, stream, addr: int, value: int) -> None:
        cu = self.cu
        _check(cu.cuStreamWriteValue64(cu.CUstream(stream.cuda_stream), cu.CUdeviceptr(addr), value,
                                       cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))

    def wait(self, stream, addr: int, value: int, equal: bool = False) -> None:
        cu = self.cu
        flag = (cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ if equal
                else cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        _check(cu.cuStreamWaitValue64(cu.CUstream(stream.cuda_stream), cu.CUdeviceptr(addr), value, flag))

    def register_host(self, shm: shared_memory.SharedMemory) -> int:
        """Map ``shm``'s page for the GPU; its device address."""
        cu = self.cu
        view = host_flags(shm)
        address = ctypes.addressof(view)
        _check(cu.cuMemHostRegister(address, ctypes.sizeof(view),
                                    cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE))
        self._registered[shm.name] = (address, view)
        return int(_check(cu.cuMemHostGetDevicePointer(address, 0)))

    def unregister_host(self, shm: shared_memory.SharedMemory) -> None:
        address, _ = self._registered.pop(shm.name)
        _check(self.cu.cuMemHostUnregister(address))


def gpu_facts(torch, ops: StreamOps) -> dict:
    cu = ops.cu
    device = _check(cu.cuDeviceGet(torch.cuda.current_device()))
    attrs = {}
    for name in ("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS", "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR",
                 "CU_DEVICE_ATTRIBUTE_COMPUTE_MODE"):
        attr = getattr(cu.CUdevice_attribute, name, None)
        if attr is not None:
            attrs[name] = int(_check(cu.cuDeviceGetAttribute(attr, device)))
    return {"device": torch.cuda.get_device_name(), "driver": int(_check(cu.cuDriverGetVersion())),
            "torch": torch.__version__, **attrs}


def _finish(torch, stream, timeout_s: float = 60.0) -> str:
    end = torch.cuda.Event()
    end.record(stream)
    deadline = time.monotonic() + timeout_s
    while not end.query():
        if time.monotonic() > deadline:
            return "timed out"
        time.sleep(0.0005)
    return "finished"


def serve(conn, device_flags, shm_name: str, logits, tokens) -> None:
    import torch

    torch.cuda.init()
    ops = StreamOps()
    shm = shared_memory.SharedMemory(name=shm_name)
    host_base = ops.register_host(shm)
    stream = torch.cuda.Stream()
    graphs = {}
    conn.send("ready")
    try:
        while True:
            message = conn.recv()
            mode = message[0]
            if mode == "stop":
                return
            try:
                _serve_one(torch, ops, conn, message, device_flags, host_base, logits, tokens, stream, graphs)
            except Exception as exc:  # noqa: BLE001 - the engine records it and goes on
                stream.synchronize()
                conn.send(("error", f"{mode}: {exc!r}"))
    finally:
        ops.unregister_host(shm)
        shm.close()


def _serve_one(torch, ops, conn, message, device_flags, host_base: int, logits, tokens, stream, graphs: dict):
    """One mode's steps: enqueued ahead behind their waits, then "enqueued" and how they ended."""
    mode = message[0]
    if mode in ("device_flags", "host_flags"):
        base = device_flags.data_ptr() if mode == "device_flags" else host_base
        with torch.cuda.stream(stream):
            for n in range(1, message[1] + 1):
                ops.wait(stream, base + 8 * READY, n)
                sample_step(torch, logits, tokens, n)
                ops.write(stream, base + 8 * DONE, n)
        conn.send("enqueued")
        conn.send(_finish(torch, stream))
    elif mode == "graph_wait":
        base = device_flags.data_ptr()
        graph = graphs.get("step")
        if graph is None:
            graph = graphs["step"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                capturing = torch.cuda.current_stream()
                ops.wait(capturing, base + 8 * READY, 1, equal=True)
                ops.write(capturing, base + 8 * READY, 0)
                sample_step(torch, logits, tokens, 0)
                ops.write(capturing, base + 8 * DONE, 1)
        with torch.cuda.stream(stream):
            for _ in range(message[1]):
                graph.replay()
        conn.send("enqueued")
        conn.send(_finish(torch, stream))
    elif mode == "ipc_events":
        steps, handle = message[1], message[2]
        theirs = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
        mine = torch.cuda.Event(interprocess=True, blocking=False)
        conn.send(mine.ipc_handle())
        with torch.cuda.stream(stream):
            for n in range(steps):
                assert conn.recv() == "recorded"
                stream.wait_event(theirs)
                sample_step(torch, logits, tokens, n)
                mine.record(stream)
                conn.send("recorded")
        stream.synchronize()
