"""GPU time of ``kernels.sample`` where the walk's first check matters (no top_k, top_p < 1),
beside cases it must not slow, each call captured in a CUDA graph (no host time); and the
tokens drawn, written to a file, so that two checkouts' draws can be compared.

    source scripts/device_env.sh; python3 bench/probes/topp_walk.py OUT.json
"""
import json, statistics, sys
import torch
from logitserve import kernels

CASES = [  # (name, rows, scale of randn logits, dtype, parameters, per-row tensors)
    ("1 row, T1 p0.9", 1, 1.0, torch.bfloat16, dict(temperature=1.0, top_p=0.9), False),
    ("1 row, T1 p0.9 f32", 1, 1.0, torch.float32, dict(temperature=1.0, top_p=0.9), False),
    ("1 row, flat, T1 p0.8", 1, 0.1, torch.bfloat16, dict(temperature=1.0, top_p=0.8), False),
    ("1 row, per-row T0.8 k50 p0.9", 1, 1.0, torch.bfloat16, dict(temperature=0.8, top_k=50, top_p=0.9), True),
    ("1 row, per-row T1 k0 p0.95", 1, 1.0, torch.bfloat16, dict(temperature=1.0, top_k=0, top_p=0.95), True),
    ("256 rows, T0.8 p0.9 f32", 256, 1.0, torch.float32, dict(temperature=0.8, top_p=0.9), False),
    ("256 rows, T0.8 k50 p0.9 f32", 256, 1.0, torch.float32, dict(temperature=0.8, top_k=50, top_p=0.9), False),
    ("256 rows, per-row T0.8 k50 p0.9 f32", 256, 1.0, torch.float32, dict(temperature=0.8, top_k=50, top_p=0.9), True),
    ("256 rows, per-row T1 k0 p0.95 bf16", 256, 1.0, torch.bfloat16, dict(temperature=1.0, top_k=0, top_p=0.95), True),
    ("256 rows, T1 (pure temperature) f32", 256, 1.0, torch.float32, dict(temperature=1.0), False),
]


def main(path: str) -> None:
    out, tokens = {}, {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.Stream()
    for name, rows, scale, dtype, kw, per_row in CASES:
        x = (torch.randn(rows, 128256, device="cuda", generator=gen) * scale).to(dtype)
        if per_row:
            kw = {k: torch.full((rows,), v, device="cuda", dtype=torch.int64 if k == "top_k" else torch.float32)
                  for k, v in kw.items()}
        seed = torch.arange(rows, device="cuda", dtype=torch.int64)
        drawn = []
        for step in range(8):  # the tokens of 8 steps, to compare checkouts
            drawn += kernels.sample(x, **kw, seed=seed, step=step).tolist()
        tokens[name] = drawn
        with torch.cuda.stream(stream):
            kernels.sample(x, **kw, seed=seed, step=0)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                kernels.sample(x, **kw, seed=seed, step=0)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(100):
                e0.record(stream)
                graph.replay()  # on the current stream: this one
                e1.record(stream)
                e1.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3)
        out[name] = round(statistics.median(times), 1)
        print(f"{name:40s} {out[name]:8.1f} us", flush=True)
    with open(path, "w") as f:
        json.dump({"us": out, "tokens": tokens}, f)


if __name__ == "__main__":
    main(sys.argv[1])
