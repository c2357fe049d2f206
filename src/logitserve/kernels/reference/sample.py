"""Reference for ``sample``: sort-based filters and the same counter-based noise, written plainly.

Every parameter arrives as a ``[B]`` tensor (the plan broadcasts Python scalars). The noise is
the torch twin of ``kernels/sampling/noise.py`` (uint32 arithmetic held in int64 tensors), so
this module and the Triton kernels draw the same token but for floating-point near-ties.
"""

from __future__ import annotations

import torch

from ..sampling.params import MIN_P, RANDOM_VAL, TEMPERATURE, TOP_K, TOP_P

MASK32 = 0xFFFFFFFF
SEED_MIX = 0x243F6A88  # same constants as kernels/sampling/noise.py (tests compare the bits)
STEP_MIX = 0x85A308D3


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values.

    ``h * c`` (both below 2**32) wraps modulo 2**64 in int64, which keeps its low 32 bits exact:
    one multiply and a mask a step, in place on the first step's new tensor (``h`` is unchanged).
    """
    h = h ^ (h >> 16)
    h *= 0x85EBCA6B
    h &= MASK32
    h ^= h >> 13
    h *= 0xC2B2AE35
    h &= MASK32
    h ^= h >> 16
    return h


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row uint32 keys (in int64) from int64 seeds and steps, as their 64-bit patterns."""
    seed, step = seed.to(torch.int64), step.to(torch.int64)
    k0 = fmix32(fmix32((seed & MASK32) ^ SEED_MIX) ^ ((seed >> 32) & MASK32))
    k1 = fmix32(fmix32((step & MASK32) ^ k0 ^ STEP_MIX) ^ ((step >> 32) & MASK32))
    return k0, k1


def noise(seed: torch.Tensor, step: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, G)`` for tokens 0..n-1 of each row: hash bits ``[B, n]`` and base-2 Gumbel draws
    ``G = -log2(E)``, ``E = -log2(u)`` (float32)."""
    k0, k1 = row_keys(seed, step)
    idx = torch.arange(n, dtype=torch.int64, device=seed.device)
    bits = _token_bits(k0[:, None], k1[:, None], idx[None, :])
    return bits, _gumbel(bits)


def _token_bits(k0: torch.Tensor, k1: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The hash bits of tokens ``idx`` under row keys ``k0``, ``k1`` (broadcast together)."""
    return fmix32(fmix32(idx ^ k1) ^ k0)


