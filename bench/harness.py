"""What every kernel benchmark shares: the case record, timing, and the copy-bandwidth ceiling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Case:
    """One implementation of one op at one shape.

    ``bytes_moved`` is the floor an implementation must move: each input read once, each
    output written once (Triton tutorial 02 counts the same way), so GB/s compares
    implementations on the same footing whatever they actually move.
    """

    op: str
    shape: str
    dtype: str
    impl: str
    fn: Callable[[], object]
    bytes_moved: int


def median_us(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """Median of CUDA-event timings after warm-up (triton.testing.do_bench), in microseconds."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median") * 1e3


def print_case_header(device: torch.device) -> float:
    """The device line and the table header :func:`print_case_row` fills; the copy bandwidth."""
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}; copy {copy_gbs:.1f} GB/s")
    print("| shape | implementation | median us | GB/s | of copy |\n|---|---|---:|---:|---:|")
    return copy_gbs


def print_case_row(c: Case, copy_gbs: float) -> bool:
    """Time ``c`` and print its markdown row (shape, implementation, median us, GB/s, fraction of
    ``copy_gbs``): an op's own ``python -m bench.ops.<op>`` table. False (a row saying so) where it
    raised: a failing baseline must not hide the others."""
    try:
        us = median_us(c.fn)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        print(f"| {c.shape} | {c.impl} | failed: {str(exc)[:80]} | | |", flush=True)
        return False
    gbs = c.bytes_moved / (us * 1e-6) / 1e9
    print(f"| {c.shape} | {c.impl} | {us:.1f} | {gbs:.0f} | {gbs / copy_gbs:.2f} |", flush=True)
    return True


def print_table(lines: list[str], out: str | None) -> None:
    """A finished Markdown table, printed whole after its rows' progress, and written to ``out``."""
    table = "\n".join(lines)
    print("\n" + table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of ``nbytes``, counting bytes read plus bytes written: the ceiling."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e9


# bench.kernels --no-compile clears this: Inductor builds one kernel per shape and dtype, which
# costs minutes of a GPU lease; the table then says torch.compile rows were left out.
COMPILE_BASELINES = True


def maybe_compile(fn: Callable) -> Callable | None:
    """``torch.compile(fn)``, or None where it is switched off or cannot build (reported, not hidden)."""
    if not COMPILE_BASELINES:
        return None
    # Each function is compiled once per benchmarked shape and dtype; past dynamo's default
    # limit of 8 recompiles it would silently run eager under the torch.compile label.
    torch._dynamo.config.cache_size_limit = 256
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as exc:  # noqa: BLE001 - a baseline that fails to build is skipped, with the reason printed
        print(f"torch.compile unavailable: {exc}")
        return None


def flashinfer_sampling():
    """``flashinfer.sampling`` where the wheels were carried and installed, else None."""
    try:
        import flashinfer.sampling as fs
    except ImportError:
        return None
    return fs
