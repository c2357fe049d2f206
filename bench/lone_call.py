"""Issue 45's lone tiny call: event-loop callbacks per call, latency over gRPC and the same-host
channel, and the server's CPU time per call, two source trees interleaved.

    python -m bench.lone_call turns                      # this process's tree: loop callbacks a call
    python -m bench.lone_call compare --before B/src --after A/src [--rounds 3] [--out lone.json]
    python -m bench.lone_call profile --tree A/src --stack-samples FILE [--transport shm] [--busy-poll-us 0]

``--device`` / ``--backend`` pick the servers' device (default cpu, torch; ``--device cuda:0
--backend auto`` on a GPU host).

``turns``: an in-process server (``ServerThread``) on the loop ``logitserve serve`` runs (busy
polling, 2000 us), asyncio's ``Handle._run`` counted on the server's thread (patched in this
process only: no hook in the server). Each call is counted from before the client sends to 20 ms
after its answer (so the metrics and log callbacks that follow the answer count too), the median
of ``--calls`` calls, with one call's callbacks by name.

``compare``: ``turns`` for each tree (a subprocess with PYTHONPATH set to it), then one server
subprocess per tree and busy-poll setting (``--max-delay-us 0``, the default ``--busy-poll-us
2000`` and 0), measured round by round in turn from this process: RouteExperts 1x8 float32 k=2
and Sample 1x32000 float32, each over gRPC and over the same-host channel, ``--seconds`` per case
and round; p50/p99 of each call, and the server's CPU time (utime + stime of
``/proc/<pid>/stat``, all its threads) over the case's calls. The client is this process's tree.
A lone client calling back to back keeps a busy-polling server spinning between calls: its CPU
per call is mostly that spin, so the poll-off servers show the calls' own CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from .servers import ServerSpec, running_all, serve_argv
from .trees import tree_env

SERVER_FLAGS = ("--max-delay-us", "0", "--warmup-dtypes", "float32")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cases(client):
    gate = np.random.default_rng(1).standard_normal((1, 8), dtype=np.float32)
    logits = np.random.default_rng(2).standard_normal((1, 32000), dtype=np.float32)
    return {"route_1x8": lambda: client.route_experts(gate, 2),
            "sample_1x32000": lambda: client.sample(logits, temperature=0.8, top_k=50, top_p=0.9, seed=1)}


def _flags(args) -> tuple[str, ...]:
    return ("--device", args.device, "--backend", args.backend, *SERVER_FLAGS)


# ------------------------------------------------------------------------------------ turns


def turns(calls: int, device: str, backend: str) -> dict:
    """Loop callbacks per lone call, by case and transport, on an in-process server."""
    from logitserve.client import Client
    from logitserve.server import ServerConfig
    from logitserve.server.testing import ServerThread
    try:
        from logitserve.server.engine.busy_poll import BusyPollEventLoop
    except ModuleNotFoundError:  # a tree before server/engine/ (issue 45's baseline, 3ba2b80)
        from logitserve.server.busy_poll import BusyPollEventLoop

    counted = collections.Counter()
    names: list[str] = []
    record = [False]
    run = asyncio.events.Handle._run

    def counting(handle):
        if threading.current_thread().name == "logitserve-test-server":
            counted["callbacks"] += 1
            if record[0]:
                callback = handle._callback
                names.append(getattr(callback, "__qualname__", None) or repr(callback))
        return run(handle)

    asyncio.events.Handle._run = counting
    config = ServerConfig(host="127.0.0.1", port=0, device=device, backend=backend, warmup_dtypes=())
    new_loop = asyncio.new_event_loop
    asyncio.new_event_loop = lambda: BusyPollEventLoop(config.busy_poll_us)  # as `logitserve serve` runs
    try:
        server = ServerThread(config)
    finally:
        asyncio.new_event_loop = new_loop
    out = {}
    try:
        for transport in ("grpc", "shm"):
            with Client(server.target, timeout=60, channel=transport) as client:
                for case, call in _cases(client).items():
                    for _ in range(20):
                        call()
                    spent = []
                    for i in range(calls):
                        record[0] = i == calls - 1
                        names.clear() if record[0] else None
                        before = counted["callbacks"]
                        call()
                        time.sleep(0.02)
                        spent.append(counted["callbacks"] - before)
                    record[0] = False
                    out[f"{case} {transport}"] = dict(median=statistics.median(spent), min=min(spent),
                                                      max=max(spent), last_call=list(names))
    finally:
        server.close()
        asyncio.events.Handle._run = run
    return out


# ---------------------------------------------------------------------------------- compare


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14, 15)


def _timed(call, pid: int, seconds: float) -> dict:
    ns = []
    cpu0, start = _cpu_s(pid), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter_ns()
        call()
        ns.append(time.perf_counter_ns() - t0)
    cpu = _cpu_s(pid) - cpu0
    us = np.asarray(ns) / 1e3
    return dict(calls=len(ns), p50_us=float(np.percentile(us, 50)), p99_us=float(np.percentile(us, 99)),
                server_cpu_us_per_call=cpu / len(ns) * 1e6)


def compare(args) -> dict:
    from logitserve.client import Client

    trees = {"before": args.before, "after": args.after}
    result = {"turns": {}, "rounds": []}
    for label, src in trees.items():
        env = tree_env(src)
        out = subprocess.run([sys.executable, "-m", "bench.lone_call", "turns", "--calls", str(args.turn_calls),
                              "--device", args.device, "--backend", args.backend],
                             env=env, check=True, capture_output=True, text=True).stdout
        result["turns"][label] = json.loads(out)
        print(f"# turns {label}: " + ", ".join(f"{k} {v['median']}" for k, v in result["turns"][label].items()),
              file=sys.stderr, flush=True)
    specs = [ServerSpec(f"{label} poll {poll}", serve_argv(*_flags(args), "--busy-poll-us", str(poll)),
                        env=tree_env(src))
             for poll in (2000, 0) for label, src in trees.items()]
    with running_all(specs, 600) as servers, contextlib.ExitStack() as stack:
        clients = {(spec.label, t): stack.enter_context(Client(server.target, timeout=60, channel=t))
                   for spec, server in zip(specs, servers) for t in ("grpc", "shm")}
        for (label, transport), client in clients.items():
            for call in _cases(client).values():
                for _ in range(50):
                    call()
        for r in range(args.rounds):
            for spec, server in zip(specs, servers):
                for transport in ("grpc", "shm"):
                    for case, call in _cases(clients[spec.label, transport]).items():
                        m = _timed(call, server.pid, args.seconds)
                        result["rounds"].append(dict(round=r, server=spec.label, transport=transport, case=case, **m))
                        print(f"# {r} {spec.label} {transport} {case}: p50 {m['p50_us']:.0f} us, p99 "
                              f"{m['p99_us']:.0f} us, server cpu {m['server_cpu_us_per_call']:.0f} us/call",
                              file=sys.stderr, flush=True)
    return result


def profile(args) -> list[str]:
    """One server of ``--tree`` sampled by bench.stack_profile while a lone client calls
    RouteExperts 1x8 back to back over ``--transport`` for ``--seconds``: where the time goes."""
    import tempfile

    from logitserve.client import Client

    from .stack_profile import ENV, sitecustomize_dir, summarize

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hook = sitecustomize_dir(repo, tempfile.mkdtemp(prefix="stack-profile-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([hook, args.tree]), **{ENV: os.path.abspath(args.stack_samples)})
    spec = ServerSpec("profiled", serve_argv(*_flags(args), "--busy-poll-us", str(args.busy_poll_us)), env=env)
    with running_all([spec], 600) as (server,), Client(server.target, timeout=60, channel=args.transport) as client:
        call = _cases(client)["route_1x8"]
        for _ in range(200):
            call()
        start = time.time()
        m = _timed(call, server.pid, args.seconds)
        end = time.time()
    time.sleep(0.1)
    return [f"# RouteExperts 1x8 over {args.transport}, --busy-poll-us {args.busy_poll_us}: {m['calls']} calls, "
            f"p50 {m['p50_us']:.0f} us (sampled: slower than unsampled)", *summarize(args.stack_samples, start, end)]


def table(result: dict) -> list[str]:
    """Markdown: the median over rounds of each (server, transport, case)."""
    by = collections.defaultdict(list)
    for row in result["rounds"]:
        by[row["server"], row["transport"], row["case"]].append(row)
    lines = ["| server | transport | case | p50 us | p99 us | server CPU us/call | loop callbacks/call |",
             "|---|---|---|---:|---:|---:|---:|"]
    for (server, transport, case), rows in by.items():
        label = server.split()[0]
        turn = result["turns"].get(label, {}).get(f"{case} {transport}", {}).get("median", "")
        lines.append(f"| {server} | {transport} | {case} | {statistics.median(r['p50_us'] for r in rows):.0f} | "
                     f"{statistics.median(r['p99_us'] for r in rows):.0f} | "
                     f"{statistics.median(r['server_cpu_us_per_call'] for r in rows):.0f} | {turn} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("turns", help="loop callbacks per lone call, this tree (JSON on stdout)")
    t.add_argument("--calls", type=int, default=30)
    c = sub.add_parser("compare", help="two trees interleaved: turns, latency, server CPU")
    c.add_argument("--before", required=True, help="the src directory of the tree before")
    c.add_argument("--after", required=True, help="the src directory of the tree after")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--seconds", type=float, default=1.5, help="per case, server and round")
    c.add_argument("--turn-calls", type=int, default=30)
    c.add_argument("--out", help="write every round to this JSON file")
    p = sub.add_parser("profile", help="where a server's time goes during lone RouteExperts 1x8 calls")
    p.add_argument("--tree", required=True, help="the server's src directory")
    p.add_argument("--transport", default="shm", choices=("grpc", "shm"))
    p.add_argument("--busy-poll-us", type=int, default=0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--stack-samples", required=True, metavar="FILE")
    for mode in (t, c, p):
        mode.add_argument("--device", default="cpu", help="the server's --device (default cpu)")
        mode.add_argument("--backend", default="torch", help="the server's --backend (default torch)")
    args = parser.parse_args(argv)
    if args.mode == "profile":
        print("\n".join(profile(args)))
        return 0
    if args.mode == "turns":
        print(json.dumps(turns(args.calls, args.device, args.backend)))
        return 0
    result = compare(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
