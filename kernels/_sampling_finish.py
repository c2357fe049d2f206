"""The last launch of ``sample``: the filters and the draw, one program per row.

Every filter keeps the tokens at or above a value (ties with the boundary included), so the
kept set is ``{key >= t_k} & {key >= t_p} & {w >= min_p}`` where ``w = p / max(p)``. The draw
is the exponential race ``argmax w_i / E_i`` (in logs: ``log2 w_i + gumbel_i``) over that set,
with no need to find ``t_p``:

  walk: best = the winner over ``{key >= t_k}``; while the mass strictly above best reaches
  ``top_p`` of the reference mass, best was outside the nucleus, and so was everything at or
  below it: the next best is the winner over ``{key > best}``.

A check costs a pass of sums only; a rejection (probability about 1 - top_p) a pass with the
noise. The passes run over the row's candidate list when that list provably holds every token
the answer depends on (see ``_finish_row``), else over the whole row.

For rows the merge marked ROW_STATE_PASS1 the first pass (the winner over every token) was
run in parallel by the gather launch: the row's program only merges the chunks' winners
(:func:`pass1_winner`). When such a row has top_p, the check launch (``_sampling_check.py``)
has also summed, chunk by chunk, the mass above that winner: the walk's first check, which
otherwise would be a pass of this one program over the whole row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import launchable
from ._sampling_chunks import (CAP, INT32_MAX, ROW_STATE_DONE, ROW_STATE_PASS1, check_parts_of, ct_ptr_of,
                               row_params, ws_offsets, ws_ptr_of)
from ._sampling_noise import gumbel, row_keys, u64_halves, uniform_bits
from ._sampling_select import (key_from_i64, key_value, log2_weight, order_key, rel_weight, row_select_key,
                               select_key_in_block, to_compute)


@triton.jit
def _walk_pass(x_ptr, x_stride, idx_ptr, n, lo, m, scale, min_p, k0, k1, WITH_BEST: tl.constexpr,
               CANDIDATES: tl.constexpr, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """Over tokens with key >= lo: (their mass, winner index, winner key); a winner needs w >= min_p.

    Each lane keeps its own running sum and best, so a block costs no reduction. Candidate lists
    were written by other programs of this launch: read them past L1 (``.cg``).
    """
    lanes = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], m.dtype)
    if WITH_BEST:
        best_s = tl.full([BLOCK], float("-inf"), m.dtype)
        best_i = tl.full([BLOCK], INT32_MAX, tl.int32)
        best_k = lo + lanes.to(lo.dtype) * 0
    for start in range(0, n, BLOCK):
        offs = start + lanes
        mask = offs < n
        if CANDIDATES:
            x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(idx_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        else:
            x = tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf"))
            idx = offs
        x = to_compute(x, IS_F64)
        key = order_key(x, IS_F64)
        inside = mask & (key >= lo)
        d = log2_weight(x, m, scale)
        w = tl.exp2(d)
        mass += tl.where(inside, w, 0.0)
        if WITH_BEST:
            g = gumbel(uniform_bits(idx, k0, k1)).to(m.dtype)
            score = tl.where(inside & (w >= min_p), d + g, float("-inf"))
            better = (score > best_s) | ((score == best_s) & (idx < best_i))
            best_s = tl.where(better, score, best_s)
            best_i = tl.where(better, idx, best_i)
            best_k = tl.where(better, key, best_k)
    if WITH_BEST:
        top = tl.max(best_s, axis=0)
        winner = tl.min(tl.where(best_s == top, best_i, INT32_MAX), axis=0)
        winner_key = tl.max(tl.where((best_s == top) & (best_i == winner), best_k, lo * 0), axis=0)
    else:
        winner = tl.sum(lanes * 0, axis=0)
        winner_key = lo
    return tl.sum(mass, axis=0), winner, winner_key


@triton.jit
def _source_pass(use_cand, cx_ptr, ci_ptr, count, x_row_ptr, x_col_stride, n_cols, lo, m, scale, min_p, k0, k1,
                 WITH_BEST: tl.constexpr, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """``_walk_pass`` over the candidate list (``use_cand``) or over the whole row."""
    if use_cand:
        mass, winner, winner_key = _walk_pass(cx_ptr, 1, ci_ptr, count, lo, m, scale, min_p, k0, k1, WITH_BEST, True,
                                              IS_F64, CAP)
    else:
        mass, winner, winner_key = _walk_pass(x_row_ptr, x_col_stride, ci_ptr, n_cols, lo, m, scale, min_p, k0, k1,
                                              WITH_BEST, False, IS_F64, BLOCK)
    return mass, winner, winner_key


@triton.jit
def pass1_winner(ws_ptr, row, n_chunks, o_p1s, o_p1i, IS_F64: tl.constexpr, CB: tl.constexpr):
    """The row's first-pass winner (index, key) from its chunks' winners: lowest index on equal scores."""
    c = tl.arange(0, CB)
    slot = row * n_chunks + c
    cmask = c < n_chunks
    score = tl.load(ct_ptr_of(ws_ptr, o_p1s, IS_F64) + slot, mask=cmask, other=float("-inf"))
    index = tl.load(ws_ptr_of(ws_ptr, o_p1i, tl.int64) + 2 * slot, mask=cmask, other=INT32_MAX)
    keys = key_from_i64(tl.load(ws_ptr_of(ws_ptr, o_p1i, tl.int64) + 2 * slot + 1, mask=cmask, other=0), IS_F64)
    top = tl.max(score, axis=0)
    winner = tl.min(tl.where(score == top, index, INT32_MAX), axis=0).to(tl.int32)
    return winner, tl.max(tl.where(index == winner, keys, keys * 0), axis=0)


@triton.jit
def _finish_row(out_ptr, ws_ptr, x_row, x_col_stride, row, n_cols, n_chunks, pass1, checked, checked_above, t, k, p,
                min_p, k0, k1, o_count, o_rowi, o_rowf, o_cx, o_ci, o_p1s, o_p1i, IS_F64: tl.constexpr,
                TOP_K_FIRST: tl.constexpr, GATHER: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr,
                SELECT_BLOCK: tl.constexpr):
    """Draw the row. ``checked``: ``checked_above`` is the mass above the first-pass winner,
    summed by the chunks (the walk's first check when the walk starts from that winner)."""
    rowf = ct_ptr_of(ws_ptr, o_rowf, IS_F64)
    m = tl.load(rowf + 2 * row)
    z = tl.load(rowf + 2 * row + 1)
    scale = 1.4426950408889634 / t  # log2(e) / T
    k_on = (k > 0) & (k < n_cols)
    cx = ct_ptr_of(ws_ptr, o_cx, IS_F64) + row * CAP
    ci = ws_ptr_of(ws_ptr, o_ci, tl.int32) + row * CAP
    if GATHER:
        count = tl.load(ws_ptr_of(ws_ptr, o_count, tl.int32) + row, cache_modifier=".cg")
    else:
        count = tl.full([], CAP + 1, tl.int32)
    use_cand = count <= CAP
    bound = key_from_i64(tl.load(ws_ptr_of(ws_ptr, o_rowi, tl.int64) + 2 * row + 1), IS_F64)
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
            keys = order_key(tl.load(cx + lanes, mask=valid, other=float("-inf"), cache_modifier=".cg"), IS_F64)
            t_k = select_key_in_block(keys, keys, valid, k, False, 64 if IS_F64 else 32, 16 if IS_F64 else 8)
        mass, winner, winner_key = _walk_pass(cx, 1, ci, count, t_k, m, scale, min_p, k0, k1, True, True, IS_F64,
                                              CAP)
        w_bound = rel_weight(key_value(bound, IS_F64), m, scale)
        use_cand = k_on | (count == n_cols) | ((p < 1) & (mass >= p * z)) | ((min_p > 0) & (w_bound < min_p))
    if (use_cand == 0) & pass1:
        # No top_k here, so t_k = 0.
        winner, winner_key = pass1_winner(ws_ptr, row, n_chunks, o_p1s, o_p1i, IS_F64, CB)
    if (use_cand == 0) & (pass1 == 0):
        if k_on:
            t_k = row_select_key(x_row, x_col_stride, n_cols, k, m, scale, False, IS_F64, SELECT_BLOCK)
        mass, winner, winner_key = _walk_pass(x_row, x_col_stride, ci, n_cols, t_k, m, scale, min_p, k0, k1, True,
                                              False, IS_F64, BLOCK)
    # Reference mass for top_p: the top-k set (top_k_first) or the whole row (joint).
    if TOP_K_FIRST:
        z_ref = tl.where(k_on, mass, z)
    else:
        z_ref = z
    searching = p < 1
    first_checked = (checked & (use_cand == 0) & pass1).to(tl.int32)
    while searching:
        if first_checked != 0:
            above = checked_above
        else:
            above, unused, unused_key = _source_pass(use_cand, cx, ci, count, x_row, x_col_stride, n_cols,
                                                     winner_key + 1, m, scale, min_p, k0, k1, False, IS_F64, BLOCK)
        first_checked = first_checked * 0
        searching = above >= p * z_ref
        if searching:
            above, winner, winner_key = _source_pass(use_cand, cx, ci, count, x_row, x_col_stride, n_cols,
                                                     winner_key + 1, m, scale, min_p, k0, k1, True, IS_F64, BLOCK)
    tl.store(out_ptr + row, winner.to(out_ptr.dtype.element_ty))


@launchable
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "seed_arg", "seed_hi",
                               "seed_stride", "step_arg", "step_hi", "step_stride", "n_rows"])
