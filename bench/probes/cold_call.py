"""A lone Sample call after a pause, in process: is a slow call's code slow, or its thread off the CPU?

The bench's Sample 1x128256 bf16 requests through the guarded handler, the batcher and the
captured graph (bench/probes/keep_warm.py's setup), each after ``pause_us`` of: nothing (back to
back); sleep; polling epoll without blocking (what the busy-polling server does), at once again
(``epoll``) or every N us, spinning on the clock between polls (``epollN``); spinning on the
clock alone, no system call (``spin``). Per call: wall time, the thread's CPU time, and its
context switches, and the same for the call's pieces before the launch (parse and validate,
``host``) and after (replay and the answer, ``device``). Kinds interleave in a random order,
``reps`` blocks of ``calls`` calls each.

    source scripts/device_env.sh; python3 bench/probes/cold_call.py [calls] [pause_us] [reps]
"""
import asyncio, json, random, resource, select, statistics, sys, time
import torch
from bench import lone_call
from bench.service import payloads
from logitserve.server import app, guard
from logitserve.server.config import ServerConfig


def now():
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.perf_counter_ns(), time.thread_time_ns(), usage.ru_nvcsw + usage.ru_nivcsw


async def main(calls: int, pause_us: int, reps: int) -> dict:
    guard.LONE_CLIENT_IDLE_S = guard.LONE_CLIENT_CROWD_S = 0.0
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    service = app.Service(ServerConfig(device=dev, port=0, warmup_dtypes=("bfloat16",), warmup_widths=(128256,)))
    await service.warm_up()
    if dev == "cpu":
        handle = service.handle
        handle.graphs, handle.stream, handle._bind = lone_call._Graphs(), lone_call._Stream(), lambda: None
    handler = lone_call.guarded_sample(service)
    requests, context = payloads(0)[0].requests, lone_call._Context()
    epoll = select.epoll()
    marks = {}
    submit = service.batcher.submit

    async def marked_submit(call, timeout=None):
        marks["submit"] = now()
        return await submit(call, timeout=timeout)
    service.batcher.submit = marked_submit

    async def one(i):
        response = await handler.unary_unary(handler.request_deserializer(requests[i % len(requests)]), context)
        response.SerializeToString()
    for i in range(64):
        await one(i)
    pause = pause_us * 1e-6
    kinds = ["none", "sleep", "epoll", "epoll10", "epoll30", "epoll100", "spin"]
    order = kinds * reps
    random.Random(1).shuffle(order)
    out = {k: {"wall": [], "cpu": [], "switches": [], "host wall": [], "host cpu": [], "device wall": [],
               "device cpu": []} for k in kinds}
    for kind in order:
        for i in range(calls):
            until = time.perf_counter() + pause
            if kind == "sleep":
                time.sleep(pause)
            elif kind == "epoll":
                while time.perf_counter() < until:
                    epoll.poll(0)
            elif kind.startswith("epoll"):
                every = int(kind[5:]) * 1e-6
                while (t := time.perf_counter()) < until:
                    epoll.poll(0)
                    next_poll = min(t + every, until)
                    while time.perf_counter() < next_poll:
                        pass
            elif kind == "spin":
                while time.perf_counter() < until:
                    pass
            w0, c0, s0 = now()
            await one(i)
            w1, c1, s1 = now()
            wm, cm, _ = marks["submit"]
            o = out[kind]
            o["wall"].append(w1 - w0)
            o["cpu"].append(c1 - c0)
            o["switches"].append(s1 - s0)
            o["host wall"].append(wm - w0)
            o["host cpu"].append(cm - c0)
            o["device wall"].append(w1 - wm)
            o["device cpu"].append(c1 - cm)
            await asyncio.sleep(0)
    result = {k: {name: round(statistics.median(v) / (1 if name == "switches" else 1e3), 1)
                  for name, v in o.items()} | {"calls with a switch": sum(1 for s in o["switches"] if s)}
              for k, o in out.items()}
    result["device"] = dev
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] + [300, 700, 4][len(sys.argv) - 1:]
    print(json.dumps(asyncio.run(main(*args)), indent=1))
