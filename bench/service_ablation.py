"""The service with parts cut out, beside the echo server: what each part of a call costs under load.

    python -m bench.service_ablation --device cuda:0 --variants echo,full,full+thread,full+poll --rounds 4

Each variant is ``logitserve serve`` with patches applied in its own process (``+`` joins them).
All of them run at once and are driven in turn like ``bench.service`` (Sample 1x128256 bf16,
one channel, concurrency 1, 8 and 64), case by case, for ``--rounds`` rounds, in a new random
order each round; one line per variant and case gives the medians over the rounds of p50
latency, calls/s and requests per launch (the server's own counters), each followed by the
rounds' values. The host is shared and drifts by tens of percent within minutes: taking the
variants in turn, round after round, puts them under the same drift, and the random order keeps
any effect of going first or after another variant off the comparison. Then each variant is
compared with the first (echo aside) round by round: the median of its differences, and in how
many rounds it was faster.

- ``echo``: ``bench.echo_server``, the transport floor;
- ``const``: the Sample handler answers a fixed reply at once (gRPC, the guard, nothing else);
  with ``workN`` it first keeps the CPU busy for N us, with ``trip`` it first copies 256 KB to
  the GPU and 8 bytes back (does using the device slow what gRPC does around the handler?);
- ``noop``: the whole path (decode, batcher, reply) but the launch returns zeros at once,
  without touching the device;
- ``full``: the server as it is; ``eager``: with ``--cuda-graphs off``;
- ``armed``: a lone call's graph is launched ahead of time, held on the GPU by a wait on a
  page-locked flag that the next lone call sets (:func:`_armed_replays`): what leaving the
  launch call (cudaGraphLaunch) off a lone call's way would gain;
- ``bare``: a Sample handler that skips validation, the batcher and the launch's bookkeeping
  (:func:`_bare_sample`): how much trimming the handler's Python could gain at most;
- ``thread`` / ``poll``: every graph replay waited for on the launch thread / polled on the
  event loop (the server polls only a batch that holds every call in the server);
- ``queued``: every call goes through the batcher's queue (the server launches a lone client's
  call at once, in its handler); ``idleN``: a call after N us idle may come from a lone client
  (the server: 300; it also decides when ``busyN`` polls);
- ``swN``: a GIL switch interval of N us in the server;
- ``uvloop``: the server's event loop is uvloop's instead of asyncio's (``echo+uvloop``: the
  echo server's; ``echo+busyN`` polls as below);
- ``busyN``: ``--busy-poll-us N`` (the event loop polls N us before it sleeps; the server's
  default is 0, no polling);
- ``timed``: times a Sample call's pieces inside the server (parse, parsed to handler,
  prelaunch, validate (inside submit's replay for a prelaunched lone call), submit, of which
  run_batch, of which the device's launch, of which the graph's start and wait (stage, replay),
  reply, the whole handler) and
  writes their medians to ``$LOGITSERVE_TIMED_DIR/<variant>.json`` when the server exits; run it
  at concurrency 1 (the handler replaces Sample's, and a loaded server mixes the paths);
- ``cputime``: for each call, from the start of its parse to the end of its handler, the wall
  time against the CPU time of the thread that ran it and that thread's context switches
  (voluntary and not), medians to ``$LOGITSERVE_TIMED_DIR/<variant>.json``: is a slow call's
  code slow, or is its thread off the CPU part of the time?

``full#2`` is a second server of variant ``full``: two servers of one variant measure how far
servers differ by where the OS places them (A/A). ``--server-cpus`` and ``--client-cpus`` pin
the servers and the load to CPUs, the same for every variant; ``full@2-3`` pins one variant's
server to CPUs 2 and 3.

``--baseline DIR`` names a checkout of another commit (``git worktree add DIR REV``); a variant
written ``base:X`` runs variant X of that checkout, so a change is measured against its parent
in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import statistics
import sys
import tempfile
import time

from bench.service import ServerSpec, drive, payloads, running
from logitserve.client import Client

CASES = ((1, 400), (8, 1500), (64, 3000))  # (concurrency, calls per round)


def serve_patched(variants: set[str], argv: list[str]) -> int:
    """Apply ``variants`` to the server's modules, then run ``logitserve serve argv``."""
    from logitserve.server import batcher, device, guard, ops, servicer
    from logitserve.server.cli import main

    if "noop" in variants:
        async def run_batch(calls, handle, wait=None):
            return [ops.SampleResult([0] * c.rows, c.seeds()) for c in calls]
        ops.SampleCall.run_batch = staticmethod(run_batch)
    if "const" in variants:
        reply = ops.SampleResult([0], [1]).to_pb()
        busy_s = next((int(v[4:]) * 1e-6 for v in variants if v.startswith("work")), 0.0)
        device_trip = _device_round_trip() if "trip" in variants else None

        async def answer(self, request, context):
            until = time.perf_counter() + busy_s
            while time.perf_counter() < until:
                pass
            if device_trip is not None:
                device_trip()
            return reply
        servicer.LogitServeServicer.Sample = answer
    if "thread" in variants or "poll" in variants:
        launch, forced = device.DeviceHandle.launch, device.Wait.POLL if "poll" in variants else device.Wait.THREAD

        async def launch_forced(self, *args, wait=None):
            return await launch(self, *args, wait=forced)
        device.DeviceHandle.launch = launch_forced
    for v in variants:
        if v.startswith("sw"):
            sys.setswitchinterval(int(v[2:]) * 1e-6)
        if v.startswith("idle"):
            guard.LONE_CLIENT_IDLE_S = int(v[4:]) * 1e-6
    if "queued" in variants:
        batcher.Batcher._has_server_to_itself = lambda self: False
    if "timed" in variants:
        _time_pieces(os.path.join(os.environ["LOGITSERVE_TIMED_DIR"], "+".join(sorted(variants)) + ".json"))
    if "cputime" in variants:
        _time_cpu(os.path.join(os.environ["LOGITSERVE_TIMED_DIR"], "+".join(sorted(variants)) + ".json"))
    if "bare" in variants:
        _bare_sample(servicer, ops)
    if "armed" in variants:
        _armed_replays(device)
    if "uvloop" in variants:
        import uvloop

        from logitserve.server import cli
        cli.event_loop_factory = lambda window_us: uvloop.new_event_loop
    return main([*argv, *server_flags(variants)])


