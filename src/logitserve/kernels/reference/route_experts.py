"""MoE routers of current models, written plainly: scores, optional bias and groups, then the top k.

The reference for :mod:`logitserve.kernels.route_experts` (``backend="torch"`` runs it).
"""

from __future__ import annotations

import torch


def route_experts(gate_logits: torch.Tensor, k: int, scoring: str = "softmax",
                  correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                  group_score: str = "top2_sum", renormalize: bool = False,
                  routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, indices)`` of the ``k`` experts each row of ``gate_logits [N, E]`` goes to.

    1. ``scores``: ``softmax`` over the row or ``sigmoid`` of each logit.
    2. Selection keys: ``scores + correction_bias`` with a bias, else the logits themselves (the
       order of the exact scores; equal logits tie).
    3. With ``n_group > 1``: the experts split into ``n_group`` consecutive groups; a group's
       score is the sum of its two largest biased scores (``"top2_sum"``) or its largest
       (``"max"``), biased scores meaning ``scores (+ correction_bias)``; the ``topk_group`` best
       groups stay (equal group scores: the lower group), the other experts are out.
    4. The ``k`` largest keys among the remaining experts, descending; equal keys go to the
       lower expert index.
    5. Weights are the chosen experts' unbiased ``scores``; ``renormalize`` divides them by their
       sum, then they are multiplied by ``routed_scaling_factor``.

    A row whose scores, biased scores or (while groups are dropped) group scores have a NaN (a
    NaN logit or bias; for softmax also a ``+inf`` logit or no finite logit) gives NaN weights
    at indices ``0..k-1``. Computed in float32 (float64 for float64 input); weights come in that
    dtype, indices int32.
    """
    compute = torch.float64 if gate_logits.dtype == torch.float64 else torch.float32
    x = gate_logits.to(compute)
    n, e = x.shape
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    if correction_bias is None:
        biased, keys = scores, x
    else:
        biased = scores + correction_bias.to(compute)
        keys = biased
    bad = torch.isnan(scores).any(-1) | torch.isnan(biased).any(-1)
    keep = torch.ones(n, e, dtype=torch.bool)
    if n_group > 1 and topk_group < n_group:
        grouped = biased.reshape(n, n_group, e // n_group)
        if group_score == "top2_sum":
            gscores = torch.topk(grouped, 2, dim=-1).values.sum(-1)
        else:
            gscores = grouped.max(-1).values
        bad |= torch.isnan(gscores).any(-1)
        gscores = torch.where(bad[:, None], torch.zeros_like(gscores), gscores)
        groups = torch.sort(gscores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        gkeep = torch.zeros(n, n_group, dtype=torch.bool).scatter_(1, groups, True)
        keep = gkeep.repeat_interleave(e // n_group, dim=1)
    keys = torch.where(bad[:, None], torch.zeros_like(keys), keys)
    # Kept experts first, then by key descending, ties by index: two stable sorts.
    by_key = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    by_keep = torch.sort(keep.gather(1, by_key).to(torch.int8), dim=-1, descending=True, stable=True).indices
    order = by_key.gather(1, by_keep)[:, :k]
    weights = torch.gather(scores, -1, order)
    weights = torch.where(bad[:, None], torch.full_like(weights, float("nan")), weights)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights, order.to(torch.int32)


# How far apart in float64 two biased scores or group scores (all below 3) may be and still be
# ordered either way in float32, where the kernels compute them: two units in its last place.
FLOAT32_TIE = 2.0 ** -21


def within_float32_ties(gate_row: torch.Tensor, picks: list[int], scoring: str = "softmax",
                        correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                        group_score: str = "top2_sum", **_weights_options) -> bool:
    """Whether ``picks`` (one row's experts, in order) are what :func:`route_experts` picks in
    float64 once keys closer than :data:`FLOAT32_TIE` may go either way.

    For checking a float32 implementation on rows where it differs from the float64 reference:
    its sums can break a float64 tie, or order two keys a float64 hair apart, otherwise. The
    picks' groups must score within the tie of the kept groups' bound, and the picks must be in
    order and above the other experts of their groups within it. Keys without a bias are the
    logits themselves, exact in any dtype: no such row, so False.
    """
    if correction_bias is None or len(set(picks)) != len(picks):
        return False
    x = gate_row.to(torch.float64)
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    key = (scores + correction_bias.to(torch.float64).cpu()).tolist()
    pool = range(len(key))
    if n_group > 1 and topk_group < n_group:
        size = len(key) // n_group
        groups = [sorted(key[g * size:(g + 1) * size], reverse=True) for g in range(n_group)]
        score = [g[0] + g[1] if group_score == "top2_sum" else g[0] for g in groups]
        bound = sorted(score, reverse=True)[topk_group - 1]
        chosen = {j // size for j in picks}
        if len(chosen) > topk_group or any(score[g] < bound - FLOAT32_TIE for g in chosen):
            return False
        pool = [j for j in pool if j // size in chosen]
    rest = [key[j] for j in pool if j not in picks]
    in_order = all(key[a] >= key[b] - FLOAT32_TIE for a, b in zip(picks, picks[1:]))
    return in_order and (not rest or min(key[j] for j in picks) >= max(rest) - FLOAT32_TIE)
