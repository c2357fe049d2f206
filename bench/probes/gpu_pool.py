"""GPU time per request of the bench's Sample pool: which parameter mixes are slow."""
import asyncio, statistics, time, json, collections
import torch
from bench.service import payloads
from logitserve.server.device import DeviceHandle, Wait
from logitserve.server import ops, servicer
from logitserve.server.ops import Limits

async def main():
    h = DeviceHandle("cuda:0")
    parse = servicer.request_parsers()["/logitserve.v1.LogitServe/Sample"]
    limits = Limits(256, 262144)
    rows = []
    for seed in (0, 5):
        for p in payloads(seed)[:2]:
            for raw in p.requests:
                r = parse(raw)
                call = ops.SampleCall.from_pb(r.message, limits, in_place=r.tensor_bytes)
                await ops.SampleCall.run_batch([call], h, wait=Wait.SPIN)
                g = h.graphs.get(call.key, 1)
                h._bind(); s = h.stream
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ts = []
                for _ in range(15):
                    e0.record(s); g.start_alone(call.parts); e1.record(s); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
                m = r.message
                rows.append((p.name.split()[-1], m.top_k, round(m.top_p, 2), round(m.temperature, 2), statistics.median(ts)))
    by = collections.defaultdict(list)
    for dt, k, pp, t, us in rows:
        by[(dt, k, pp)].append(us)
    for key in sorted(by):
        v = by[key]
        print(key, "n", len(v), "median us", round(statistics.median(v), 1), "max", round(max(v), 1))
    for dt in ("bf16", "f32"):
        v = [r[-1] for r in rows if r[0] == dt]
        q = statistics.quantiles(v, n=10)
        print(dt, "all: median", round(statistics.median(v), 1), "deciles", [round(x) for x in q])

asyncio.run(main())
