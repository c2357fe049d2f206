"""Does a 256 KB write before the replay slow cudaGraphLaunch (cache pollution)?"""
import asyncio, ctypes, statistics, time, json, os
import numpy as np, torch
from bench.service import payloads
from logitserve.server.device import DeviceHandle, Wait
from logitserve.server import ops, servicer
from logitserve.server.ops import Limits

def med(ts): return round(statistics.median(ts) / 1e3, 2)
out = {"tunables": os.environ.get("GLIBC_TUNABLES", "")}

async def main():
    h = DeviceHandle("cuda:0")
    parse = servicer.request_parsers()["/logitserve.v1.LogitServe/Sample"]
    limits = Limits(256, 262144)
    raws = payloads(0)[0].requests
    calls = []
    for raw in raws:
        r = parse(raw); calls.append(ops.SampleCall.from_pb(r.message, limits, in_place=r.tensor_bytes))
    for c in calls:
        await ops.SampleCall.run_batch([c], h, wait=Wait.SPIN)
    g = h.graphs.get(calls[0].key, 1)
    h._bind(); s = h.stream
    def spin_until(t):
        while time.perf_counter() < t: pass
    for label, mode in (("sleep, replay only", 0), ("busy wait, replay only", 1), ("busy wait, write+replay", 2),
                        ("busy wait, new bytes+write+replay", 3), ("busy wait, new bytes+memmove+replay", 4)):
        w, rp, tot = [], [], []
        for i in range(1500):
            c = calls[i % len(calls)]
            if mode == 0:
                time.sleep(0.0007)
            else:
                spin_until(time.perf_counter() + 0.0007)
            if mode >= 3:
                raw = bytes(bytearray(raws[i % len(raws)]))  # as grpc makes a new bytes per request
                r = parse(raw); c = ops.SampleCall.from_pb(r.message, limits, in_place=r.tensor_bytes)
            t0 = time.perf_counter_ns()
            if mode in (2, 3):
                for place, part in zip(g._part_bytes, c.parts): place[:] = part.data
            elif mode == 4:
                for place, part in zip(g._part_bytes, c.parts):
                    src = np.frombuffer(part.data, np.uint8); dst = np.frombuffer(place, np.uint8)
                    ctypes.memmove(dst.ctypes.data, src.ctypes.data, len(src))
            t1 = time.perf_counter_ns()
            g._graph.replay()
            t2 = time.perf_counter_ns()
            while not s.query(): pass
            t3 = time.perf_counter_ns()
            w.append(t1 - t0); rp.append(t2 - t1); tot.append(t3 - t0)
        out[label] = {"write": med(w), "replay": med(rp), "write..done": med(tot)}

asyncio.run(main())
print(json.dumps(out, indent=1))
