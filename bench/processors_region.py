"""Issue 45's CPU target: a greedy Sample whose logits are in a POSIX region and whose
frontend-sized lists come as bytes, through the CPU server, against the same call in process.

    python -m bench.processors_region [--trees DIR [DIR ...]] [--reps 30] [--stack-samples FILE]

16 rows of ``--vocab`` float32 logits in a registered system shared-memory region, greedy
(temperature 0, seeded), called two ways: **plain**, and **processors**: repetition, frequency and
presence penalties over 8,192-token prompts and 16,384-token outputs, 64 logit bias entries a
row and a grammar bitmask ``[16, ceil(V / 32)]`` (random bits), every list int64 bytes in the
request (serialized beforehand); and the same with the lists and bitmask in the logits' region
too. What the service adds to a call: its time through the service
minus the same call's time in process (``kernels.sample``, torch backend, every sampling
parameter a per-row tensor as the server launches it, in a worker process of the server's tree,
on a thread of its own), timed one after the other; the median of those differences over
``--reps`` rounds. Target (issue 45): the processors call adds at most twice what the plain call
adds, plus 5 ms. Beside them, each request's gRPC floor: ``bench.echo_server``'s time to answer it.

``--trees`` runs a server and a kernel worker from each tree named (``git archive REV src | tar
-x -C DIR``, as for ``bench.service_ab``; default: this checkout), and every round times every
tree, in an order that alternates from round to round: before and after a change, interleaved
on one machine. ``--stack-samples FILE`` samples the first tree's server threads
(``bench.stack_profile``) during 100 calls of each kind made after the timed rounds, and prints
a summary for each.

Torch runs one CPU thread in the servers and the kernel workers (OMP_NUM_THREADS=1), as for
``bench.processors_cpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

from logitserve.client import messages
from logitserve.v1 import logitserve_pb2 as pb

from .processors_cpu import (CHANNEL_OPTIONS, PENALTIES, ROWS, SAMPLE, KernelTimer, SystemRegion, overhead_inputs,
                             serve_timings, timed)
from .servers import ServerSpec, echo_argv, running_all, serve_argv
from .service_ab import checkout_site

BIAS_PER_ROW = 64
GREEDY = dict(temperature=0.0, seed=7)
CALLS = ("plain", "processors", "processors, lists in the region")
KERNEL_OF = {"plain": "plain", "processors": "processors", "processors, lists in the region": "processors"}


def case_inputs(vocab: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The logits and the processors' lists and bitmask (the same in every process)."""
    logits, lists = overhead_inputs(vocab)
    rng = np.random.default_rng(45)
    entries = ROWS * BIAS_PER_ROW
    lists.update(logit_bias_ids=rng.integers(0, vocab, entries, dtype=np.int64),
                 logit_bias_offsets=np.arange(0, entries + 1, BIAS_PER_ROW, dtype=np.int64),
                 logit_bias_values=rng.uniform(-2, 2, entries).astype(np.float32),
                 grammar_bitmask=rng.integers(-2**31, 2**31, (ROWS, (vocab + 31) // 32), dtype=np.int64)
                 .astype(np.int32))
    return logits, lists


def kernel_worker(vocab: int) -> None:
    """For each call name read on stdin, that call's in-process time (ms) on stdout; the first
    line: the tree its ``logitserve`` comes from."""
    import torch

    from logitserve import kernels

    logits, lists = case_inputs(vocab)
    x = torch.from_numpy(logits)
    procs = {k: torch.from_numpy(v) for k, v in lists.items()}
    defaults = dict(top_k=0, top_p=1.0, min_p=0.0, step=0)
    params = {k: torch.full((ROWS,), v, dtype=torch.int64 if isinstance(v, int) else torch.float32)
              for k, v in {**GREEDY, **defaults}.items()}
    serve_timings({"plain": lambda: kernels.sample(x, **params, backend="torch"),
                   "processors": lambda: kernels.sample(x, **params, **PENALTIES, **procs, backend="torch")})


def requests(region: SystemRegion, lists: dict[str, np.ndarray], vocab: int) -> dict[str, bytes]:
    """Each call's request, serialized: the logits named in ``region``, the lists as bytes or
    named in ``region`` too."""
    out = {}
    for name, kw in (("plain", {}), ("processors", {**PENALTIES, **lists}), (CALLS[2], PENALTIES)):
        msg = messages.sample_request(np.zeros((ROWS, vocab), np.float32), **GREEDY, **kw)
        for field in ("logits", *(lists if name == CALLS[2] else ())):
            getattr(msg, field).CopyFrom(region.tensors[field])
        out[name] = msg.SerializeToString()
    return out


def measure(calls, raws: list[dict[str, bytes]], kernels: list[KernelTimer], echo, reps: int) -> list[dict]:
    """Per tree: each call's service p50, kernel p50, the median of (service - kernel), and the
    request's gRPC floor: ``echo``'s time to answer it (bench.echo_server, nothing parsed)."""
    trees = range(len(calls))
    service = [{n: [] for n in CALLS} for _ in trees]
    in_process = [{n: [] for n in CALLS} for _ in trees]
    floor = {n: [] for n in CALLS}
    for tree in trees:  # first calls: connections, plans
        for name in CALLS:
            timed(calls[tree], raws[tree][name])
            kernels[tree].time(KERNEL_OF[name])
    for rep in range(reps):
        for tree in (trees if rep % 2 == 0 else reversed(trees)):
            for name in CALLS:
                service[tree][name].append(timed(calls[tree], raws[tree][name]))
                in_process[tree][name].append(kernels[tree].time(KERNEL_OF[name]))
        for name in CALLS:
            t0 = time.perf_counter()
            echo(raws[0][name], timeout=60)
            floor[name].append((time.perf_counter() - t0) * 1e3)
    return [{name: dict(service=statistics.median(s[name]), kernel=statistics.median(k[name]),
                        adds=statistics.median(a - b for a, b in zip(s[name], k[name])), mb=len(raws[0][name]) / 1e6,
                        floor=statistics.median(floor[name]))
             for name in CALLS} for s, k in zip(service, in_process)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", metavar="DIR", help="a server and kernel worker from each of these "
                        "trees, timed in turn (default: this checkout)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--stack-samples", metavar="FILE", help="sample the first server's threads into FILE")
    parser.add_argument("--server-args", nargs="+", metavar="FLAGS",
                        help="more flags for each tree's server, one string a tree (e.g. '--busy-poll-us 0' '')")
    parser.add_argument("--kernel-worker", action="store_true", help=argparse.SUPPRESS)  # KernelTimer's child
    args = parser.parse_args(argv)
    if args.kernel_worker:
        kernel_worker(args.vocab)
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    envs = [{**base, "PYTHONPATH": os.pathsep.join([checkout_site(tree), *path])} for tree in args.trees or [here]]
    server_envs = [dict(e) for e in envs]
    if args.stack_samples:
        from .stack_profile import ENV, sitecustomize_dir
        hook = sitecustomize_dir(here, tempfile.mkdtemp(prefix="stack-profile-"))
        server_envs[0]["PYTHONPATH"] = os.pathsep.join([hook, server_envs[0]["PYTHONPATH"]])
        server_envs[0][ENV] = os.path.abspath(args.stack_samples)
    flags = args.server_args or [""] * len(envs)
    if len(flags) != len(envs):
        parser.error(f"--server-args: one string a tree ({len(envs)}), got {len(flags)}")
    kernels = [KernelTimer(e, args.vocab, module="bench.processors_region") for e in envs]
    specs = [ServerSpec(f"cpu {i}", serve_argv("--device", "cpu", "--backend", "torch", "--warmup-dtypes", "float32",
                                               "--warmup-widths", str(args.vocab), *shlex.split(f)), env=e)
             for i, (e, f) in enumerate(zip(server_envs, flags))] + [ServerSpec("echo", echo_argv(), is_echo=True)]
    windows = {}
    try:
        with running_all(specs, startup_timeout_s=300) as (*servers, echo), contextlib.ExitStack() as stack:
            logits, lists = case_inputs(args.vocab)
            channels = [stack.enter_context(grpc.insecure_channel(s.target, CHANNEL_OPTIONS)) for s in servers]
            regions = [SystemRegion(c, f"bench-region-{i}", {"logits": logits, **lists})
                       for i, c in enumerate(channels)]
            for region in regions:
                stack.callback(region.close)
            raws = [requests(r, lists, args.vocab) for r in regions]
            calls = [c.unary_unary(SAMPLE) for c in channels]
            echo_channel = stack.enter_context(grpc.insecure_channel(echo.target, CHANNEL_OPTIONS))
            results = measure(calls, raws, kernels, echo_channel.unary_unary(SAMPLE), args.reps)
            if args.stack_samples:
                for name in CALLS:
                    t0 = time.time()
                    for _ in range(100):
                        pb.SampleResponse.FromString(calls[0](raws[0][name], timeout=600))
                    windows[name] = (t0, time.time())
    finally:
        for k in kernels:
            k.close()
    rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(f"# bench.processors_region: HEAD {rev.strip()}, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, {args.reps} rounds, trees interleaved")
    print(f"\nGreedy Sample {ROWS}x{args.vocab} f32 in a system region; processors: 3 penalties over 8,192-token "
          f"prompts and 16,384-token outputs, {BIAS_PER_ROW} bias entries a row, a grammar bitmask, as int64 bytes "
          f"(ms)\n")
    print("| tree | call | request | service p50 | kernel in process p50 | service adds (p50 of the rounds) | "
          "target (2x plain's + 5) | met | gRPC floor p50 |\n|---|---|---:|---:|---:|---:|---:|---|---:|")
    for kernel, result, tree_flags in zip(kernels, results, flags):
        line = 2 * result["plain"]["adds"] + 5
        for name in CALLS:
            r = result[name]
            target = "" if name == "plain" else f"{line:.2f}"
            met = "" if name == "plain" else ("yes" if r["adds"] <= line * 1.1 else "no")
            print(f"| {kernel.tree} {tree_flags} | {name} | {r['mb']:.1f} MB | {r['service']:.2f} | {r['kernel']:.2f} | "
                  f"**{r['adds']:.2f}** | {target} | {met} | {r['floor']:.2f} |")
    if windows:
        from .stack_profile import summarize
        for name, window in windows.items():
            print(f"\n### the first tree's server threads during 100 {name} calls\n")
            print("\n".join(summarize(args.stack_samples, *window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
