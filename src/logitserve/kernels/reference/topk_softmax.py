"""MoE routing, written plainly: softmax over every expert, then the k most probable.

The reference for :mod:`logitserve.kernels.topk_softmax` (``backend="torch"`` runs it).
"""

from __future__ import annotations

import torch


def topk_softmax(gate_logits: torch.Tensor, k: int, renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, indices)`` of the ``k`` most probable experts of each row of ``gate_logits [N, E]``.

    Probabilities are ``softmax(gate_logits, dim=-1)`` in float32 (float64 for float64 input).
    Experts are ranked by logit, which is the order of their exact probabilities (rounded ones
    can tie where logits differ, e.g. two that both underflow to 0); equal logits go to the
    lower expert index (a stable descending sort; -0.0 equals +0.0). Weights therefore come
    sorted descending. ``renormalize`` divides the ``k`` weights by their sum.

    A row with a NaN logit, a ``+inf`` logit, or no finite logit has an all-NaN softmax: it gives
    NaN weights at indices ``0, 1, ..., k - 1`` (every expert ties, so the lowest indices win).
    ``-inf`` logits are ordinary experts of probability 0.

    Weights are float32 (float64 for float64 input), indices int32.
    """
    compute = torch.float64 if gate_logits.dtype == torch.float64 else torch.float32
    logits = gate_logits.to(compute)
    probs = torch.softmax(logits, dim=-1)
    # softmax already makes such a row all NaN; say so explicitly rather than lean on it, then
    # put every expert of the row at one value so the stable sort keeps index order.
    bad = torch.isnan(probs).any(dim=-1, keepdim=True)
    keys = torch.where(bad, torch.zeros_like(logits), logits)
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = torch.gather(probs, -1, order)
    weights = torch.where(bad, torch.full_like(weights, float("nan")), weights)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weight_dtype = torch.float64 if compute == torch.float64 else torch.float32
    return weights.to(weight_dtype), order.to(torch.int32)
