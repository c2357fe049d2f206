"""Reference for ``verify`` (chain speculative sampling), in float64, written from the semantics.

Per row ``b`` with draft tokens ``d_0..d_{n-1}``: ``p_i`` is the target's distribution at
position ``i`` after temperature and the filters (``sample.kept_set``: the same filters and
order as ``sample``), ``q_i`` the draft's (given, or ``softmax(draft_logits / T_draft)``, one-hot
at the arg-max for ``T_draft == 0``). Position ``i`` accepts ``d_i`` when ``u_i * q_i(d_i) <
p_i(d_i)`` (probability ``min(1, p / q)``); at the first rejection the emitted token is drawn
from ``max(0, p_i - q_i)`` (from ``p_i`` should that be all zero), after ``n`` acceptances from
``p_n``. Greedy rows (``temperature == 0`` or ``top_k == 1``) accept while ``d_i`` is the
target's arg-max (lowest index on ties) and emit the arg-max.

The randomness is ``sample``'s counter-based hash (``reference/sample.py``): the uniforms
``u_i`` hash position ``i`` under the row's keys with ``ACCEPT_MIX`` folded into the second; the
draw is the exponential race ``argmax_v log2(r_v) - log2(E_v)`` with ``E_v`` exactly ``sample``'s
noise for ``(seed, step)``. The kernels draw the same tokens but for floating-point near-ties.
"""

from __future__ import annotations

import torch

from .sample import _gumbel, _invalid_rows, _token_bits, fmix32, kept_set, row_keys

# Folded into a row's second key for the acceptance uniforms (kernels/verify_kernel.py has the
# same constant): the third 32-bit word of pi's fractional part, after noise.py's two.
ACCEPT_MIX = 0x13198A2E


def accept_uniforms(seed: torch.Tensor, step: torch.Tensor, n: int) -> torch.Tensor:
    """``u [B, n]`` in (0, 1), float32: the acceptance uniforms of positions ``0..n-1``."""
    k0, k1 = row_keys(seed, step)
    bits = _token_bits(k0[:, None], fmix32(k1 ^ ACCEPT_MIX)[:, None],
                       torch.arange(n, dtype=torch.int64, device=seed.device)[None, :])
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def target_probs(target_logits: torch.Tensor, temperature, top_k, top_p, min_p, filter_order: str) -> torch.Tensor:
    """``p [B, n + 1, V]`` float64: each position's filtered target distribution (greedy rows: one-hot
    at the arg-max; rows with a NaN or no finite logit: NaN)."""
    n_rows, positions, vocab = target_logits.shape
    x = target_logits.to(torch.float64).reshape(n_rows * positions, vocab)

    def per_position(v):
        return v.repeat_interleave(positions)

    t, k, p, mp = (per_position(v) for v in (temperature, top_k, top_p, min_p))
    kept = kept_set(x, t, k, p, mp, filter_order=filter_order)
    greedy = ((t == 0) | (k == 1))[:, None]
    clean = torch.where(torch.isnan(x), float("-inf"), x)
    m = clean.max(1, keepdim=True).values
    scaled = torch.where(clean == m, 0.0, (clean - m) / torch.where(greedy, 1.0, t.to(torch.float64)[:, None]))
    w = torch.where(kept, torch.exp(scaled), 0.0)
    probs = torch.where(greedy, kept.to(torch.float64), w / w.sum(1, keepdim=True))
    bad = _invalid_rows(x, t.float(), k, p.float(), mp.float(), None)
    probs = torch.where(bad[:, None], float("nan"), probs)
    return probs.reshape(n_rows, positions, vocab)


