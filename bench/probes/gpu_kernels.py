"""Per-kernel GPU time of a lone Sample call's graph, one line per request of the bench's bf16 pool (torch.profiler)."""
import asyncio, statistics, json, collections, sys
import torch
from torch.profiler import profile, ProfilerActivity
from bench.service import payloads
from logitserve.server.device import DeviceHandle, Wait
from logitserve.server import ops, servicer
from logitserve.server.ops import Limits

async def main():
    h = DeviceHandle("cuda:0")
    parse = servicer.request_parsers()["/logitserve.v1.LogitServe/Sample"]
    limits = Limits(256, 262144)
    calls = []
    for raw in payloads(0)[0].requests:
        r = parse(raw)
        call = ops.SampleCall.from_pb(r.message, limits, in_place=r.tensor_bytes)
        await ops.SampleCall.run_batch([call], h, wait=Wait.SPIN)
        calls.append((r.message.top_k, round(r.message.top_p, 2), call))
    h._bind(); s = h.stream
    out = {}
    for k, p, call in calls:
        g = h.graphs.get(call.key, 1)
        for _ in range(3):
            g.start_alone(call.parts); s.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g.start_alone(call.parts); s.synchronize()
        per = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per[e.name[:40]].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
        key = f"k{k} p{p}"
        out.setdefault(key, []).append({n: round(statistics.median(v), 1) for n, v in per.items()})
    for key, v in out.items():
        print(key, json.dumps(v[0]))

asyncio.run(main())
