"""The draw: the last launch of ``sample``, the filters and the race, one program per row.

A row's program reads what the merge left (max, softmax total, candidate bound ``L``, state),
derives the row's noise keys from ``(seed, step)`` (``noise.py``) and draws:

1. top_k: its threshold ``t_k``, the k-th largest key, selected among the candidates or, where
   the list cannot hold them, over the row (``top_k.py``).
2. The race's winner over ``{key >= t_k}`` with ``w >= min_p``: over the candidate list when it
   decides the row (:func:`_finish_row`), else over the row; for ROW_STATE_PASS1 rows it was
   computed chunk by chunk by the gather launch.
3. top_p's walk from that winner (``top_p.py``), its first check summed by the check launch
   where the plan ran it (``CHECKED``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable
from .noise import row_keys, u64_halves
from .stats import row_params
from .top_k import key_from_i64, key_value, order_key, row_select_key, select_key_in_block
from .top_p import _walk_pass, pass1_winner, walk
from .weights import rel_weight, to_compute
from .workspace import CAP, ROW_STATE_DONE, ROW_STATE_PASS1, ct_ptr_of, ws_offsets, ws_ptr_of


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
    first_checked = (checked & (use_cand == 0) & pass1).to(tl.int32)
    winner = walk(winner, winner_key, first_checked, checked_above, p, z_ref, use_cand, cx, ci, count, x_row,
                  x_col_stride, n_cols, m, scale, min_p, k0, k1, IS_F64, BLOCK)
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
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
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
            parts = ct_ptr_of(ws_ptr, o_parts, IS_F64) + row * n_chunks
            above = tl.sum(tl.load(parts + c, mask=c < n_chunks, other=0.0), axis=0)
    else:
        checked = state < 0  # never
    s_lo, s_hi = u64_halves(seed_arg, seed_hi, row, seed_stride, SEED_TENSOR)
    c_lo, c_hi = u64_halves(step_arg, step_hi, row, step_stride, STEP_TENSOR)
    k0, k1 = row_keys(s_lo, s_hi, c_lo, c_hi)
    _finish_row(out_ptr, ws_ptr, x_ptr + row * x_row_stride, x_col_stride, row, n_cols, n_chunks, pass1, checked,
                above, t, k, p, min_p, k0, k1, o_count, o_rowi, o_rowf, o_cx, o_ci, o_p1s, o_p1i, IS_F64, TOP_K_FIRST,
                GATHER, CB, BLOCK, SELECT_BLOCK)