def _armed_replays(device) -> None:
    """A lone call's graph launched ahead of time: after each lone call, its graph is launched
    again at once, held on the GPU by a wait on a page-locked flag (``cuStreamWaitValue32``);
    the next lone call of that key writes its inputs and sets the flag, with no launch call on
    its way to the answer. Any other use of the device first lets the held graph go (it runs
    once more on the previous inputs, its outputs unread)."""
    import ctypes

    import torch

    Wait, DeviceHandle = device.Wait, device.DeviceHandle
    wait_value = ctypes.CDLL("libcuda.so.1").cuStreamWaitValue32_v2
    wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    equal = 1  # CU_STREAM_WAIT_VALUE_EQ
    state = {"graph": None, "seq": 0, "flag": None}

    def let_go() -> None:
        if state["graph"] is not None:
            state["flag"][0] = state["seq"]
            state["graph"] = None

    def arm(handle, graph) -> None:
        if state["graph"] is not None or handle._lock.locked():
            return
        if state["flag"] is None:
            state["flag"] = torch.zeros(4, dtype=torch.int32, pin_memory=True).numpy()
        state["seq"] = (state["seq"] + 1) & 0x7FFFFFFF
        handle._bind()
        if wait_value(handle.stream.cuda_stream, state["flag"].ctypes.data, state["seq"], equal) != 0:
            raise RuntimeError("cuStreamWaitValue32 failed")
        graph._graph.replay()
        state["graph"] = graph

    replay_alone, launch, run, close = (DeviceHandle.replay_alone, DeviceHandle.launch, DeviceHandle.run,
                                        DeviceHandle.close)

    async def armed_replay_alone(self, key, parts, wait, meanwhile=None):
        rows = parts[0].shape[0]
        graph = None if self.graphs is None else self.graphs.get(key, rows)
        if graph is None or wait is not Wait.SPIN:
            let_go()
            return await replay_alone(self, key, parts, wait, meanwhile)

        def start(inputs):
            if state["graph"] is graph:  # launched already: write the inputs, then let it go
                for place, part in zip(graph._part_bytes, inputs, strict=True):
                    place[:] = part.data
                let_go()
            else:
                let_go()
                graph.start_alone(inputs)
        async with self._lock:
            await self._replay(start, parts, wait, meanwhile)
            outputs = graph.outputs(rows)
        asyncio.get_running_loop().call_soon(arm, self, graph)
        return outputs

    async def released_launch(self, *args, **kwargs):
        let_go()
        return await launch(self, *args, **kwargs)

    async def released_run(self, *args):
        let_go()
        return await run(self, *args)

    def released_close(self):
        let_go()
        return close(self)
    DeviceHandle.replay_alone, DeviceHandle.launch = armed_replay_alone, released_launch
    DeviceHandle.run, DeviceHandle.close = released_run, released_close


