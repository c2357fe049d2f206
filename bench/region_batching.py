"""Batches of calls whose logits live in CUDA regions: gathered into one launch, or launched call by call?

    python bench/region_batching.py [--clients 8] [--rows 64] [--vocab 128256] [--dtype float32] [--seconds 10]

For each strategy the server knows (server/ops/resident.py), starts ``logitserve serve`` on cuda:0
through ``python -m logitserve.server.process --region-batching <strategy>`` (an in-process hook,
not a serve flag), then ``--clients`` client processes, each with its logits in its own CUDA
memory (registered through an IPC handle) and its token ids written back there, calling
``Sample`` (temperature 0.8, top-k 50, top-p 0.9) back to back for ``--seconds``. A lone client
runs first (a lone call launches in place either way: the floor). Prints one JSON line per run
and a table: calls/s, rows/s, p50 and p99 latency. The faster strategy under load stays in the
server; the other goes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

STRATEGIES = ("gather", "per-call")


def _client(target: str, index: int, rows: int, vocab: int, dtype_name: str, seconds: float, ready, go, results):
    import grpc
    import torch

    from logitserve.client import Client
    from logitserve.client.regions import region_tensor
    from logitserve.v1 import logitserve_pb2 as pb
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    dtype = getattr(torch, dtype_name)
    torch.cuda.set_device(0)
    nbytes = rows * vocab * dtype.itemsize
    out_at = -(-nbytes // 256) * 256
    # The logits at an offset inside a larger allocation, as a caching allocator places them.
    allocation = torch.empty(4096 + out_at + rows * 8, dtype=torch.uint8, device="cuda:0")
    mem = allocation[4096:]
    mem[:nbytes].view(dtype).view(rows, vocab).normal_(0, 3)
    torch.cuda.synchronize()
    name = f"bench-{index}"
    with Client(target, timeout=600) as client, grpc.insecure_channel(target) as channel:
        client.register_cuda(name, mem)
        stub = pb_grpc.LogitServeStub(channel)
        request = pb.SampleRequest(logits=region_tensor(name, dtype, (rows, vocab)), temperature=0.8, top_k=50,
                                   top_p=0.9, seed=index, output_regions={
                                       "token_ids": pb.RegionRef(region=name, offset=out_at, byte_size=rows * 8)})
        for _ in range(5):  # compiles the kernels' variant for this alignment
            stub.Sample(request, timeout=600)
        ready.put(index)
        go.wait()
        latencies = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            stub.Sample(request, timeout=60)
            latencies.append(time.perf_counter() - t0)
        client.unregister(name)
    results.put(latencies)


def _run(target: str, clients: int, args) -> dict:
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(target, i, args.rows, args.vocab, args.dtype, args.seconds, ready, go,
                                               results)) for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=900)
    t0 = time.perf_counter()
    go.set()
    latencies = [lat for _ in procs for lat in results.get(timeout=900)]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(60)
    latencies.sort()
    calls = len(latencies)
    return dict(clients=clients, calls=calls, calls_per_s=round(calls / wall, 1),
                rows_per_s=round(calls * args.rows / wall), p50_ms=round(statistics.median(latencies) * 1e3, 3),
                p99_ms=round(latencies[min(calls - 1, int(calls * 0.99))] * 1e3, 3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-batch-rows", type=int, default=512)
    args = parser.parse_args(argv)

    from logitserve.server.process import ServerProcess

    table = []
    for strategy in STRATEGIES:
        with ServerProcess("--warmup-dtypes", args.dtype, "--warmup-widths", str(args.vocab), "--max-batch-rows",
                           str(args.max_batch_rows), "--max-rows", str(max(args.rows, 4096)), "--max-region-bytes",
                           str(64 << 30), device="cuda:0", backend="triton", start_timeout=900,
                           region_batching=strategy) as server:
            for clients in (1, args.clients):
                row = dict(strategy=strategy, rows=args.rows, vocab=args.vocab, dtype=args.dtype,
                           **_run(server.target, clients, args))
                print(json.dumps(row), flush=True)
                table.append(row)
    print(f"\n{'strategy':<10} {'clients':>7} {'calls/s':>9} {'rows/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for r in table:
        print(f"{r['strategy']:<10} {r['clients']:>7} {r['calls_per_s']:>9} {r['rows_per_s']:>9} {r['p50_ms']:>8} "
              f"{r['p99_ms']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
