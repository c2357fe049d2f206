"""Where a service call's time goes inside the server, measured in-process, piece by piece.

    python -m bench.service_breakdown --device cpu --out breakdown.md
    python -m bench.service_breakdown --device cuda:0 --batches 1,8,64

Runs the server's own code on the request bytes ``bench.service`` sends, without gRPC:

- ``parse``: ``SampleRequest.FromString`` (protobuf), per request;
- ``validate``: ``ops.SampleCall.from_pb``: checks, no copy of the logits, per request;
- ``hop``: handing a launch to the device's executor thread and back (``DeviceHandle.submit``
  of a no-op from the event loop), per launch;
- ``copy in``, ``kernel``, ``copy out``: ``run_batch`` of B requests (what one launch
  does, eagerly: a CUDA graph replay has no kernel call to split at), split where it calls the kernel: concatenating the rows and moving them (and the
  per-row parameters) to the device / the kernel, synchronized / the result back to the host
  and split per request. Per launch;
- ``reply``: ``result.to_pb().SerializeToString()``, per request.

``per request`` adds the per-request pieces and the per-launch pieces divided by B: the
server's work per call at batch B, queueing and transport excluded (``bench.service`` reports
those: its ``queue mean us`` and the echo server's latency). Medians over ``--repeat`` runs
(or ``--max-seconds`` per piece). ``other load`` is the CPU other processes used meanwhile, as
a share of the machine; ``--retries`` measures a disturbed row again and keeps the least
disturbed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable

import torch

from logitserve import kernels
from logitserve.server import ops
from logitserve.server.device import DeviceHandle
from logitserve.v1 import logitserve_pb2 as pb

from .service import OtherLoad, Payload, payloads

PIECES = ("parse", "validate", "hop", "copy in", "kernel", "copy out", "reply")
PER_LAUNCH = ("hop", "copy in", "kernel", "copy out")
OPS = {
    "Sample": (pb.SampleRequest, ops.SampleCall, "sample"),
    "RouteExperts": (pb.RouteExpertsRequest, ops.RouteExpertsCall, "topk_softmax"),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_us(fn: Callable[[], object], repeat: int, max_seconds: float, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    deadline = time.perf_counter() + max_seconds
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def split_at_kernel(name: str, device: torch.device, marks: list[float]):
    """Wrap ``kernels.<name>`` (as ops calls it) to record synchronized times around it."""
    real = getattr(kernels, name)

    def timed(*args, **kwargs):
        _sync(device)
        marks.append(time.perf_counter_ns())
        out = real(*args, **kwargs)
        _sync(device)
        marks.append(time.perf_counter_ns())
        return out

    setattr(kernels, name, timed)
    try:
        yield
    finally:
        setattr(kernels, name, real)


def launch_pieces(call_type, calls: list, handle: DeviceHandle, kernel_name: str, repeat: int,
                  max_seconds: float) -> dict[str, float]:
    """Median copy in / kernel / copy out of ``run_batch(calls)``, in us."""
    samples: dict[str, list[float]] = {"copy in": [], "kernel": [], "copy out": []}
    deadline = time.perf_counter() + max_seconds
    with split_at_kernel(kernel_name, handle.device, marks := []):
        for i in range(repeat + 3):
            marks.clear()
            _sync(handle.device)
            t0 = time.perf_counter_ns()
            call_type.run_batch(calls, handle)
            _sync(handle.device)
            t3 = time.perf_counter_ns()
            t1, t2 = marks
            if i >= 3:  # warm-up launches
                samples["copy in"].append((t1 - t0) / 1e3)
                samples["kernel"].append((t2 - t1) / 1e3)
                samples["copy out"].append((t3 - t2) / 1e3)
                if len(samples["kernel"]) >= 3 and time.perf_counter() > deadline:
                    break
    return {k: statistics.median(v) for k, v in samples.items()}


def hop_us(handle: DeviceHandle, repeat: int) -> float:
    """Median round trip of a no-op through the device's executor thread, from the event loop."""
    async def run() -> float:
        for _ in range(10):
            await handle.submit(lambda: None)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            await handle.submit(lambda: None)
            times.append((time.perf_counter_ns() - t0) / 1e3)
        return statistics.median(times)

    return asyncio.run(run())