def _bare_sample(servicer, ops) -> None:
    """The Sample handler with the least host work a lone seeded one-row call can take: no
    validation, batcher, lock or result objects; what the request launches, read by
    ``SampleCall.prelaunch``, written straight into the graph captured for it, replayed, spun
    for, the answer built while the GPU works. Not a server (it checks almost nothing): the
    bound on what trimming the handler's Python can gain. Other calls go the ordinary way."""
    import struct

    from logitserve.v1 import logitserve_pb2 as pb

    int64 = struct.Struct("<q")
    ordinary = servicer.LogitServeServicer.Sample

    async def bare(self, request, context):
        msg, handle = request.message, self._service.handle
        prelaunch = ops.SampleCall.prelaunch(msg, request.tensor_bytes)
        graph = None
        if prelaunch is not None and prelaunch.rows == 1 and handle.graphs is not None:
            graph = handle.graphs.get(prelaunch.key, 1)
        if graph is None:
            return await ordinary(self, request, context)
        for graph_part, part in zip(graph._part_bytes, prelaunch.parts):
            graph_part[:] = part.data
        handle._bind()
        graph._graph.replay()
        response = pb.SampleResponse()
        for tensor, dtype in ((response.token_ids, pb.DTYPE_INT64), (response.seeds, pb.DTYPE_INT64),
                              (response.valid, pb.DTYPE_BOOL)):
            tensor.dtype = dtype
            tensor.shape.append(1)
        response.seeds.data = int64.pack(msg.seed)
        while not handle.stream.query():
            pass
        token = int(graph.outputs(1)[0][0])
        response.token_ids.data = int64.pack(token)
        response.valid.data = b"\x01" if token >= 0 else b"\x00"
        return response
    servicer.LogitServeServicer.Sample = bare


def _patch_call_ends(on_parse, on_handler_end) -> None:
    """Parse each request with ``on_parse(parse, data)`` (``parse`` the server's own deserializer)
    and call ``on_handler_end(record, t0)`` as each RPC's handler ends (guard.Guard._finish)."""
    from logitserve.server import guard

    tolerant = guard._tolerant

    def patched_tolerant(deserializer):
        parse = tolerant(deserializer)
        return None if parse is None else functools.partial(on_parse, parse)
    guard._tolerant = patched_tolerant

    finish = guard.Guard._finish

    def patched_finish(self, record, t0):
        on_handler_end(record, t0)
        return finish(self, record, t0)
    guard.Guard._finish = patched_finish


