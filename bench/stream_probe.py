"""Probe: what it costs to hand work between two processes' streams on one GPU (issue 44, item 0).

An engine process (this one) and a server process (spawned) share one GPU. Each step the engine
runs a "forward" (``torch.cuda._sleep``: a kernel that spins for a set time) and the server a
"sample" (argmax over one 128256-wide float32 row, writing the token where the engine's next step
reads it). Measured per step, the GPU's own time (events around a run whose enqueueing is held
behind a gate the host opens once every step is enqueued, so the host's Python does not pace it):

- ``in_process``: both kernels on the engine's stream: the floor.
- ``device_flags``: the engine writes "logits ready" with ``cuStreamWriteValue64`` into device
  memory shared over CUDA IPC and waits for "done" with ``cuStreamWaitValue64``; the server's
  stream, every step enqueued ahead, waits for "ready", samples and writes "done".
- ``host_flags``: the same marks in POSIX shared memory mapped for the GPU in both processes
  (``cuMemHostRegister`` + ``cuMemHostGetDevicePointer``).
- ``ipc_events``: inter-process events, each record handed to the other side over a pipe before
  its wait is enqueued (a wait cannot be enqueued ahead of its record): a CPU hand-off per step.
- ``graph_wait``: the server's step (wait, reset, sample, write) captured in a CUDA graph and
  replayed, against the engine's eager steps: a wait as a graph node.

Each mode runs at several forward lengths (0, 1 and 5 ms) and the report gives what it adds per
step over ``in_process`` at the same length. With ``--mps`` the server and engine connect to an
MPS daemon started here (the daemon only; the GPU's compute mode is never touched) and the
device and host flag modes run again. The machine's runtime (Firecracker, gVisor) is read from
the kernel's release.

    python -m bench.stream_probe --out probe.json [--mps]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory

from . import stream_probe_server as server
from .stream_probe_server import DONE, FLAG_WORDS, READY, StreamOps, gpu_facts, host_flags, sample_step

VOCAB = 128256
GATE = 2  # the word of the host flags that gates a run's start
RELEASE = 1 << 40  # written to a flag to release every wait on it (a run that timed out)


def runtime_name() -> str:
    release = platform.release()
    if "fc" in release:
        return f"Firecracker ({release})"
    if release.startswith("4.4.0"):
        return f"gVisor ({release})"
    return release


def sleep_cycles_per_us(torch) -> float:
    """``torch.cuda._sleep``'s cycles per microsecond on this card, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) * 1000)


class Engine:
    """The engine's side: its stream, the shared flags, the logits and the token buffer."""

    def __init__(self, torch, ops: StreamOps, steps: int):
        self.torch, self.ops, self.steps = torch, ops, steps
        self.stream, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        self.logits = torch.randn(1, VOCAB, device="cuda")
        self.tokens = torch.zeros(steps + 1, dtype=torch.int64, device="cuda")
        self.device_flags = torch.zeros(8, dtype=torch.int64, device="cuda")
        self.shm = shared_memory.SharedMemory(create=True, size=4096)
        self.host = host_flags(self.shm)
        self.host_flag_ptr = ops.register_host(self.shm)

    def close(self):
        self.ops.unregister_host(self.shm)
        self.host = None
        self.shm.close()
        self.shm.unlink()

    def reset(self):
        self.device_flags.zero_()
        self.host[:] = [0] * FLAG_WORDS
        self.torch.cuda.synchronize()

    def timed(self, enqueue, timeout_s: float = 20.0) -> float:
        """Enqueue every step behind a gate in device memory, open it from a side stream, and
        return the GPU's us per step (the host's Python does not pace the run)."""
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gate = self.device_flags.data_ptr() + 8 * GATE
        with torch.cuda.stream(self.stream):
            self.ops.wait(self.stream, gate, 1)
            start.record()
            enqueue()
            end.record()
        with torch.cuda.stream(self.side):
            self.device_flags[GATE:GATE + 1].fill_(1)
        if not _finished(end, timeout_s):
            self.release()
            if not _finished(end, 5.0):
                raise Stuck("a run's waits did not give way when released: its stream cannot go on")
            raise TimeoutError(f"a run did not finish in {timeout_s} s: its waits were released")
        return start.elapsed_time(end) * 1000 / self.steps

    def release(self):
        """Unblock every wait of either side (a run that stalled), from a side stream."""
        self.host[:] = [RELEASE] * FLAG_WORDS
        with self.torch.cuda.stream(self.side):
            self.device_flags.fill_(RELEASE)