def _finish(out_ptr, ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride,
            mp_arg, mp_stride, seed_arg, seed_hi, seed_stride, step_arg, step_hi, step_stride, n_rows, n_cols,
            T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
            SEED_TENSOR: tl.constexpr, STEP_TENSOR: tl.constexpr, IS_F64: tl.constexpr, TOP_K_FIRST: tl.constexpr,
            GATHER: tl.constexpr, CHECKED: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr, CB: tl.constexpr,
            BLOCK: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i = ws_offsets(
        n_rows, n_chunks, NG, IS_F64)
    state = tl.load(ws_ptr_of(ws_ptr, o_rowi, tl.int64) + 2 * row)
    if state == ROW_STATE_DONE:
        return
    t, k, p, min_p, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg,
                                       mp_stride, T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    pass1 = state == ROW_STATE_PASS1
    # Where the plan ran the check launch (CHECKED), a first-pass row with top_p has the mass
    # above its first-pass winner summed by chunks: the walk's first check.
    above = to_compute(tl.zeros([], tl.float32), IS_F64)
    if CHECKED:
        checked = pass1 & (p < 1)
        if checked:
            c = tl.arange(0, CB)
            parts = check_parts_of(ws_ptr, o_p1i, row, n_rows, n_chunks, IS_F64)
            above = tl.sum(tl.load(parts + c, mask=c < n_chunks, other=0.0), axis=0)
    else:
        checked = state < 0  # never
    s_lo, s_hi = u64_halves(seed_arg, seed_hi, row, seed_stride, SEED_TENSOR)
    c_lo, c_hi = u64_halves(step_arg, step_hi, row, step_stride, STEP_TENSOR)
    k0, k1 = row_keys(s_lo, s_hi, c_lo, c_hi)
    _finish_row(out_ptr, ws_ptr, x_ptr + row * x_row_stride, x_col_stride, row, n_cols, n_chunks, pass1, checked,
                above, t, k, p, min_p, k0, k1, o_count, o_rowi, o_rowf, o_cx, o_ci, o_p1s, o_p1i, IS_F64, TOP_K_FIRST,
                GATHER, CB, BLOCK, SELECT_BLOCK)