def _time_pieces(path: str) -> None:
    """Time a call's pieces inside the server; their medians go to ``path`` (JSON) at exit."""
    import atexit
    import json

    from logitserve.server import device, graphs, ops, servicer

    spans: dict[str, list[int]] = {}
    clock = time.perf_counter_ns
    parsed = [0]  # when the latest request was parsed

    def note(piece: str, t0: int) -> int:
        now = clock()
        spans.setdefault(piece, []).append(now - t0)
        return now

    def timed_parse(parse, data):
        t0 = clock()
        request = parse(data)
        parsed[0] = note("parse", t0)
        return request

    def handler_ended(record, t0):
        spans.setdefault("handler", []).append(int((time.perf_counter() - t0) * 1e9))
    _patch_call_ends(timed_parse, handler_ended)

    async def timed_sample(self, request, context):
        t = note("parsed to handler", parsed[0])
        prelaunch = ops.SampleCall.prelaunch(request.message, request.tensor_bytes)
        t = note("prelaunch", t)

        def make_call():
            t0 = clock()
            call = self._call(ops.SampleCall, request)
            note("validate", t0)  # while the replay runs, for a prelaunched lone call
            return call
        timeout = context.time_remaining()
        if prelaunch is None:
            result = await self._service.batcher.submit(make_call(), timeout=timeout)
        else:
            result = await self._service.batcher.submit_prelaunched(prelaunch, make_call, timeout=timeout)
        t = note("submit", t)
        reply = result.to_pb()
        note("reply", t)
        return reply
    servicer.LogitServeServicer.Sample = timed_sample

    def timed_start(self, stage):
        t = clock()
        stage.write(self._host_bytes)
        t = note("stage", t)
        self._graph.replay()
        note("replay", t)
    graphs.CapturedLaunch.start = timed_start

    def timed_start_alone(self, parts):
        t = clock()
        for place, part in zip(self._part_bytes, parts, strict=True):
            place[:] = part.data
        t = note("stage", t)
        self._graph.replay()
        note("replay", t)
    graphs.CapturedLaunch.start_alone = timed_start_alone

    replay = device.DeviceHandle._replay

    @functools.wraps(replay)
    async def timed_replay(self, start, inputs, wait, meanwhile=None):
        t0 = clock()
        await replay(self, start, inputs, wait, meanwhile)
        note("start and wait", t0)
    device.DeviceHandle._replay = timed_replay

    def timed_coroutine(cls, name: str, piece: str, static: bool = False) -> None:
        inner = getattr(cls, name)

        @functools.wraps(inner)
        async def timed(*args, **kwargs):
            t0 = clock()
            result = await inner(*args, **kwargs)
            note(piece, t0)
            return result
        setattr(cls, name, staticmethod(timed) if static else timed)
    timed_coroutine(ops.SampleCall, "run_batch", "run_batch", static=True)
    timed_coroutine(device.DeviceHandle, "launch", "launch")
    timed_coroutine(device.DeviceHandle, "replay_alone", "launch")  # a lone call's launch

    def write() -> None:
        medians = {k: statistics.median(v) / 1e3 for k, v in spans.items()}
        medians["calls"] = len(spans.get("handler", ()))
        with open(path, "w") as f:
            json.dump(medians, f)
    atexit.register(write)