class Stuck(RuntimeError):
    """A stream that cannot go on: the round ends there."""


def _finished(event, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def expect(conn, what=None, timeout_s: float = 120.0):
    """The server's next message: ``what`` if given, else whatever it is; its error raised."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {what or 'answer'!r} from the server in {timeout_s} s")
    got = conn.recv()
    if isinstance(got, tuple) and got and got[0] == "error":
        raise RuntimeError(f"server: {got[1]}")
    if what is not None and got != what:
        raise RuntimeError(f"server answered {got!r}, not {what!r}")
    return got


def run_modes(torch, engine: Engine, conn, cycles_per_us: float, forwards_us: list[int], repeats: int,
              modes: list[str]) -> list[dict]:
    rows = []
    for forward_us in forwards_us:
        cycles = int(forward_us * cycles_per_us)
        for repeat in range(repeats):
            for mode in modes:
                print(f"{mode:>14} forward {forward_us:>5} us  repeat {repeat}: ...", flush=True)
                engine.reset()
                try:
                    us = run_mode(torch, engine, conn, mode, cycles)
                except Stuck as exc:
                    rows.append({"mode": mode, "forward_us": forward_us, "repeat": repeat, "error": repr(exc)})
                    print(f"{mode:>14}: {exc!r}; the round ends", flush=True)
                    return rows
                except Exception as exc:  # noqa: BLE001 - recorded, the other modes go on
                    engine.release()
                    torch.cuda.synchronize()
                    rows.append({"mode": mode, "forward_us": forward_us, "repeat": repeat, "error": repr(exc)})
                    print(f"{mode:>14} forward {forward_us:>5} us  repeat {repeat}: {exc!r}", flush=True)
                    continue
                rows.append({"mode": mode, "forward_us": forward_us, "repeat": repeat, "us_per_step": us})
                print(f"{mode:>14} forward {forward_us:>5} us  repeat {repeat}: {us:9.1f} us/step", flush=True)
    return rows


def run_mode(torch, engine: Engine, conn, mode: str, cycles: int) -> float:
    """One run of ``mode``: the GPU's microseconds per step."""
    ops, steps = engine.ops, engine.steps
    if mode == "in_process":
        def enqueue():
            for n in range(steps):
                if cycles:
                    torch.cuda._sleep(cycles)
                sample_step(torch, engine.logits, engine.tokens, n)
        us = engine.timed(enqueue)
    elif mode in ("device_flags", "host_flags", "graph_wait"):
        base = engine.device_flags.data_ptr() if mode != "host_flags" else engine.host_flag_ptr
        conn.send((mode, steps))
        expect(conn, "enqueued")
        graph = mode == "graph_wait"

        def enqueue():
            for n in range(1, steps + 1):
                if cycles:
                    torch.cuda._sleep(cycles)
                ops.write(engine.stream, base + 8 * READY, 1 if graph else n)
                ops.wait(engine.stream, base + 8 * DONE, 1 if graph else n, equal=graph)
                if graph:
                    ops.write(engine.stream, base + 8 * DONE, 0)
        us = engine.timed(enqueue)
        expect(conn, "finished")
    elif mode == "ipc_events":
        us = ipc_event_steps(torch, engine, conn, cycles)
    else:
        raise ValueError(mode)
    return us


def ipc_event_steps(torch, engine: Engine, conn, cycles: int) -> float:
    """Inter-process events, each record handed over a pipe before the other side's wait."""
    steps = engine.steps
    mine = torch.cuda.Event(interprocess=True, blocking=False)
    conn.send(("ipc_events", steps, mine.ipc_handle()))
    theirs = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), expect(conn))
    start = time.perf_counter()
    with torch.cuda.stream(engine.stream):
        for _ in range(steps):
            if cycles:
                torch.cuda._sleep(cycles)
            mine.record(engine.stream)
            conn.send("recorded")
            expect(conn, "recorded")
            engine.stream.wait_event(theirs)
    engine.stream.synchronize()
    return (time.perf_counter() - start) * 1e6 / steps


def summarize(rows: list[dict]) -> list[str]:
    med = {}
    errors = [f"{row['mode']} forward {row['forward_us']} us: {row['error']}" for row in rows if "error" in row]
    for row in (r for r in rows if "error" not in r):
        med.setdefault((row["mode"], row["forward_us"]), []).append(row["us_per_step"])
    lines = ["| mode | forward (us) | us per step (median) | added over in_process | repeats |", "|---|---:|---:|---:|---|"]
    for (mode, forward_us), values in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        floor = statistics.median(med.get(("in_process", forward_us), [float("nan")]))
        m = statistics.median(values)
        lines.append(f"| {mode} | {forward_us} | {m:.1f} | {m - floor:+.1f} | "
                     f"{', '.join(f'{v:.1f}' for v in values)} |")
    return lines + errors


