"""How much a token weighs: ``w = p / max(p)``, computed without the softmax's division.

Every step of ``sample`` compares tokens by their relative probability
``w = exp((x - max) / T)``, in base 2 (``log2 w = (x - max) * log2(e) / T``): the merge sums it
into the softmax total, the filters compare it with ``min_p`` and with masses, and the race adds
the noise to ``log2 w``. Kernels compute in float32, and in float64 for float64 logits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_compute(x, IS_F64: tl.constexpr):
    """Kernels compute in float32, and in float64 for float64 input."""
    if IS_F64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32)


@triton.jit
def log2_weight(x, m, scale):
    """log2(p / max(p)) = (x - m) * scale with ``scale = log2(e) / T``; exactly 0 at the max
    (also when the max is +inf, which makes the +inf entries share all the mass)."""
    return tl.where(x == m, 0.0, (x - m) * scale).to(x.dtype)


@triton.jit
def rel_weight(x, m, scale):
    """w = p / max(p) = exp2(log2_weight), exactly 1 at the max."""
    return tl.exp2(log2_weight(x, m, scale))
