"""Where a service call's time goes inside the server, measured in-process, piece by piece.

    python -m bench.service_breakdown --device cpu --out breakdown.md
    python -m bench.service_breakdown --device cuda:0 --batches 1,8,64

Runs the server's own code on the request bytes ``bench.service`` sends, without gRPC:

- ``parse``: the server's deserializer of the method (its tensors read in place, server/wire.py),
  per request;
- ``validate``: ``ops.SampleCall.from_pb``: checks, no copy of the logits, per request;
- ``launch``: ``run_batch`` of B requests on an event loop, as the server runs it: on CUDA
  the batch's graph replay, spun for on the loop for B = 1 (a call that finds the server idle)
  and waited for on the launch thread otherwise (``--cuda-graphs off``: the eager launch, on
  the launch thread), on the CPU the launch thread. Inputs staged, outputs split per request.
  Per launch;
- ``reply``: ``result.to_pb().SerializeToString()``, per request.

``per request`` adds the per-request pieces and the per-launch pieces divided by B: the
server's work per call at batch B, queueing and transport excluded (``bench.service`` reports
those: its ``queue mean us`` and the echo server's latency). ``--pause-us`` sleeps before each
timed run, as a server idles between one client's calls. Medians over ``--repeat`` runs
(or ``--max-seconds`` per piece). ``other load`` is the CPU other processes used meanwhile, as
a share of the machine; ``--retries`` measures a disturbed row again and keeps the least
disturbed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable

import torch

from logitserve.server import ops
from logitserve.server.device import DeviceHandle, Wait
from logitserve.server.servicer import request_parsers

from .service import OtherLoad, Payload, payloads

PIECES = ("parse", "validate", "launch", "reply")
PER_LAUNCH = ("launch",)
OPS = {"Sample": ops.SampleCall, "RouteExperts": ops.RouteExpertsCall}


def median_us(fn: Callable[[], object], repeat: int, max_seconds: float, pause_s: float = 0.0,
              warmup: int = 3) -> float:
    """Median time of ``fn()`` in us, each run after a sleep of ``pause_s`` (0: back to back)."""
    for _ in range(warmup):
        fn()
    times = []
    deadline = time.perf_counter() + max_seconds
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() < deadline):
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(times)


def launch_us(call_type, calls: list, handle: DeviceHandle, repeat: int, max_seconds: float, pause_s: float) -> float:
    """Median time of ``run_batch(calls)`` on an event loop, in us."""
    loop = asyncio.new_event_loop()
    try:
        wait = Wait.SPIN if len(calls) == 1 else Wait.THREAD  # as an idle server's lone call, or under load
        return median_us(lambda: loop.run_until_complete(call_type.run_batch(calls, handle, wait=wait)),
                         repeat, max_seconds, pause_s)
    finally:
        loop.close()


def measure(payload: Payload, batch: int, handle: DeviceHandle, args) -> dict[str, float]:
    rpc = payload.method.rsplit("/", 1)[-1]
    call_type = OPS[rpc]
    parse = request_parsers()[payload.method]
    limits = ops.Limits(max_rows=1 << 20, max_vocab=1 << 20)
    raws = [payload.requests[i % len(payload.requests)] for i in range(batch)]
    received = [parse(raw) for raw in raws]
    calls = [call_type.from_pb(r.message, limits, in_place=r.tensor_bytes) for r in received]
    results = asyncio.run(call_type.run_batch(calls, handle))
    pause_s = args.pause_us * 1e-6
    pieces = {
        "parse": median_us(lambda: parse(raws[0]), args.repeat, args.max_seconds, pause_s),
        "validate": median_us(lambda: call_type.from_pb(received[0].message, limits, in_place=received[0].tensor_bytes),
                              args.repeat, args.max_seconds, pause_s),
        "reply": median_us(lambda: results[0].to_pb().SerializeToString(), args.repeat, args.max_seconds, pause_s),
        "launch": launch_us(call_type, calls, handle, args.repeat, args.max_seconds, pause_s),
    }
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
    parser.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    parser.add_argument("--batches", default="1,8,64", help="requests per launch (default 1,8,64)")
    parser.add_argument("--repeat", type=int, default=200, help="runs per piece (median)")
    parser.add_argument("--pause-us", type=int, default=0,
                        help="sleep this long before each timed run, as a server between one client's calls "
                             "(0: back to back)")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="time bound per piece")
    parser.add_argument("--payloads", default="", help="comma-separated substrings selecting payloads")
    parser.add_argument("--retries", type=int, default=0,
                        help="measure a row again, up to this many times, while other processes used more than "
                             "--max-other-load of the CPUs")
    parser.add_argument("--max-other-load", type=float, default=0.1, help="fraction of all CPUs (default 0.1)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)

    handle = DeviceHandle(args.device, args.backend, cuda_graphs=args.cuda_graphs == "on")
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
