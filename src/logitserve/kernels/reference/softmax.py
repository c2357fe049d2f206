"""Softmax along one axis, in plain torch: the reference the Triton kernel is held to.

Computes in float32 (float64 for float64 input) and casts back to the input dtype. Rows whose
entries are all ``-inf`` give NaN, and a NaN anywhere in a row makes the whole row NaN: both as
``torch.softmax`` does.
"""

from __future__ import annotations

import torch


def softmax(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``dim``; writes ``out`` when given (may be ``x``)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.softmax(x.to(compute), dim=dim).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)
