"""What a CUDA graph replay costs the host, by launch: the time ``CUDAGraph.replay()`` takes to
return (the GPU idle before each), and the graph's node count.

    python -m bench.graph_replay [--rows 256] [--vocab 128256]

The launches the server replays for Sample: plain; with penalties over ragged lists and a
grammar bitmask; the same lists as a list table (a Sample by sequence ids); each captured
alone, as server/engine/graphs.py captures them (without the staging copies). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from logitserve.kernels import sample
from logitserve.kernels.sampling.process_kernels import TABLE_COLUMNS
from logitserve.kernels.sampling.processors import ListTable, append_tokens

REPLAYS = 200


def _node_count(graph: torch.cuda.CUDAGraph) -> int | None:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    err, _, count = runtime.cudaGraphGetNodes(graph.raw_cuda_graph(), 0)
    return int(count) if int(err) == 0 else None


def launches(rows: int, vocab: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=g)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31, (rows, words), device=device, dtype=torch.int32, generator=g)
    prompt = torch.randint(0, vocab, (rows * 256,), device=device, generator=g)
    output = torch.randint(0, vocab, (rows * 1024,), device=device, generator=g)
    per_row = dict(temperature=torch.full((rows,), 0.8, device=device), top_k=torch.full((rows,), 50, device=device),
                   top_p=torch.full((rows,), 0.9, device=device), min_p=torch.zeros(rows, device=device),
                   seed=torch.arange(rows, device=device), step=torch.zeros(rows, dtype=torch.int64, device=device))
    penalties = dict(repetition_penalty=torch.full((rows,), 1.1, device=device),
                     frequency_penalty=torch.full((rows,), 0.2, device=device),
                     presence_penalty=torch.zeros(rows, device=device))
    ragged = dict(prompt_token_ids=prompt, prompt_offsets=torch.arange(0, rows * 256 + 1, 256, device=device),
                  output_token_ids=output, output_offsets=torch.arange(0, rows * 1024 + 1, 1024, device=device))
    outputs = [output[r * 1024:(r + 1) * 1024].clone() for r in range(rows)]
    held = outputs + [torch.cat([o, torch.empty(1024, dtype=torch.int64, device=device)]) for o in outputs]
    table = torch.zeros(rows, TABLE_COLUMNS.value, dtype=torch.int64)
    for r in range(rows):
        table[r, 0], table[r, 1] = prompt[r * 256:].data_ptr(), 256
        table[r, 2], table[r, 3], table[r, 12] = held[rows + r].data_ptr(), 1024, 2048
    table = table.to(device)
    lists = ListTable(table, frozenset({"prompt", "output"}))

    def sequences():
        tokens = sample(logits, **per_row, **penalties, grammar_bitmask=bitmask, list_table=lists)
        append_tokens(ListTable(table, frozenset({"output"})), tokens)
        return tokens

    return {"plain": lambda: sample(logits, **per_row),
            "penalties + bitmask, ragged lists": lambda: sample(logits, **per_row, **penalties, **ragged,
                                                                grammar_bitmask=bitmask),
            "penalties + bitmask, list table + append": sequences,
            "_held": held}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.graph_replay needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    stream = torch.cuda.Stream()
    cases = launches(args.rows, args.vocab, device)
    cases.pop("_held")
    print(f"{torch.cuda.get_device_name(device)}, {args.rows}x{args.vocab} f32; replay() host time, "
          f"median of {REPLAYS}, GPU idle before each")
    print("| launch | nodes | replay() us | eager launch us | device us |\n|---|---:|---:|---:|---:|")
    for name, fn in cases.items():
        with torch.cuda.stream(stream):
            fn()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph(keep_graph=True)  # keeps the cudaGraph_t its nodes are counted in
            with torch.cuda.graph(graph, stream=stream):
                fn()
            graph.instantiate()
            host, eager = [], []
            for _ in range(REPLAYS):
                stream.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                host.append(time.perf_counter() - t0)
            stream.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            stream.synchronize()
            for _ in range(50):
                stream.synchronize()
                t0 = time.perf_counter()
                fn()
                eager.append(time.perf_counter() - t0)
            stream.synchronize()
        print(f"| {name} | {_node_count(graph)} | {statistics.median(host) * 1e6:.1f} | "
              f"{statistics.median(eager) * 1e6:.1f} | {start.elapsed_time(end) / 20 * 1e3:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
