"""Benchmark every op against torch eager, torch.compile and (sampling) FlashInfer, in one run.

    python -m bench.kernels [--ops softmax,sample] [--out results.md]

Needs a CUDA device. Prints one Markdown table: median microseconds, GB/s over the bytes the
op must move, and that as a fraction of the measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import sys

import torch

from . import harness
from .harness import copy_bandwidth_gbs, median_us, print_table

OPS = ("softmax", "causal_softmax", "topk_softmax", "activation", "sample", "verify")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS))
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baselines")
    args = parser.parse_args(argv)
    harness.COMPILE_BASELINES = not args.no_compile
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device)
    lines = [
        f"{torch.cuda.get_device_name(device)}, {datetime.date.today()}, torch {torch.__version__}, "
        f"triton {importlib.import_module('triton').__version__}; copy {copy_gbs:.1f} GB/s"
        + ("; torch.compile rows left out (--no-compile)" if args.no_compile else ""),
        "",
        "| op | shape | dtype | implementation | median us | GB/s | of copy |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for op in args.ops.split(","):
        module = importlib.import_module(f"bench.ops.{op}")
        for case in module.cases(device):
            try:
                us = median_us(case.fn)
            except Exception as exc:  # noqa: BLE001 - one failing baseline must not hide the others
                print(f"{case.op} {case.shape} {case.dtype} {case.impl}: failed: {exc}", file=sys.stderr)
                continue
            gbs = case.bytes_moved / (us * 1e-6) / 1e9
            row = (f"| {case.op} | {case.shape} | {case.dtype} | {case.impl} | {us:.2f} | {gbs:.1f} "
                   f"| {gbs / copy_gbs:.2f} |")
            print(row, flush=True)
            lines.append(row)
            torch.cuda.empty_cache()
    print_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
