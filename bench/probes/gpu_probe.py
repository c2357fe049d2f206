"""Where a lone Sample call's device time goes: replay host time, spin, GPU time, alternatives."""
import asyncio, ctypes, statistics, time, sys, json
import torch
from logitserve import kernels
from logitserve.server.device import DeviceHandle, Wait
from logitserve.server import ops
from logitserve.server.tensors import HostTensor

N = 2000
def med(ts): return round(statistics.median(ts) / 1e3, 2)
out = {}

async def main():
    h = DeviceHandle("cuda:0")
    logits = HostTensor.of(torch.randn(1, 128256).to(torch.bfloat16))
    call = ops.SampleCall(logits, 0.6, 0, 0.8, 0.0, [1000], 0, "top_k_first", None)
    for _ in range(3):
        await ops.SampleCall.run_batch([call], h, wait=Wait.SPIN)
    g = h.graphs.get(call.key, 1)
    print("graph", g is not None, flush=True)
    h._bind()
    s = h.stream
    # query cost idle
    ts = []
    for _ in range(N):
        t0 = time.perf_counter_ns(); s.query(); ts.append(time.perf_counter_ns() - t0)
    out["query idle"] = med(ts)
    # replay host time, spin until done
    rep, spin, tot, nq = [], [], [], []
    for _ in range(N):
        t0 = time.perf_counter_ns(); g._graph.replay(); t1 = time.perf_counter_ns()
        q = 0
        while not s.query(): q += 1
        t2 = time.perf_counter_ns()
        rep.append(t1 - t0); spin.append(t2 - t1); tot.append(t2 - t0); nq.append(q)
        time.sleep(0.0005)
    out["replay host"] = med(rep); out["replay->done spin"] = med(spin); out["replay total"] = med(tot)
    out["queries while spinning"] = statistics.median(nq)
    # back to back (no sleep)
    rep = []
    for _ in range(N):
        t0 = time.perf_counter_ns(); g._graph.replay(); rep.append(time.perf_counter_ns() - t0); s.synchronize()
    out["replay host, no sleep"] = med(rep)
    # GPU time of the graph via events
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gt = []
    for _ in range(200):
        e0.record(s); g._graph.replay(); e1.record(s); e1.synchronize(); gt.append(e0.elapsed_time(e1) * 1e6)
    out["graph GPU time (events)"] = med(gt)
    # start_alone whole (write + replay)
    parts = call.parts
    ts = []
    for _ in range(N):
        t0 = time.perf_counter_ns(); g.start_alone(parts); ts.append(time.perf_counter_ns() - t0); s.synchronize()
    out["start_alone host"] = med(ts)
    # raw cudaGraphLaunch via ctypes
    try:
        cudart = None
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                cudart = ctypes.CDLL(name); break
            except OSError:
                pass
        exec_ptr = g._graph.raw_cuda_graph_exec()
        graph_ptr = g._graph.raw_cuda_graph()
        n = ctypes.c_size_t(0)
        cudart.cudaGraphGetNodes(ctypes.c_void_p(graph_ptr), None, ctypes.byref(n))
        out["graph nodes"] = n.value
        nodes = (ctypes.c_void_p * n.value)()
        cudart.cudaGraphGetNodes(ctypes.c_void_p(graph_ptr), nodes, ctypes.byref(n))
        types = []
        for nd in nodes:
            t = ctypes.c_int(0); cudart.cudaGraphNodeGetType(ctypes.c_void_p(nd), ctypes.byref(t)); types.append(t.value)
        out["node types"] = types
        launch = cudart.cudaGraphLaunch
        launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        sp = ctypes.c_void_p(s.cuda_stream); ep = ctypes.c_void_p(exec_ptr)
        ts = []
        for _ in range(N):
            t0 = time.perf_counter_ns(); launch(ep, sp); ts.append(time.perf_counter_ns() - t0); s.synchronize()
        out["ctypes cudaGraphLaunch"] = med(ts)
    except Exception as e:
        out["ctypes error"] = repr(e)
    # graph with copies only
    host = torch.zeros(256 << 10, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda"); back = torch.empty(8, dtype=torch.uint8, pin_memory=True)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg, stream=s):
        dev.copy_(host, non_blocking=True); back.copy_(dev[:8], non_blocking=True)
    ts, tt = [], []
    for _ in range(N):
        t0 = time.perf_counter_ns(); cg.replay(); t1 = time.perf_counter_ns()
        while not s.query(): pass
        ts.append(t1 - t0); tt.append(time.perf_counter_ns() - t0)
    out["copies-only graph: replay host"] = med(ts); out["copies-only graph: total"] = med(tt)
    # graph with kernels only (inputs on device)
    x = torch.randn(1, 128256, device="cuda").to(torch.bfloat16)
    f = torch.tensor([[0.6, 0.8, 0.0]], device="cuda"); i = torch.tensor([[0, 1000, 0]], device="cuda")
    def run():
        return kernels.sample(x, temperature=f[:, 0], top_p=f[:, 1], min_p=f[:, 2], top_k=i[:, 0], seed=i[:, 1], step=i[:, 2])
    with torch.cuda.stream(s):
        for _ in range(3): run()
    s.synchronize()
    kg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(kg, stream=s):
        run()
    ts, tt = [], []
    for _ in range(N):
        t0 = time.perf_counter_ns(); kg.replay(); t1 = time.perf_counter_ns()
        while not s.query(): pass
        ts.append(t1 - t0); tt.append(time.perf_counter_ns() - t0)
    out["kernels-only graph: replay host"] = med(ts); out["kernels-only graph: total"] = med(tt)
    gt = []
    for _ in range(200):
        e0.record(s); kg.replay(); e1.record(s); e1.synchronize(); gt.append(e0.elapsed_time(e1) * 1e6)
    out["kernels-only graph GPU (events)"] = med(gt)
    # eager kernels (FastLauncher) host time
    ts, tt = [], []
    for _ in range(N):
        t0 = time.perf_counter_ns(); run(); t1 = time.perf_counter_ns()
        while not s.query(): pass
        ts.append(t1 - t0); tt.append(time.perf_counter_ns() - t0)
    out["eager kernels host"] = med(ts); out["eager kernels total"] = med(tt)
    # empty graph-like: single tiny kernel launch via torch
    y = torch.zeros(1, device="cuda")
    ts = []
    for _ in range(N):
        t0 = time.perf_counter_ns(); y.add_(1); ts.append(time.perf_counter_ns() - t0); s.synchronize()
    out["torch add_ host"] = med(ts)

asyncio.run(main())
print(json.dumps(out, indent=1))