def measure(payload: Payload, batch: int, handle: DeviceHandle, args) -> dict[str, float]:
    rpc = payload.method.rsplit("/", 1)[-1]
    request_type, call_type, kernel_name = OPS[rpc]
    limits = ops.Limits(max_rows=1 << 20, max_vocab=1 << 20)
    raws = [payload.requests[i % len(payload.requests)] for i in range(batch)]
    messages = [request_type.FromString(raw) for raw in raws]
    calls = [call_type.from_pb(m, limits) for m in messages]
    results = call_type.run_batch(calls, handle)
    pieces = {
        "parse": median_us(lambda: request_type.FromString(raws[0]), args.repeat, args.max_seconds),
        "validate": median_us(lambda: call_type.from_pb(messages[0], limits), args.repeat, args.max_seconds),
        "reply": median_us(lambda: results[0].to_pb().SerializeToString(), args.repeat, args.max_seconds),
        "hop": hop_us(handle, args.repeat),
    }
    pieces.update(launch_pieces(call_type, calls, handle, kernel_name, args.repeat, args.max_seconds))
    pieces["per request"] = sum(pieces[p] / (batch if p in PER_LAUNCH else 1) for p in PIECES)
    return pieces


def measure_least_disturbed(payload: Payload, batch: int, handle: DeviceHandle, args) -> dict[str, float]:
    best = None
    for _ in range(args.retries + 1):
        monitor = OtherLoad([os.getpid()])
        pieces = measure(payload, batch, handle, args)
        pieces["other load"] = monitor.fraction()
        if best is None or (pieces["other load"] or 0.0) < (best["other load"] or 0.0):
            best = pieces
        if best["other load"] is None or best["other load"] <= args.max_other_load:
            break
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--batches", default="1,8,64", help="requests per launch (default 1,8,64)")
    parser.add_argument("--repeat", type=int, default=200, help="runs per piece (median)")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="time bound per piece")
    parser.add_argument("--payloads", default="", help="comma-separated substrings selecting payloads")
    parser.add_argument("--retries", type=int, default=0,
                        help="measure a row again, up to this many times, while other processes used more than "
                             "--max-other-load of the CPUs")
    parser.add_argument("--max-other-load", type=float, default=0.1, help="fraction of all CPUs (default 0.1)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)

    handle = DeviceHandle(args.device, args.backend, cuda_graphs=False)
    cases = [p for p in payloads()
             if not args.payloads or any(sel.strip() in p.name for sel in args.payloads.split(","))]
    lines = [
        f"Service breakdown: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
        f"device {handle.device} ({handle.name}), backend {handle.backend}, torch {torch.__version__}.",
        f"Command: `python -m bench.service_breakdown {shlex.join(argv if argv is not None else sys.argv[1:])}`; "
        "medians in us; parse, validate and reply per request, the rest per launch of B requests.",
        "",
        "| payload | B | " + " | ".join(PIECES) + " | per request | other load |",
        "|---|---:|" + "---:|" * (len(PIECES) + 2),
    ]
    print("\n".join(lines), flush=True)
    try:
        for payload in cases:
            for batch in (int(b) for b in args.batches.split(",")):
                p = measure_least_disturbed(payload, batch, handle, args)
                other = "" if p["other load"] is None else f"{p['other load']:.0%}"
                row = (f"| {payload.name} | {batch} | " + " | ".join(f"{p[k]:.0f}" for k in PIECES)
                       + f" | {p['per request']:.0f} | {other} |")
                print(row, flush=True)
                lines.append(row)
    finally:
        handle.close()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