def _gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Base-2 Gumbel draws ``-log2(E)``, ``E = -log2(u)``, from hash bits (float32)."""
    b = bits >> 9
    u = (b.to(torch.float32) + 0.5) * 2.0**-23
    v = ((8388607 - b).to(torch.float32) + 0.5) * 2.0**-23
    # Near u = 1, -log2(u) = -log1p(-v) / ln 2 from its series (v is exact there).
    series = v * (1.0 + v * (0.5 + v * (0.3333333432674408 + v * 0.25))) * 1.4426950408889634
    return -torch.log2(torch.where(v < 0.015625, series, -torch.log2(u)))


def _invalid_rows(x, temperature, top_k, top_p, min_p, random_val, row_max=None):
    """A row returns -1 when its logits hold a NaN or no finite value, or a parameter breaks its
    rule (``kernels/sampling/params.py``; with random_val, min_p must also be 0).

    From the row's max (``row_max``, ``x.max(1).values`` when not given), which is NaN where the
    row holds a NaN: a row with no NaN has a finite value unless its max is -inf, or +inf with
    only infinities beside it (rows with a +inf max alone are read again)."""
    top = x.max(1).values if row_max is None else row_max
    bad = torch.isnan(top) | (top == float("-inf"))
    inf_rows = (top == float("inf")).nonzero()[:, 0]
    if inf_rows.numel():
        bad[inf_rows] |= ~torch.isfinite(x[inf_rows]).any(1)
    for param, value in ((TEMPERATURE, temperature), (TOP_K, top_k), (TOP_P, top_p), (MIN_P, min_p)):
        bad |= ~param.ok(value)
    if random_val is not None:
        bad |= ~RANDOM_VAL.ok(random_val) | (min_p != 0)
    return bad


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, step: torch.Tensor, *, filter_order: str = "top_k_first",
           random_val: torch.Tensor | None = None, out_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Token ids ``[B]`` for ``logits [B, V]``; see docs/DESIGN.md for the semantics of each parameter.

    Greedy and invalid rows cost one pass (the row max and its first index); only the other rows
    are drawn (``_drawn_tokens``): rows are independent, so a row's token is the same either way.
    """
    ct = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(ct)
    temperature, top_p, min_p = temperature.to(torch.float32), top_p.to(torch.float32), min_p.to(torch.float32)
    top_k = top_k.to(torch.int64)
    if random_val is not None:
        random_val = random_val.to(torch.float32)
    top, first_max = x.max(1)  # the first maximal index (a row with a NaN is invalid)
    bad = _invalid_rows(x, temperature, top_k, top_p, min_p, random_val, row_max=top)
    greedy = (temperature == 0) | (top_k == 1)
    token = first_max
    drawn = (~(greedy | bad)).nonzero()[:, 0]
    if drawn.numel() == x.shape[0]:
        token = _drawn_tokens(x, top[:, None], temperature, top_k, top_p, min_p, seed, step, random_val,
                              filter_order)
    elif drawn.numel():
        token[drawn] = _drawn_tokens(x[drawn], top[drawn, None], temperature[drawn], top_k[drawn], top_p[drawn],
                                     min_p[drawn], seed[drawn], step[drawn],
                                     None if random_val is None else random_val[drawn], filter_order)
    return torch.where(bad, -1, token).to(out_dtype)


def _drawn_tokens(x, m, temperature, top_k, top_p, min_p, seed, step, random_val, filter_order):
    """The tokens of rows that are neither greedy nor invalid (no NaN, a finite logit, valid
    parameters); ``m``: the rows' max ``[B, 1]``."""
    n_cols = x.shape[1]
    ct = x.dtype
    # log2 of the relative probabilities w = p / max(p) = exp((x - max) / T); the max itself gets
    # exactly 0 (w = 1), which also makes a row with +inf logits uniform over its +inf entries.
    scale = (1.4426950408889634 / temperature).to(ct)[:, None]
    d = torch.where(x == m, 0.0, (x - m) * scale)
    k = torch.where((top_k <= 0) | (top_k >= n_cols), n_cols, top_k).clamp(min=1)[:, None]
    top_p, min_p = top_p.to(ct)[:, None], min_p.to(ct)[:, None]
    if random_val is not None:
        order = torch.sort(x, dim=1, descending=True, stable=True).indices
        return _infinicore(torch.exp2(d), order, k, top_p[:, 0], random_val.to(ct))
    kept = None  # every token: no row filters
    if bool(((k < n_cols) | (top_p < 1)).any()):
        sorted_x, order = torch.sort(x, dim=1, descending=True, stable=True)  # ties: lower index first
        kept = _kept(x, torch.exp2(d), sorted_x, order, k, top_p, min_p, filter_order)
    elif bool((min_p > 0).any()):
        kept = torch.exp2(d) >= min_p  # _kept's min-p, its top-k and top-p keeping every token
    return _race(d, kept, row_keys(seed, step))