def _time_cpu(path: str) -> None:
    """Per call, from its parse to the end of its handler: wall time, the thread's CPU time and
    its context switches; medians (and the switches' means) go to ``path`` (JSON) at exit."""
    import atexit
    import json
    import resource

    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    started: list[tuple[int, int, int, int]] = []  # the latest parse's start: wall, cpu, switches
    wall, cpu, voluntary, involuntary = [], [], [], []

    def now():
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return clock(), cpu_clock(), usage.ru_nvcsw, usage.ru_nivcsw

    def parse_started(parse, data):
        started[:] = [now()]
        return parse(data)

    def handler_ended(record, t0):
        if started and record.rpc == "Sample":
            (w0, c0, v0, i0), (w1, c1, v1, i1) = started[0], now()
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
            voluntary.append(v1 - v0)
            involuntary.append(i1 - i0)
            started.clear()
    _patch_call_ends(parse_started, handler_ended)

    def write() -> None:
        if not wall:
            return
        with open(path, "w") as f:
            json.dump({"wall us": statistics.median(wall) / 1e3, "thread cpu us": statistics.median(cpu) / 1e3,
                       "off cpu us (median of wall - cpu)": statistics.median(w - c for w, c in zip(wall, cpu)) / 1e3,
                       "voluntary switches a call": statistics.mean(voluntary),
                       "involuntary switches a call": statistics.mean(involuntary),
                       "calls with a switch": sum(1 for v, i in zip(voluntary, involuntary) if v or i),
                       "calls": len(wall)}, f)
    atexit.register(write)


def server_flags(variants: set[str]) -> list[str]:
    """The ``logitserve serve`` flags that ``variants`` stand for."""
    flags = []
    for v in sorted(variants):
        if v.startswith("busy"):
            flags += ["--busy-poll-us", v[4:]]
    if "eager" in variants:
        flags += ["--cuda-graphs", "off"]
    return flags


