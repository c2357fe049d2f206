"""A lone Sample call after 700 us idle, in process: does re-running its path meanwhile keep it fast?

The bench's Sample 1x128256 bf16 requests through the guarded handler, the batcher and the
captured graph (bench/lone_call.py's setup on the real device), each after 700 us of: sleep;
polling epoll (what a busy-polling server does); polling with a rehearsal every 100 us
(``rehearse100``: the latest request parsed, validated and its answer serialized again, results
thrown away; what commit 16fbdbd's ``--keep-warm-us`` did, reverted in the next), with the driver's launch call warmed instead (a one-kernel graph
replayed every 100 us, ``launch100``), both, or the whole call run again every 300 us
(``full300``). Kinds interleave in a random order, ``reps`` blocks of ``calls`` calls each.

    source scripts/device_env.sh; python3 bench/probes/keep_warm.py [calls] [pause_us] [reps]
"""
import asyncio, json, os, random, select, statistics, sys, time
import numpy as np, torch
from bench import lone_call
from bench.service import payloads
from logitserve.server import app, guard, ops, servicer
from logitserve.server.config import ServerConfig


async def main(calls: int, pause_us: int, reps: int) -> dict:
    guard.LONE_CLIENT_IDLE_S = guard.LONE_CLIENT_CROWD_S = 0.0
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    service = app.Service(ServerConfig(device=dev, port=0, warmup_dtypes=("bfloat16",), warmup_widths=(128256,)))
    await service.warm_up()
    handler = lone_call.guarded_sample(service)
    requests, context = payloads(0)[0].requests, lone_call._Context()
    epoll = select.epoll()
    read = servicer.request_parsers()[lone_call.SAMPLE]
    answer = ops.SampleResult([5], [7])

    def rehearse(i):
        request = read(requests[i % len(requests)])
        ops.SampleCall.from_pb(request.message, service.limits, in_place=request.tensor_bytes)
        answer.to_pb().SerializeToString()

    async def one(i):
        response = await handler.unary_unary(handler.request_deserializer(requests[i % len(requests)]), context)
        response.SerializeToString()
    for i in range(64):
        await one(i)
    tiny = None
    if dev != "cpu":
        x = torch.zeros(1, device=dev)
        with torch.cuda.stream(service.handle.stream):
            x.add_(1)
            torch.cuda.synchronize()
            tiny = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tiny, stream=service.handle.stream):
                x.add_(1)
        torch.cuda.synchronize()

    def launch():
        tiny.replay()
        while not service.handle.stream.query():
            pass
    pause = pause_us * 1e-6
    kinds = ["sleep", "epoll", "rehearse100", "launch100", "rehearse+launch100", "full300"]
    if tiny is None:
        kinds = [k for k in kinds if "launch" not in k]
    order = kinds * reps
    random.Random(1).shuffle(order)
    times = {k: [] for k in kinds}
    for kind in order:
        every = int(kind[-3:]) * 1e-6 if kind[-1].isdigit() else None
        for i in range(calls):
            until = time.perf_counter() + pause
            if kind == "sleep":
                time.sleep(pause)
            elif every is not None:
                next_at = time.perf_counter()
                while (now := time.perf_counter()) < until - 20e-6:
                    if now >= next_at:
                        if kind == "full300":
                            await one(i + 1)
                        if "rehearse" in kind:
                            rehearse(i + 1)
                        if "launch" in kind:
                            launch()
                        next_at = time.perf_counter() + every
                    epoll.poll(0)
            while time.perf_counter() < until:
                epoll.poll(0)
            t0 = time.perf_counter_ns()
            await one(i)
            times[kind].append(time.perf_counter_ns() - t0)
            await asyncio.sleep(0)
    result = {k: {"p50": round(statistics.median(ts) / 1e3, 1), "p10": round(np.percentile(ts, 10) / 1e3, 1),
                  "p90": round(np.percentile(ts, 90) / 1e3, 1)} for k, ts in times.items()}
    result["device"] = dev
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] + [300, 700, 4][len(sys.argv) - 1:]
    print(json.dumps(asyncio.run(main(*args)), indent=1))
