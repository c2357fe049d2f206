"""Candidates: the second launch of ``sample``, the gather, and the first pass where it is needed.

Grid rows x chunks, the chunk tiles of ``stats.py``. Each program appends its chunk's
tokens at or above the row's bound ``L`` to the row's list of ``CAP`` candidate slots, a slot
per token from an atomic counter (slot order does not matter: everything after reads the list
as a set). Only the groups whose max reaches L are read again (a group's runs of 8 are whole
sectors), so a top-k row re-reads a few kilobytes, not its chunk.

For rows the merge marked ROW_STATE_PASS1 (the list may not decide them) each program also
runs the first pass of the draw over its whole chunk (``top_p.first_pass_chunk``), leaving the
chunk's winner for the draw launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable
from .noise import row_keys, u64_halves
from .stats import chunk_tile, row_param
from .top_k import key_from_i64, order_key
from .top_p import first_pass_chunk
from .weights import to_compute
from .workspace import CAP, ROW_STATE_DONE, ROW_STATE_PASS1, ct_ptr_of, ws_offsets, ws_ptr_of


@launchable
@triton.jit(do_not_specialize=["t_stride", "mp_stride", "seed_arg", "seed_hi", "seed_stride", "step_arg", "step_hi",
                               "step_stride", "n_rows"])
def _gather(ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, mp_arg, mp_stride, seed_arg, seed_hi,
            seed_stride, step_arg, step_hi, step_stride, n_rows, n_cols,
            T_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr, SEED_TENSOR: tl.constexpr, STEP_TENSOR: tl.constexpr,
            IS_F64: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr, GATHER: tl.constexpr,
            WITH_PASS1: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
        n_rows, n_chunks, NG, IS_F64)
    rowi = ws_ptr_of(ws_ptr, o_rowi, tl.int64)
    state = tl.load(rowi + 2 * row)
    if state == ROW_STATE_DONE:
        return
    # WITH_PASS1 is False where no row can be marked (top_k a scalar within reach): the pass's
    # code would otherwise cost this kernel registers, and the gather its occupancy.
    if WITH_PASS1:
        pass1 = state == ROW_STATE_PASS1
    else:
        pass1 = state < 0
    count_ptr = ws_ptr_of(ws_ptr, o_count, tl.int32) + row
    if GATHER:
        bound = key_from_i64(tl.load(rowi + 2 * row + 1), IS_F64)
        group_max = tl.load(ct_ptr_of(ws_ptr, o_groups, IS_F64) + (row * n_chunks + chunk) * NG + tl.arange(0, NG))
        hit = order_key(group_max, IS_F64) >= bound
        gather = (tl.max(hit.to(tl.int32), axis=0) > 0) & (tl.load(count_ptr) <= CAP)
    else:
        hit = tl.arange(0, NG) < 0
        gather = state < 0
    if gather | pass1:
        col, mask = chunk_tile(chunk, n_cols, CH, NG)
        # (an int "or": triton 3.9's interpreter widens bool-vector | bool-scalar to int32 data)
        read = mask & ((hit.to(tl.int32)[None, :, None] | pass1.to(tl.int32)) != 0)
        x = tl.load(x_ptr + row * x_row_stride + col.to(tl.int64) * x_col_stride, mask=read, other=float("-inf"))
        x = to_compute(x, IS_F64)
        key = order_key(x, IS_F64)
        if GATHER:
            if gather:
                take = mask & hit[None, :, None] & (key >= bound)
                pos = tl.atomic_add(count_ptr + col.to(tl.int64) * 0, 1, mask=take)
                take = take & (pos < CAP)
                tl.store(ct_ptr_of(ws_ptr, o_cx, IS_F64) + row * CAP + pos, x, mask=take)
                tl.store(ws_ptr_of(ws_ptr, o_ci, tl.int32) + row * CAP + pos, col, mask=take)
        if WITH_PASS1:
            if pass1:
                rowf = ct_ptr_of(ws_ptr, o_rowf, IS_F64)
                m = tl.load(rowf + 2 * row)
                t = row_param(t_arg, row, t_stride, T_TENSOR, tl.float32)
                min_p = row_param(mp_arg, row, mp_stride, MP_TENSOR, tl.float32)
                s_lo, s_hi = u64_halves(seed_arg, seed_hi, row, seed_stride, SEED_TENSOR)
                c_lo, c_hi = u64_halves(step_arg, step_hi, row, step_stride, STEP_TENSOR)
                k0, k1 = row_keys(s_lo, s_hi, c_lo, c_hi)
                first_pass_chunk(ws_ptr, x, key, col, mask, row * n_chunks + chunk, m, 1.4426950408889634 / t, min_p,
                                 k0, k1, o_p1s, o_p1i, IS_F64)
