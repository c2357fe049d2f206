"""The torch (CPU) backend's sample beside torch's own ops, one thread (issue 34: greedy 16x32000
took 200-300 ms against 1 ms for argmax).

    python -m bench.cpu_sample            # about 10 s

Median of 20 of each, 16 x 32000 float32, ms: argmax, softmax + multinomial, and logitserve's
sample greedy, seeded with no filter, with temperature 0.7, min_p 0.05, top_k 50 + top_p 0.9.
"""

from __future__ import annotations

import statistics
import time

import torch

from logitserve.kernels import sample

ROWS, VOCAB, RUNS = 16, 32000, 20


def _median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    cases = {
        "argmax (torch)": lambda: x.argmax(1),
        "softmax + multinomial (torch)": lambda: torch.multinomial(torch.softmax(x, 1), 1),
        "sample greedy": lambda: sample(x, temperature=0.0, backend="torch"),
        "sample seeded": lambda: sample(x, seed=3, backend="torch"),
        "sample seeded, temperature 0.7": lambda: sample(x, seed=3, temperature=0.7, backend="torch"),
        "sample seeded, min_p 0.05": lambda: sample(x, seed=3, min_p=0.05, backend="torch"),
        "sample seeded, top_k 50, top_p 0.9": lambda: sample(x, seed=3, top_k=50, top_p=0.9, backend="torch"),
    }
    print(f"| {ROWS}x{VOCAB} float32, one thread | median ms |")
    print("|---|---:|")
    for name, fn in cases.items():
        print(f"| {name} | {_median_ms(fn):.2f} |")


if __name__ == "__main__":
    main()
