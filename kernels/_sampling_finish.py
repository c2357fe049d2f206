"""The last pass of ``sample``: the filters' thresholds and the draw, one program per row.

Every filter keeps the tokens at or above a value (ties with the boundary included), so the
kept set is ``{key >= t_k} & {key >= t_p} & {w >= min_p}`` where ``w = p / max(p)``. The draw
is the exponential race ``argmax w_i / E_i`` over that set, with no need to find ``t_p``:

  walk: best = the winner over ``{key >= t_k}``; while the mass strictly above best reaches
  ``top_p`` of the reference mass, best was outside the nucleus, and so was everything at or
  below it: the next best is the winner over ``{key > best}``.

One pass gives both the mass above the current best and the next winner, and the expected
number of passes is about 1 + (1 - top_p). A pass runs over the row's candidate list when that
list provably holds every token the answer depends on (see ``_finish``), else over the row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import launchable
from ._sampling_chunks import INT32_MAX, ct_ptr_of, row_param, row_params, ws_ptr_of
from ._sampling_noise import exponential, row_keys, u64_halves, uniform_bits
from ._sampling_select import (key_from_i64, key_value, order_key, rel_weight, row_select_key,
                               select_key_in_block, to_compute)


@triton.jit
def _walk_pass(x_ptr, x_stride, idx_ptr, n, lo, m, inv_t, min_p, k0, k1, HAS_IDX: tl.constexpr,
               IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """Over tokens with key >= lo: (their mass, top score, winner index, winner key); w >= min_p to win.

    Each lane keeps its own running sum and best, so a block costs no reduction.
    """
    lanes = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], m.dtype)
    best_s = tl.full([BLOCK], -1.0, m.dtype)
    best_i = tl.full([BLOCK], INT32_MAX, tl.int32)
    best_k = lo + lanes.to(lo.dtype) * 0
    for start in range(0, n, BLOCK):
        offs = start + lanes
        mask = offs < n
        x = to_compute(tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf")), IS_F64)
        if HAS_IDX:
            idx = tl.load(idx_ptr + offs, mask=mask, other=0)
        else:
            idx = offs
        key = order_key(x, IS_F64)
        inside = mask & (key >= lo)
        w = rel_weight(x, m, inv_t)
        mass += tl.where(inside, w, 0.0)
        score = tl.where(inside & (w >= min_p), w / exponential(uniform_bits(idx, k0, k1)).to(m.dtype), -1.0)
        better = (score > best_s) | ((score == best_s) & (idx < best_i))
        best_s = tl.where(better, score, best_s)
        best_i = tl.where(better, idx, best_i)
        best_k = tl.where(better, key, best_k)
    top = tl.max(best_s, axis=0)
    winner = tl.min(tl.where(best_s == top, best_i, INT32_MAX), axis=0)
    winner_key = tl.max(tl.where((best_s == top) & (best_i == winner), best_k, lo * 0), axis=0)
    return tl.sum(mass, axis=0), winner, winner_key


@triton.jit
def _source_pass(use_cand, cx_ptr, ci_ptr, count, x_row_ptr, x_col_stride, n_cols, lo, m, inv_t, min_p, k0, k1,
                 IS_F64: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """``_walk_pass`` over the candidate list (``use_cand``) or over the whole row."""
    if use_cand:
        mass, winner, winner_key = _walk_pass(cx_ptr, 1, ci_ptr, count, lo, m, inv_t, min_p, k0, k1, True, IS_F64,
                                              CAP)
    else:
        mass, winner, winner_key = _walk_pass(x_row_ptr, x_col_stride, ci_ptr, n_cols, lo, m, inv_t, min_p, k0, k1,
                                              False, IS_F64, BLOCK)
    return mass, winner, winner_key


@launchable
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "seed_arg", "seed_hi",
                               "seed_stride", "step_arg", "step_hi", "step_stride", "off_rowf", "off_rowi",
                               "off_count", "off_cx", "off_ci"])
def _finish(out_ptr, ws_ptr, x_ptr, x_row_stride, x_col_stride,
            t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg, mp_stride,
            seed_arg, seed_hi, seed_stride, step_arg, step_hi, step_stride,
            n_cols, off_rowf, off_rowi, off_count, off_cx, off_ci,
            T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
            SEED_TENSOR: tl.constexpr, STEP_TENSOR: tl.constexpr, IS_F64: tl.constexpr,
            TOP_K_FIRST: tl.constexpr, GATHER: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr,
            SELECT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rowi = ws_ptr_of(ws_ptr, off_rowi, tl.int64)
    if tl.load(rowi + 2 * row) != 0:
        return
    rowf = ct_ptr_of(ws_ptr, off_rowf, IS_F64)
    m = tl.load(rowf + 2 * row)
    z = tl.load(rowf + 2 * row + 1)
    t, k, p, min_p, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg, mp_stride,
                                   T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    inv_t = 1.0 / t
    s_lo, s_hi = u64_halves(seed_arg, seed_hi, row, seed_stride, SEED_TENSOR)
    c_lo, c_hi = u64_halves(step_arg, step_hi, row, step_stride, STEP_TENSOR)
    k0, k1 = row_keys(s_lo, s_hi, c_lo, c_hi)
    k_on = (k > 0) & (k < n_cols)
    x_row = x_ptr + row * x_row_stride
    cx = ct_ptr_of(ws_ptr, off_cx, IS_F64) + row * CAP
    ci = ws_ptr_of(ws_ptr, off_ci, tl.int32) + row * CAP
    if GATHER:
        count = tl.load(ws_ptr_of(ws_ptr, off_count, tl.int32) + row)
    else:
        count = tl.full([], CAP + 1, tl.int32)
    use_cand = count <= CAP
    bound = key_from_i64(tl.load(rowi + 2 * row + 1), IS_F64)
    t_k = bound * 0
    mass = z * 0
    winner = count * 0
    winner_key = bound * 0

    # The list holds every token >= bound. It decides the row when the kept set lies above the
    # bound: always with top_k (t_k >= bound); without, when the whole row was gathered, when the
    # list's mass already reaches top_p (so t_p >= bound), or when min_p rejects the bound.
    if use_cand:
        lanes = tl.arange(0, CAP)
        valid = lanes < count
        if k_on:
            keys = order_key(tl.load(cx + lanes, mask=valid, other=float("-inf")), IS_F64)
            t_k = select_key_in_block(keys, keys, valid, k, False, 64 if IS_F64 else 32)
        mass, winner, winner_key = _walk_pass(cx, 1, ci, count, t_k, m, inv_t, min_p, k0, k1, True, IS_F64, CAP)
        w_bound = rel_weight(key_value(bound, IS_F64), m, inv_t)
        use_cand = k_on | (count == n_cols) | ((p < 1) & (mass >= p * z)) | ((min_p > 0) & (w_bound < min_p))
    if use_cand == 0:
        if k_on:
            t_k = row_select_key(x_row, x_col_stride, n_cols, k, m, inv_t, False, IS_F64, SELECT_BLOCK)
        mass, winner, winner_key = _walk_pass(x_row, x_col_stride, ci, n_cols, t_k, m, inv_t, min_p, k0, k1, False,
                                              IS_F64, BLOCK)
    # Reference mass for top_p: the top-k set (top_k_first) or the whole row (joint).
    if TOP_K_FIRST:
        z_ref = tl.where(k_on, mass, z)
    else:
        z_ref = z
    searching = p < 1
    while searching:
        above, nxt, nxt_key = _source_pass(use_cand, cx, ci, count, x_row, x_col_stride, n_cols, winner_key + 1, m,
                                           inv_t, min_p, k0, k1, IS_F64, CAP, BLOCK)
        searching = above >= p * z_ref
        winner = tl.where(searching, nxt, winner)
        winner_key = tl.where(searching, nxt_key, winner_key)
    tl.store(out_ptr + row, winner.to(out_ptr.dtype.element_ty))


@triton.jit
def _above(x_ptr, x_stride, n, key_k, m, inv_t, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """(mass of keys > key_k, their count, count of keys == key_k) over a row."""
    lanes = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], m.dtype)
    n_above = tl.zeros([BLOCK], tl.int32)
    n_equal = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        mask = offs < n
        x = to_compute(tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf")), IS_F64)
        key = order_key(x, IS_F64)
        gt = mask & (key > key_k)
        mass += tl.where(gt, rel_weight(x, m, inv_t), 0.0)
        n_above += gt.to(tl.int32)
        n_equal += (mask & (key == key_k)).to(tl.int32)
    return tl.sum(mass, axis=0), tl.sum(n_above, axis=0), tl.sum(n_equal, axis=0)


@triton.jit
def _nth_equal(x_ptr, x_stride, n, key_k, rank, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """Index of the ``rank``-th (1-based) token, in index order, whose key is ``key_k``."""
    lanes = tl.arange(0, BLOCK)
    found = rank * 0 - 1
    seen = rank * 0
    start = rank * 0
    while (found < 0) & (start < n):
        offs = start + lanes
        mask = offs < n
        x = to_compute(tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf")), IS_F64)
        equal = mask & (order_key(x, IS_F64) == key_k)
        hit = equal & (seen + tl.cumsum(equal.to(tl.int32), axis=0) == rank)
        first = tl.min(tl.where(hit, offs, INT32_MAX), axis=0)
        found = tl.where(first < INT32_MAX, first, found)
        seen += tl.sum(equal.to(tl.int32), axis=0)
        start += BLOCK
    return found


@launchable
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "rv_stride", "off_rowf",
                               "off_rowi"])
def _random_val(out_ptr, ws_ptr, x_ptr, x_row_stride, x_col_stride,
                t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg, mp_stride, rv_arg, rv_stride,
                n_cols, off_rowf, off_rowi,
                T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
                RV_TENSOR: tl.constexpr, IS_F64: tl.constexpr, BLOCK: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    # InfiniCore random_sample, without a sort: in descending order (ties by index) the cumulative
    # mass c reaches threshold = r * min(top_p, c[k-1]) first inside the tie group of the value
    # v* = the largest value whose mass at or above it reaches the threshold; within that group
    # each token adds the same w(v*), so the answer is its ceil((threshold - mass above) / w)-th.
    row = tl.program_id(0).to(tl.int64)
    if tl.load(ws_ptr_of(ws_ptr, off_rowi, tl.int64) + 2 * row) != 0:
        return
    rowf = ct_ptr_of(ws_ptr, off_rowf, IS_F64)
    m = tl.load(rowf + 2 * row)
    z = tl.load(rowf + 2 * row + 1)
    t, k, p, min_p, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg,
                                       mp_stride, T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    r = row_param(rv_arg, row, rv_stride, RV_TENSOR, tl.float32).to(m.dtype)
    inv_t = 1.0 / t
    x_row = x_ptr + row * x_row_stride
    k_on = (k > 0) & (k < n_cols)
    key_m = order_key(m, IS_F64)
    t_k = key_m * 0
    mass_k = z
    if k_on:
        t_k = row_select_key(x_row, x_col_stride, n_cols, k, m, inv_t, False, IS_F64, SELECT_BLOCK)
        above, n_above, n_equal = _above(x_row, x_col_stride, n_cols, t_k, m, inv_t, IS_F64, BLOCK)
        mass_k = above + (k - n_above).to(m.dtype) * rel_weight(key_value(t_k, IS_F64), m, inv_t)
    threshold = r * tl.minimum(p.to(m.dtype) * z, mass_k)
    target = row_select_key(x_row, x_col_stride, n_cols, threshold, m, inv_t, True, IS_F64, SELECT_BLOCK)
    target = tl.where(threshold > 0, tl.maximum(target, t_k), key_m)
    above, n_above, n_equal = _above(x_row, x_col_stride, n_cols, target, m, inv_t, IS_F64, BLOCK)
    if n_equal == 0:
        # Rounding put the threshold past the row's total mass: the answer is the last token in order.
        target = row_select_key(x_row, x_col_stride, n_cols, n_cols, m, inv_t, False, IS_F64, SELECT_BLOCK)
        above, n_above, n_equal = _above(x_row, x_col_stride, n_cols, target, m, inv_t, IS_F64, BLOCK)
    last = tl.where(k_on & (target == t_k), k - n_above, n_equal)
    step = tl.ceil((threshold - above) / rel_weight(key_value(target, IS_F64), m, inv_t))
    rank = tl.minimum(tl.maximum(step, 1.0), last.to(m.dtype)).to(tl.int32)
    token = _nth_equal(x_row, x_col_stride, n_cols, target, rank, IS_F64, BLOCK)
    tl.store(out_ptr + row, token.to(out_ptr.dtype.element_ty))
