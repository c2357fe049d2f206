"""Sample's logits processors on the CPU server: what a long list costs the other clients, and what
the lists add over the kernel (issue 33, item 1).

    python -m bench.processors_cpu [--checkout DIR] [--list-len 10000000] [--vocab 32000]

A server subprocess (``logitserve serve --device cpu --backend torch``) and this process as its
clients. ``--checkout DIR`` runs the server, and the in-process kernel timing, from another tree
(a directory holding ``kernels/``, ``server/``, ``client/`` and ``protos/`` of another commit, as
for ``bench.service_ab``: ``git archive REV kernels server client protos | tar -x -C DIR``), to
measure the code before a change on the same machine.

1. **Delay.** A tiny Sample (1x128 float32) is sent back to back on one channel while another
   channel sends a Sample of one row of ``--vocab`` logits with a ``--list-len``-entry banned
   list (int64): as bytes (the request serialized beforehand), then in a registered system
   shared-memory region. The tiny calls' worst latency during the big call's flight, minus
   their p50 alone, is the delay the long list caused. Also: the big call's own time, how many
   tiny calls were answered during it, and how far the server's RSS rose (sampled every 5 ms).
   Target (issue 33): <= 50 ms.
2. **Overhead.** 16 rows of ``--vocab`` float32 logits, plain (T 0.8, top-k 50, top-p 0.9) and
   the same with repetition, frequency and presence penalties over 8,192-token prompts and
   16,384-token outputs, the lists sent three ways: int64 bytes, int32 bytes, in a system region
   (every request serialized beforehand). What the service adds to a call: its time through the
   service minus the same call's time in process (``kernels.sample``, torch backend, every
   sampling parameter a per-row tensor as the server launches it, in a worker process of the
   server's tree), timed one after the other so that both see the same load; the median of
   those differences over the rounds. Target (issue 33): a processors call adds at most twice
   what the plain call adds. Beside them, each request's gRPC floor: the time
   ``bench.echo_server`` takes to answer it (nothing parsed, 8 bytes back).

The overhead figures are medians of ``--reps`` rounds; each round times every call once,
service and kernel, in turn. Torch runs one CPU thread in the server and the kernel
worker (``--threads``, OMP_NUM_THREADS): on a shared two-core host two OpenMP threads a process
made the same kernel take 0.1 s or 1 s from one call to the next.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from logitserve.client import messages, regions
from logitserve.v1 import logitserve_pb2 as pb

from .servers import ServerSpec, echo_argv, running_all, serve_argv
from .service_ab import checkout_site

SAMPLE = "/logitserve.v1.LogitServe/Sample"
REGISTER = "/logitserve.v1.SharedMemory/RegisterSystemSharedMemory"
UNREGISTER = "/logitserve.v1.SharedMemory/UnregisterSharedMemory"
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
TINY_SHAPE = (1, 128)
ROWS, PROMPT_LEN, OUTPUT_LEN = 16, 8192, 16384
FILTERS = dict(temperature=0.8, top_k=50, top_p=0.9, seed=7)
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
# The overhead case's calls: plain, and the processors call with its lists sent three ways.
CALLS = ("plain", "lists int64", "lists int32", "lists in a region")


def overhead_inputs(vocab: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The overhead case's logits and lists (the same in every process)."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((ROWS, vocab)) * 3).astype(np.float32)
    lists = {}
    for name, length in (("prompt", PROMPT_LEN), ("output", OUTPUT_LEN)):
        lists[name + "_token_ids"] = rng.integers(0, vocab, ROWS * length, dtype=np.int64)
        lists[name + "_offsets"] = np.arange(0, ROWS * length + 1, length, dtype=np.int64)
    return logits, lists


def kernel_worker(vocab: int) -> None:
    """The kernel-timing worker: for each call name read on stdin, that call's in-process time
    (ms) on stdout. Its first line: the tree its ``logitserve`` comes from."""
    import torch

    from logitserve import kernels

    logits, lists = overhead_inputs(vocab)
    x = torch.from_numpy(logits)
    procs = {k: torch.from_numpy(v) for k, v in lists.items()}
    # Every sampling parameter per row, as the server launches them (server/ops/sample.py).
    params = {k: torch.full((ROWS,), v, dtype=torch.int64 if isinstance(v, int) else torch.float32)
              for k, v in {**FILTERS, "min_p": 0.0, "step": 0}.items()}
    serve_timings({"plain": lambda: kernels.sample(x, **params, backend="torch"),
                   "processors": lambda: kernels.sample(x, **params, **PENALTIES, **procs, backend="torch")})


def serve_timings(calls: dict) -> None:
    """A kernel worker's loop: its tree's path on stdout, then for each call name read on stdin
    that call's in-process time (ms). On a thread of its own, as the server's launch thread runs
    them (torch's CPU parallelism is per calling thread)."""
    from logitserve import kernels

    def timed_call(name: str) -> float:
        t0 = time.perf_counter()
        calls[name]()
        return (time.perf_counter() - t0) * 1e3

    print(os.path.dirname(os.path.dirname(os.path.realpath(kernels.__file__))), flush=True)
    with ThreadPoolExecutor(1) as launch_thread:
        for line in sys.stdin:
            print(launch_thread.submit(timed_call, line.strip()).result(), flush=True)


class KernelTimer:
    """A bench's kernel worker (``python -m MODULE --kernel-worker``: :func:`serve_timings`) in a
    subprocess with ``env``, whose ``import logitserve`` is the server's tree."""

    def __init__(self, env: dict | None, vocab: int, module: str = "bench.processors_cpu"):
        argv = [sys.executable, "-m", module, "--kernel-worker", "--vocab", str(vocab)]
        self.process = subprocess.Popen(argv, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.tree = self.process.stdout.readline().strip()

    def time(self, name: str) -> float:
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def timed(call, raw: bytes) -> float:
    """One call's latency (ms); raises if it failed."""
    t0 = time.perf_counter()
    pb.SampleResponse.FromString(call(raw, timeout=600))
    return (time.perf_counter() - t0) * 1e3


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class RssPeak:
    """The most a process's RSS rose over its level at the start, sampled every 5 ms."""

    def __init__(self, pid: int):
        self.pid, self.base, self.peak = pid, rss_mb(pid), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mb(self.pid) - self.base)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def beside_tiny_calls(target: str, pid: int, send_big, rounds: int) -> dict:
    """Tiny calls back to back while ``send_big()`` runs, ``rounds`` times."""
    tiny = messages.sample_request(np.random.default_rng(1).standard_normal(TINY_SHAPE).astype(np.float32),
                                   seed=3).SerializeToString()
    with grpc.insecure_channel(target, CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(SAMPLE)
        alone = [timed(call, tiny) for _ in range(100)]
        rss = RssPeak(pid)
        worst, big_ms, answered = [], [], []
        for _ in range(rounds):
            done = threading.Event()
            result = {}

            def big():
                try:
                    t0 = time.perf_counter()
                    send_big()
                    result["ms"] = (time.perf_counter() - t0) * 1e3
                finally:
                    done.set()

            during = []
            sender = threading.Thread(target=big)
            sender.start()
            while not done.is_set():
                during.append(timed(call, tiny))
            sender.join()
            big_ms.append(result["ms"])
            worst.append(max(during))
            answered.append(len(during) - 1)  # the last one may have ended after the big call
        rss_growth = rss.stop()
    p50 = statistics.median(alone)
    return dict(tiny_p50_alone=p50, worst_tiny=max(worst), delay=max(worst) - p50, big_call=statistics.median(big_ms),
                tiny_answered_during=min(answered), rss_growth_mb=rss_growth)


class SystemRegion:
    """A shared-memory object holding ``arrays`` one after another, registered as region ``name``
    (by the raw RPC: the region is named as given, whatever the client library's naming)."""

    def __init__(self, channel, name: str, arrays: dict[str, np.ndarray]):
        self.channel, self.name = channel, name
        nbytes = sum(a.nbytes for a in arrays.values())
        self.buf = regions.shared_array((nbytes,), "uint8")
        self.tensors, at = {}, 0
        for field, a in arrays.items():
            self.buf.array[at:at + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            self.tensors[field] = regions.region_tensor(name, a.dtype, a.shape, at)
            at += a.nbytes
        channel.unary_unary(REGISTER)(regions.system_request(name, self.buf, None, 0).SerializeToString(), timeout=60)

    def close(self) -> None:
        self.channel.unary_unary(UNREGISTER)(pb.UnregisterSharedMemoryRequest(name=self.name).SerializeToString(),
                                             timeout=60)
        self.buf.array = None
        self.buf.shm.close()
        self.buf.unlink()


def delay_cases(target: str, pid: int, list_len: int, vocab: int, rounds: int) -> dict[str, dict]:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((1, vocab)).astype(np.float32)
    lists = dict(banned_token_ids=rng.integers(0, vocab, list_len, dtype=np.int64),
                 banned_offsets=np.array([0, list_len], np.int64))
    raw = messages.sample_request(logits, seed=3, **lists).SerializeToString()
    cases = {}
    with grpc.insecure_channel(target, CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(SAMPLE)

        def send(request: bytes):
            return lambda: pb.SampleResponse.FromString(call(request, timeout=600))

        cases[f"as bytes ({len(raw) / 1e6:.0f} MB request)"] = beside_tiny_calls(target, pid, send(raw), rounds)
        region = SystemRegion(channel, "bench-delay-lists", lists)
        try:
            msg = messages.sample_request(logits, seed=3)
            for field, tensor in region.tensors.items():
                getattr(msg, field).CopyFrom(tensor)
            cases["in a system region"] = beside_tiny_calls(target, pid, send(msg.SerializeToString()), rounds)
        finally:
            region.close()
    return cases


def overhead_case(target: str, echo_target: str, kernel: KernelTimer, vocab: int, reps: int) -> dict[str, dict]:
    logits, lists = overhead_inputs(vocab)
    narrow = {k: v.astype(np.int32) for k, v in lists.items()}
    with grpc.insecure_channel(target, CHANNEL_OPTIONS) as channel:
        region = SystemRegion(channel, "bench-overhead-lists", lists)
        try:
            in_region = messages.sample_request(logits, **FILTERS, **PENALTIES)
            for field, tensor in region.tensors.items():
                getattr(in_region, field).CopyFrom(tensor)
            raws = {name: messages.sample_request(logits, **FILTERS, **kw).SerializeToString()
                    for name, kw in (("plain", {}), ("lists int64", {**PENALTIES, **lists}),
                                     ("lists int32", {**PENALTIES, **narrow}))}
            raws["lists in a region"] = in_region.SerializeToString()
            kernel_of = {name: "plain" if name == "plain" else "processors" for name in CALLS}
            service, in_process, floor = ({name: [] for name in CALLS} for _ in range(3))
            with grpc.insecure_channel(echo_target, CHANNEL_OPTIONS) as echo_channel:
                call, echo = channel.unary_unary(SAMPLE), echo_channel.unary_unary(SAMPLE)
                for name in CALLS:  # first calls: connections, plans
                    timed(call, raws[name])
                    echo(raws[name], timeout=60)
                    kernel.time(kernel_of[name])
                for _ in range(reps):
                    for name in CALLS:
                        service[name].append(timed(call, raws[name]))
                        in_process[name].append(kernel.time(kernel_of[name]))
                        t0 = time.perf_counter()
                        echo(raws[name], timeout=60)
                        floor[name].append((time.perf_counter() - t0) * 1e3)
        finally:
            region.close()
    return {name: dict(service=statistics.median(service[name]), kernel=statistics.median(in_process[name]),
                       adds=statistics.median(s - k for s, k in zip(service[name], in_process[name])),
                       floor=statistics.median(floor[name]), mb=len(raws[name]) / 1e6)
            for name in CALLS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", help="run the server and the kernel timing from this tree")
    parser.add_argument("--list-len", type=int, default=10_000_000)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3, help="big calls in each delay case")
    parser.add_argument("--reps", type=int, default=30, help="rounds of the overhead case")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's CPU threads in the server and the kernel worker (OMP_NUM_THREADS)")
    parser.add_argument("--kernel-worker", action="store_true", help=argparse.SUPPRESS)  # KernelTimer's child
    args = parser.parse_args(argv)
    if args.kernel_worker:
        kernel_worker(args.vocab)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.checkout:
        path = [checkout_site(args.checkout), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(path)
    kernel = KernelTimer(env, args.vocab)
    specs = [ServerSpec("cpu", serve_argv("--device", "cpu", "--backend", "torch", "--warmup-dtypes", "float32"),
                        env=env),
             ServerSpec("echo", echo_argv(), is_echo=True)]
    try:
        with running_all(specs, startup_timeout_s=300) as (server, echo):
            overhead = overhead_case(server.target, echo.target, kernel, args.vocab, args.reps)
            delays = delay_cases(server.target, server.pid, args.list_len, args.vocab, args.rounds)
    finally:
        kernel.close()
    load = os.getloadavg()[0]
    print(f"# bench.processors_cpu: {kernel.tree}, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"load average {load:.1f}, OMP_NUM_THREADS={args.threads}")
    print(f"\n## Delay: a Sample 1x{args.vocab} with {args.list_len:,} banned ids beside tiny Samples "
          f"{TINY_SHAPE[0]}x{TINY_SHAPE[1]}, {args.rounds} rounds\n")
    print("| list | tiny p50 alone | worst tiny during | delay | big call p50 | tiny calls answered during | "
          "server RSS rise |\n|---|---:|---:|---:|---:|---:|---:|")
    for label, d in delays.items():
        print(f"| {label} | {d['tiny_p50_alone']:.2f} ms | {d['worst_tiny']:.1f} ms | **{d['delay']:.1f} ms** | "
              f"{d['big_call']:.0f} ms | {d['tiny_answered_during']} | {d['rss_growth_mb']:.0f} MB |")
    print(f"\n## Overhead: Sample {ROWS}x{args.vocab} f32, {ROWS} rows of {PROMPT_LEN:,}-token prompts and "
          f"{OUTPUT_LEN:,}-token outputs, {args.reps} rounds (ms)\n")
    print("| call | request | service p50 | kernel in process p50 | service adds (p50 of the rounds) | "
          "over plain's | gRPC floor (echo server) p50 |\n|---|---:|---:|---:|---:|---:|---:|")
    plain = overhead["plain"]["adds"]
    for name in CALLS:
        o = overhead[name]
        ratio = "" if name == "plain" else f"**{o['adds'] / plain:.2f}x**"
        print(f"| {name} | {o['mb']:.1f} MB | {o['service']:.2f} | {o['kernel']:.2f} | {o['adds']:.2f} | {ratio} | "
              f"{o['floor']:.2f} |")
    print("\nTarget (issue 33): a processors call adds at most 2x what the plain call adds. The gRPC floor: the "
          "same request answered by bench.echo_server (8 bytes back, nothing parsed).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
