"""Issue 26's full Sample call taken apart: each feature alone beside plain sampling, device time.

    python -m bench.processors_breakdown [--profile]

256x128256 float32, temperature 0.8, top_k 50, top_p 0.9, the inputs of ``bench.ops.sample``'s
issue-26 case (three penalties over 1,024-token outputs and 256-token prompts, a 64-entry logit
bias, a grammar bitmask, top-5 raw logprobs). Each variant's CUDA-graph replay is timed by
``triton.testing.do_bench_cudagraph`` (median, us): what the features cost on the device, with
the host's launch work out of the way. ``--profile`` also prints the full call's kernel table
(torch.profiler, ten calls). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.testing import do_bench_cudagraph

from logitserve.kernels import sample

from .ops.sample import TEMPERATURE, TOP_K, TOP_P, _frontend_inputs


def variants(logits: torch.Tensor, front: dict) -> dict:
    plain = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=1234, step=7)
    penalties = {k: v for k, v in front.items() if k != "grammar_bitmask" and not k.startswith("logit_bias")}
    return {"every feature": lambda: sample(logits, **plain, **front, logprobs=5),
            "no logprobs": lambda: sample(logits, **plain, **front),
            "top-5 logprobs only": lambda: sample(logits, **plain, logprobs=5),
            "penalties only": lambda: sample(logits, **plain, **penalties),
            "grammar bitmask only": lambda: sample(logits, **plain, grammar_bitmask=front["grammar_bitmask"]),
            "plain": lambda: sample(logits, **plain)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.processors_breakdown needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(256, 128256, device=device, generator=gen)
    calls = variants(logits, _frontend_inputs(256, 128256, device, gen))
    for call in calls.values():  # compile, and build the plans, before any capture
        call()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name(device)}: 256x128256 f32, device time of a CUDA graph replay")
    print("| call | us |\n|---|---:|")
    for name, call in calls.items():
        print(f"| {name} | {do_bench_cudagraph(call, rep=200, return_mode='median') * 1e3:.1f} |", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                calls["every feature"]()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