def _device_round_trip():
    """A function that copies a request's worth of bytes (256 KB, page-locked) to the GPU and 8
    bytes back, spinning until the stream is done: a call's device traffic, without kernels."""
    import torch

    host = torch.zeros(256 << 10, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    back = torch.empty(8, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)

    def trip():
        device.copy_(host, non_blocking=True)
        back.copy_(device[:8], non_blocking=True)
        while not stream.query():
            pass
    return trip


def spec(variant: str, device: str, baseline: str | None, cpus: set[int] | None = None) -> ServerSpec:
    name = variant.split("#", 1)[0]  # full#2: a second server of variant full
    name, _, pinned = name.partition("@")  # full@2-3: variant full on CPUs 2 and 3
    if pinned:
        cpus = cpu_list(pinned)
    parts = name.split("+")
    if parts[0] == "echo":
        loop_flags = ["--uvloop"] if "uvloop" in parts else []
        loop_flags += [flag for v in parts if v.startswith("busy") for flag in ("--busy-poll-us", v[4:])]
        return ServerSpec(variant, [sys.executable, "-m", "bench.echo_server", "--host", "127.0.0.1", *loop_flags],
                          is_echo=True, cpus=cpus)
    run_in = []
    if name.startswith("base:"):
        if baseline is None:
            raise SystemExit(f"{variant}: needs --baseline DIR")
        name = name.removeprefix("base:")
        # From the baseline checkout, with its own package: `-m` looks in the working directory first.
        run_in = ["env", "-C", baseline, f"PYTHONPATH={_package_site(baseline)}:{os.environ.get('PYTHONPATH', '')}"]
    warm = "bfloat16" if "full" in name.split("+") else "none"  # name without base:
    return ServerSpec(variant, [*run_in, sys.executable, "-m", "bench.service_ablation", "--serve", name, "serve",
                                "--host", "127.0.0.1", "--device", device, "--warmup-dtypes", warm], cpus=cpus)


def _package_site(checkout: str) -> str:
    """A folder from which ``import logitserve`` finds ``checkout``'s package (pyproject.toml's
    package-dir, as symlinks), made once per checkout."""
    checkout = os.path.abspath(checkout)
    site = os.path.join(tempfile.gettempdir(), "logitserve-baseline-" + checkout.strip("/").replace("/", "_"))
    os.makedirs(os.path.join(site, "logitserve"), exist_ok=True)
    for name, path in (("kernels", "kernels"), ("server", "server"), ("client", "client"), ("v1", "protos/logitserve/v1")):
        link = os.path.join(site, "logitserve", name)
        if not os.path.islink(link):
            os.symlink(os.path.join(checkout, path), link)
    return site


def _each(values) -> str:
    return " ".join(f"{x:.0f}" for x in values)


def launch_counts(server: ServerSpec, target: str) -> tuple[int, int]:
    """The server's (launches, requests they served) so far; zeros for the echo server."""
    if server.is_echo:
        return 0, 0
    with Client(target) as client:
        stats = client.server_info().stats
    return stats["launches"], stats["batched_requests"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_patched(set(argv[1].split("+")), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default="echo,const,noop,full")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default=",".join(str(c) for c, _ in CASES),
                        help="which of the cases (concurrency 1, 8, 64) to run")
    parser.add_argument("--max-seconds", type=float, default=4.0, help="time bound per case and round")
    parser.add_argument("--seed", type=int, default=0, help="of the variants' order in each round")
    parser.add_argument("--baseline", help="a checkout of another commit: variants base:X run its variant X")
    parser.add_argument("--server-cpus", type=cpu_list, help="CPUs every server runs on, e.g. 2-5 (default: any)")
    parser.add_argument("--client-cpus", type=cpu_list, help="CPUs the load runs on, e.g. 8,9 (default: any)")
    args = parser.parse_args(argv)
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    payload = next(p for p in payloads() if p.name == "Sample 1x128256 bf16")
    variants = args.variants.split(",")
    if len(set(variants)) != len(variants):
        raise SystemExit(f"--variants: each at most once (a second server of one variant: full#2), got {args.variants}")
    cases = [(c, calls) for c, calls in CASES if str(c) in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    specs = {v: spec(v, args.device, args.baseline, args.server_cpus) for v in variants}
    with contextlib.ExitStack() as stack:
        servers = {v: stack.enter_context(running(specs[v], 900)) for v in variants}
        order = random.Random(args.seed)
        for _ in range(args.rounds):
            for concurrency, calls in cases:
                for v in order.sample(variants, len(variants)):
                    launches, requests = launch_counts(specs[v], servers[v].target)
                    lat, errors, wall, _, _ = asyncio.run(drive(servers[v].target, payload, concurrency, calls, 30,
                                                                args.max_seconds, False))
                    if errors:
                        print(f"# {v} c={concurrency}: errors {errors}", file=sys.stderr)
                    launches, requests = (n - n0 for n, n0 in zip(launch_counts(specs[v], servers[v].target),
                                                                  (launches, requests)))
                    lat.sort()
                    runs.setdefault((v, concurrency), []).append(
                        (lat[len(lat) // 2], len(lat) / wall, requests / launches if launches else 0.0))
    for concurrency, _ in cases:
        for v in variants:
            p50s, rates, per_launch = zip(*runs[(v, concurrency)])
            print(f"{v:16s} c={concurrency:3d} p50 {statistics.median(p50s):6.0f} us ({_each(p50s)})"
                  f"  {statistics.median(rates):5.0f} calls/s ({_each(rates)})"
                  f"  {statistics.median(per_launch):4.1f} requests/launch", flush=True)
    compared = [v for v in variants if not specs[v].is_echo]
    for concurrency, _ in cases:
        for v in compared[1:]:
            print(f"{v} against {compared[0]}, c={concurrency}: "
                  + _paired(runs[(v, concurrency)], runs[(compared[0], concurrency)]), flush=True)
    return 0


def cpu_list(text: str) -> set[int]:
    """CPUs written as in taskset: ``2-5,8``."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _paired(runs: list[tuple[float, float, float]], reference: list[tuple[float, float, float]]) -> str:
    """Round-by-round comparison of p50 latency and calls/s with the reference variant's."""
    p50 = [r[0] - q[0] for r, q in zip(runs, reference)]
    rate = [r[1] / q[1] for r, q in zip(runs, reference)]
    return (f"p50 {statistics.median(p50):+.0f} us (median difference; lower in {sum(d < 0 for d in p50)} "
            f"of {len(p50)} rounds), calls/s x{statistics.median(rate):.3f} (higher in {sum(x > 1 for x in rate)})")


if __name__ == "__main__":
    sys.exit(main())
