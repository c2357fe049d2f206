"""Causal (lower-triangular, bottom-right aligned) softmax over the last axis, in plain torch.

For ``x`` of shape ``[S, T]`` or ``[B, S, T]`` with ``T >= S``, row ``i`` sees the columns
``j <= T - S + i`` (InfiniCore's condition ``width + row >= col + height``). Visible cells get
the softmax of the visible entries, computed in float32 (float64 for float64 input); masked
cells are exactly 0, whatever the input holds there.
"""

from __future__ import annotations

import torch


def causal_mask(s: int, t: int, device: torch.device) -> torch.Tensor:
    """``[S, T]`` bool, True where row ``i`` sees column ``j``, that is ``j <= T - S + i``."""
    rows = torch.arange(s, device=device)[:, None]
    cols = torch.arange(t, device=device)[None, :]
    return cols <= t - s + rows


def causal_softmax(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of each row's visible prefix, zeros elsewhere; writes ``out`` when given (may be ``x``)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    visible = causal_mask(x.shape[-2], x.shape[-1], x.device)
    masked = x.to(compute).masked_fill(~visible, float("-inf"))
    y = torch.softmax(masked, dim=-1).masked_fill(~visible, 0.0).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)