def draft_probs_of(draft_logits: torch.Tensor, draft_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [B, n, V] float64, draft_valid [B])`` from draft logits: ``softmax(logits / T)``,
    one-hot at the arg-max (lowest index) for ``T == 0``; a row is not valid where a position has
    a NaN or no finite logit, or its T breaks the temperature rule."""
    n_rows, n, vocab = draft_logits.shape
    y = draft_logits.to(torch.float64)
    t = draft_temperature.to(torch.float64)[:, None, None]
    bad = torch.isnan(y).any(-1) | ~torch.isfinite(y).any(-1) | ~((t >= 0) & (t < float("inf")))[:, :, 0]
    clean = torch.where(torch.isnan(y), float("-inf"), y)
    m = clean.max(-1, keepdim=True).values
    w = torch.exp(torch.where(clean == m, 0.0, (clean - m) / torch.where(t > 0, t, 1.0)))
    soft = w / w.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(soft).scatter_(-1, clean.argmax(-1, keepdim=True), 1.0)
    q = torch.where(t > 0, soft, one_hot)
    return torch.where(bad[:, :, None], 0.0, q), ~bad.any(1)


def verify(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
           temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           seed: torch.Tensor, step: torch.Tensor, *, filter_order: str = "top_k_first",
           draft_valid: torch.Tensor | None = None):
    """``(token_ids [B, n + 1] int64, num_accepted [B] int64, valid [B] bool)``.

    Every parameter is a ``[B]`` tensor; ``draft_probs`` is ``q [B, n, V]``, taken as given
    (``draft_probs_of`` for logits, whose ``draft_valid`` rows say which drafts had no NaN). A row
    is invalid (all -1, 0 accepted) when a target position has a NaN or no finite logit, a
    parameter breaks its rule, a draft id lies outside ``[0, V)``, or ``draft_valid`` is false.
    """
    n_rows, n, vocab = draft_probs.shape
    device = target_logits.device
    p = target_probs(target_logits, temperature, top_k, top_p, min_p, filter_order)
    q = draft_probs.to(torch.float64)
    ids = draft_token_ids.to(torch.int64)
    ids_ok = (ids >= 0) & (ids < vocab)
    safe = torch.where(ids_ok, ids, 0)
    valid = ~torch.isnan(p).any(-1).any(-1) & ids_ok.all(-1)
    if draft_valid is not None:
        valid &= draft_valid

    greedy = (temperature == 0) | (top_k == 1)
    argmax = target_logits.to(torch.float64).nan_to_num(nan=float("-inf")).argmax(-1)  # [B, n + 1]
    p_d = p[:, :n].gather(-1, safe[:, :, None])[:, :, 0]
    q_d = q.gather(-1, safe[:, :, None])[:, :, 0]
    u = accept_uniforms(seed, step, n).to(torch.float64)
    accept = torch.where(greedy[:, None], safe == argmax[:, :n], u * q_d < p_d)
    # The accepted prefix: positions before the first rejection.
    num_accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(1)

    rows = torch.arange(n_rows, device=device)
    at = num_accepted.clamp(max=n)
    p_at = p[rows, at]
    q_at = torch.where((num_accepted < n)[:, None], q[rows, at.clamp(max=n - 1)], 0.0)
    residual = (p_at - q_at).clamp(min=0)
    k0, k1 = row_keys(seed, step)
    g = _gumbel(_token_bits(k0[:, None], k1[:, None], torch.arange(vocab, device=device)[None, :])).to(torch.float64)
    race = torch.where(residual > 0, torch.log2(residual) + g, float("-inf"))
    fallback = torch.where(p_at > 0, torch.log2(p_at) + g, float("-inf"))
    drawn = torch.where(torch.isinf(race.max(1).values), fallback.argmax(1), race.argmax(1))
    emitted = torch.where(greedy, argmax[rows, at], drawn)

    positions = torch.arange(n + 1, device=device)[None, :]
    tokens = torch.where(positions < num_accepted[:, None], torch.cat([safe, safe[:, :1]], 1), -1)
    tokens = torch.where(positions == num_accepted[:, None], emitted[:, None], tokens)
    tokens = torch.where(valid[:, None], tokens, -1)
    return tokens, torch.where(valid, num_accepted, 0), valid