def start_mps(env: dict) -> tuple[bool, str]:
    pipe, log = tempfile.mkdtemp(prefix="mps-pipe-"), tempfile.mkdtemp(prefix="mps-log-")
    env.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log)
    try:
        done = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"nvidia-cuda-mps-control -d: {exc}"
    return done.returncode == 0, f"rc {done.returncode} {done.stdout.strip()} {done.stderr.strip()}"


def stop_mps(env: dict) -> str:
    done = subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=env, capture_output=True, text=True,
                          timeout=30)
    log = os.path.join(env["CUDA_MPS_LOG_DIRECTORY"], "control.log")
    tail = open(log).read()[-2000:] if os.path.exists(log) else ""
    return f"quit rc {done.returncode}; control.log: {tail}"


def one_round(label: str, args, modes: list[str]) -> dict:
    """Spawn the server, run the modes from this process as the engine, return the rows."""
    import torch
    import torch.multiprocessing

    torch.cuda.init()
    ops = StreamOps()
    engine = Engine(torch, ops, args.steps)
    cycles_per_us = sleep_cycles_per_us(torch)
    print(f"{label}: engine ready, torch.cuda._sleep at {cycles_per_us:.0f} cycles/us", flush=True)
    ctx = torch.multiprocessing.get_context("spawn")  # its reductions pass CUDA tensors over IPC
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server.serve, args=(child, engine.device_flags, engine.shm.name, engine.logits,
                                                   engine.tokens))
    proc.start()
    try:
        expect(parent, "ready")
        print(f"{label}: server ready", flush=True)
        rows = run_modes(torch, engine, parent, cycles_per_us, args.forwards, args.repeats, modes)
        parent.send(("stop",))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        engine.close()
    return {"label": label, "cycles_per_us": cycles_per_us, "rows": rows, "facts": gpu_facts(torch, ops)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forwards", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1000, 5000])
    parser.add_argument("--modes", default="in_process,device_flags,host_flags,ipc_events,graph_wait")
    parser.add_argument("--mps", action="store_true", help="also under an MPS daemon started here")
    parser.add_argument("--out", default="stream_probe.json")
    parser.add_argument("--budget-s", type=float, default=400, help="end (exit 3) after this long, whatever is left")
    args = parser.parse_args(argv)
    watchdog = threading.Timer(args.budget_s, _out_of_time, (args.budget_s,))
    watchdog.daemon = True
    watchdog.start()
    modes = args.modes.split(",")
    report = {"runtime": runtime_name(), "python": sys.version.split()[0], "rounds": []}
    print(f"runtime: {report['runtime']}", flush=True)
    report["rounds"].append(one_round("no MPS", args, modes))
    if args.mps:
        env = dict(os.environ)
        ok, why = start_mps(env)
        report["mps_start"] = why
        print(f"MPS daemon: {ok} {why}", flush=True)
        if ok:
            os.environ.update(CUDA_MPS_PIPE_DIRECTORY=env["CUDA_MPS_PIPE_DIRECTORY"],
                              CUDA_MPS_LOG_DIRECTORY=env["CUDA_MPS_LOG_DIRECTORY"])
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=_mps_round, args=(queue, args, ["in_process", "device_flags", "host_flags"]))
            proc.start()
            proc.join(400)
            if proc.is_alive():
                proc.kill()
                report["mps_round"] = "timed out"
            else:
                report["rounds"].append(queue.get(timeout=5) if not queue.empty() else {"label": "MPS", "error": "none"})
            report["mps_stop"] = stop_mps(env)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for round_ in report["rounds"]:
        print(f"\n## {round_['label']} ({report['runtime']}); facts: {round_.get('facts')}")
        print("\n".join(summarize(round_.get("rows", []))))
    return 0


def _out_of_time(budget_s: float) -> None:
    print(f"--budget-s {budget_s:g} spent: exiting (the rows printed above are the results)", flush=True)
    os._exit(3)


def _mps_round(queue, args, modes):
    """A fresh process (its CUDA context made under MPS) runs one round as the engine."""
    try:
        queue.put(one_round("MPS", args, modes))
    except BaseException as exc:  # noqa: BLE001 - reported in the report
        queue.put({"label": "MPS", "error": repr(exc)})


if __name__ == "__main__":
    sys.exit(main())