def kept_set(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor, *, filter_order: str = "top_k_first") -> torch.Tensor:
    """The tokens :func:`sample` can draw, bool ``[B, V]``: the support of the distribution it
    draws from (greedy rows: the arg-max alone; rows with a NaN or no finite logit: none). A token
    the filters keep is in it only where its weight is not zero: a -inf logit (banned, masked by
    a grammar, or given so) is never drawn, even where top-k is off or reaches past the finite
    logits, nor is a finite one beside +inf logits."""
    n_rows, n_cols = logits.shape
    ct = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(ct)
    temperature, top_p, min_p = temperature.to(torch.float32), top_p.to(torch.float32), min_p.to(torch.float32)
    top_k = top_k.to(torch.int64)
    bad = _invalid_rows(x, temperature, top_k, top_p, min_p, None)
    x = torch.where(torch.isnan(x), float("-inf"), x)
    greedy = (temperature == 0) | (top_k == 1)
    m = x.max(1, keepdim=True).values
    scale = (1.4426950408889634 / torch.where(greedy | bad, 1.0, temperature)).to(ct)[:, None]
    d = torch.where(x == m, 0.0, (x - m) * scale)  # log2 of the weight, as sample() races on it
    w = torch.exp2(d)
    sorted_x, order = torch.sort(x, dim=1, descending=True, stable=True)
    k = torch.where((top_k <= 0) | (top_k >= n_cols), n_cols, top_k).clamp(min=1)[:, None]
    kept = _kept(x, w, sorted_x, order, k, top_p.to(ct)[:, None], min_p.to(ct)[:, None], filter_order)
    kept &= d > float("-inf")
    first_max = torch.zeros_like(kept).scatter_(1, x.argmax(1, keepdim=True), True)
    kept = torch.where(greedy[:, None], first_max, kept)
    return kept & ~bad[:, None]


def _kept(x, w, sorted_x, order, k, top_p, min_p, filter_order):
    # top-k: keep every token >= the k-th largest value (ties with it included).
    in_k = x >= sorted_x.gather(1, k - 1)
    # top-p: in descending order, keep positions whose mass before them is under top_p of the
    # reference mass (the top-k set for top_k_first, everything for joint); keep ties of the last.
    w_ref = torch.where(in_k, w, 0.0) if filter_order == "top_k_first" else w
    z_ref = w_ref.sum(1, keepdim=True)
    sorted_w = w_ref.gather(1, order)
    mass_before = torch.cumsum(sorted_w, 1) - sorted_w
    n_kept = (mass_before < top_p * z_ref).sum(1, keepdim=True).clamp(min=1)
    in_p = (top_p >= 1) | (x >= sorted_x.gather(1, n_kept - 1))
    # min-p: keep p >= min_p * max(p), i.e. w >= min_p.
    return in_k & in_p & (w >= min_p)


# A kept set this sparse draws its noise for the kept tokens alone (indexing costs more a token
# than hashing it, so denser sets hash the whole row and mask it).
SPARSE_KEPT_SHARE = 0.25


def _race(d, kept, keys):
    """Exponential race: argmax p_i / E_i over the kept tokens (``kept`` None: all) is distributed
    as p restricted to them; in base-2 logs, argmax log2(w_i) - log2(E_i), with the noise
    ``noise()`` gives each token, whichever tokens it is drawn for."""
    k0, k1 = keys
    if kept is not None and kept.sum() < SPARSE_KEPT_SHARE * kept.numel():
        rows, cols = kept.nonzero(as_tuple=True)
        race = torch.full_like(d, float("-inf"))
        race[rows, cols] = d[rows, cols] + _gumbel(_token_bits(k0[rows], k1[rows], cols)).to(d.dtype)
        return race.argmax(1)
    idx = torch.arange(d.shape[1], dtype=torch.int64, device=d.device)
    race = _gumbel(_token_bits(k0[:, None], k1[:, None], idx[None, :])).to(d.dtype)
    race += d
    if kept is not None:
        race.masked_fill_(~kept, float("-inf"))
    return race.argmax(1)


def _infinicore(w, order, k, top_p, random_val):
    # InfiniCore random_sample: c = cumsum of softmax in descending order, threshold
    # random_val * min(top_p, c[k-1]), the first position whose c reaches it.
    p = w / w.sum(1, keepdim=True)
    c = torch.cumsum(p.gather(1, order), 1)
    threshold = random_val * torch.minimum(top_p, c.gather(1, k - 1)[:, 0])
    position = torch.minimum((c < threshold[:, None]).sum(1, keepdim=True), k - 1)
    return order.gather(1, position)[:, 0]
