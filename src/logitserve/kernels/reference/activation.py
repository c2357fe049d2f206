"""SiLU and SwiGLU, written plainly: the reference for :mod:`logitserve.kernels.activation`."""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed as ``x / (1 + exp(-x))`` in float32 (float64 for float64), cast back.

    The division form is the one torch's own kernels use, so the extremes agree with
    ``torch.nn.functional.silu``: ``silu(+inf) = +inf``, ``silu(-inf) = -inf / inf = nan``,
    ``silu(nan) = nan``, and large negative ``x`` gives ``-0.0`` once ``exp(-x)`` overflows.
    """
    xc = x.to(_compute_dtype(x.dtype))
    return (xc / (1.0 + torch.exp(-xc))).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Shazeer, arXiv:2002.05202), broadcasting as torch does, in float32 math."""
    compute = _compute_dtype(gate.dtype)
    g = gate.to(compute)
    return (g / (1.0 + torch.exp(-g)) * up.to(compute)).to(gate.dtype)
