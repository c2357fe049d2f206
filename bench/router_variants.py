"""The router kernel's selection variants (kernels.route_experts.VARIANTS), checked and timed in one run.

    python -m bench.router_variants [--out results.md]

Needs a CUDA device. For each model configuration it first checks that every variant returns
exactly what the ``exact`` variant returns (same float32 scores, so bit for bit) on random
normal logits and on logits full of ties (multiples of 1/32, biases multiples of 1/256), and
that ``exact`` matches the float64 reference there (on a row where float32 breaks a float64 tie
otherwise, up to those ties: ``reference.within_float32_ties``); then times each variant by
``triton.testing.do_bench_cudagraph`` (device time of graph replays, median). Prints a Markdown
table; the fastest variant at DeepSeek-V3's shape is the candidate for
``kernels.route_experts.DEFAULT_VARIANT`` (``TOP1_VARIANT`` from the top-1 routers). Compiles
len(VARIANTS) x len(CONFIGS) kernels.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from logitserve.kernels import RouteExpertsPlan, TensorSpec, TopkSoftmaxPlan
from logitserve.kernels.reference.route_experts import route_experts as reference, within_float32_ties
from logitserve.kernels.route_experts import DEFAULT_VARIANT, TOP1_VARIANT, VARIANTS

from .harness import print_table

TOKENS = 16384
DEEPSEEK_V3 = dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)
# name: (E, k, options, with a correction bias). Qwen3 (softmax, renormalize, nothing else)
# runs topk_softmax, which has no variants: timed once for the record.
CONFIGS = {
    "DeepSeek-V3 grouped": (256, 8, DEEPSEEK_V3, True),
    "Kimi-K2": (384, 8, dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.827), True),
    "Kimi-K2 grouped": (384, 8, DEEPSEEK_V3, True),
    "Llama 4 (16)": (16, 1, dict(scoring="sigmoid"), False),
    "Llama 4 (128)": (128, 1, dict(scoring="sigmoid"), False),
    "Qwen3 softmax": (128, 8, dict(renormalize=True), False),
}


def inputs(e: int, with_bias: bool, ties: bool, gen: torch.Generator):
    if ties:
        x = torch.randint(-128, 128, (TOKENS, e), generator=gen).float() / 32
        bias = torch.randint(-64, 64, (e,), generator=gen).float() / 256
    else:
        x = torch.randn(TOKENS, e, generator=gen)
        bias = torch.randn(e, generator=gen) * 0.1
    return x.to(torch.bfloat16).cuda(), bias.cuda() if with_bias else None


def check(name: str, plans: dict, e: int, k: int, options: dict, with_bias: bool, gen: torch.Generator) -> None:
    for ties in (False, True):
        x, bias = inputs(e, with_bias, ties, gen)
        want_w, want_i = plans["exact"](x, bias)
        for variant, plan in plans.items():
            w, i = plan(x, bias)
            if not (torch.equal(i, want_i) and torch.equal(w.nan_to_num(), want_w.nan_to_num())):
                rows = (i != want_i).any(-1).nonzero()[:, 0]
                raise AssertionError(f"{name}, {variant}, {'ties' if ties else 'random'}: {len(rows)} rows differ "
                                     f"from exact, first {rows[:3].tolist()}")
        if ties:
            ref_w, ref_i = reference(x.cpu().double(), k, correction_bias=None if bias is None else
                                     bias.cpu().double(), **options)
            got_w, got_i = want_w.cpu(), want_i.cpu()
            same = (got_i == ref_i).all(-1)
            # A row may differ where the kernel's float32 breaks a float64 tie otherwise.
            for row in (~same).nonzero()[:, 0].tolist():
                assert within_float32_ties(x[row].cpu(), got_i[row].tolist(), correction_bias=bias, **options), \
                    f"{name}: exact differs from the float64 reference at row {row}"
            torch.testing.assert_close(got_w[same], ref_w[same].float(), atol=1e-6, rtol=1e-5, equal_nan=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.router_variants needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    lines = [f"{torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, triton "
             f"{triton.__version__}; device time by do_bench_cudagraph (median), {TOKENS} tokens bfloat16; "
             f"default variant: {DEFAULT_VARIANT}, {TOP1_VARIANT} for top-1", "",
             "| router | E | k | variant | rows x warps | us | vs exact |", "|---|---:|---:|---|---|---:|---:|"]
    for name, (e, k, options, with_bias) in CONFIGS.items():
        x, bias = inputs(e, with_bias, False, gen)
        spec, bias_spec = TensorSpec.of(x), None if bias is None else TensorSpec.of(bias)
        first = RouteExpertsPlan(spec, k, correction_bias=bias_spec, **options)
        if first.inner is not None:
            plans = {"topk_softmax": first.inner}
        else:
            plans = {v: RouteExpertsPlan(spec, k, correction_bias=bias_spec, variant=v, **options) for v in VARIANTS}
            check(name, plans, e, k, options, with_bias, gen)
        w = torch.empty(TOKENS, k, device="cuda")
        i = torch.empty(TOKENS, k, device="cuda", dtype=torch.int32)
        times = {}
        for variant, plan in plans.items():
            run = (lambda p=plan: p(x, w, i)) if isinstance(plan, TopkSoftmaxPlan) else \
                (lambda p=plan: p(x, bias, w, i))
            times[variant] = do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3
            ratio = times[variant] / times["exact"] if "exact" in times else 1.0
            row = (f"| {name} | {e} | {k} | {variant} | {plan.rows} x {plan.num_warps} | {times[variant]:.2f} "
                   f"| {ratio:.2f} |")
            print(row, flush=True)
            lines.append(row)
    print_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
