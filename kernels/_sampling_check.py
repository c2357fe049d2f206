"""The launch between the gather and the finish where rows may need it: the walk's first check,
summed chunk by chunk.

A row without top_k whose candidate list may not decide it (ROW_STATE_PASS1) starts its walk
from the first-pass winner and checks whether the mass strictly above that winner reaches
top_p of the row's (``_sampling_finish.py``). In the row's finish program alone that check is
a pass of one program over the whole row: on the H100 about 20 us for a 128K-token row.

Here each program (grid rows x groups of ``per_program`` chunks of ``_sampling_chunks``) merges
the chunks' winners as the finish does and writes each of its chunks' part of that mass; the
finish adds the parts. A chunk a program for a few rows (the latency case); for many, a few
chunks a program keep the grid near ``CHECK_PROGRAMS`` (kernels/sample.py), since in a batch
with top_k most programs leave at once. The terms are ``_walk_pass``'s, summed in chunks of a
width that depends on the vocabulary alone, so a row's sum does not change with its batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import launchable
from ._sampling_chunks import ROW_STATE_PASS1, check_parts_of, ct_ptr_of, row_param, ws_offsets, ws_ptr_of
from ._sampling_finish import pass1_winner
from ._sampling_select import log2_weight, order_key, to_compute


@launchable
@triton.jit(do_not_specialize=["t_stride", "p_stride", "n_rows", "per_program"])
def _check(ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, p_arg, p_stride, n_rows, n_cols, per_program,
           T_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, IS_F64: tl.constexpr, CH: tl.constexpr,
           NG: tl.constexpr, CB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i = ws_offsets(
        n_rows, n_chunks, NG, IS_F64)
    if tl.load(ws_ptr_of(ws_ptr, o_rowi, tl.int64) + 2 * row) != ROW_STATE_PASS1:
        return
    p = row_param(p_arg, row, p_stride, P_TENSOR, tl.float32)
    if p >= 1:
        return
    t = row_param(t_arg, row, t_stride, T_TENSOR, tl.float32)
    m = tl.load(ct_ptr_of(ws_ptr, o_rowf, IS_F64) + 2 * row)
    winner, winner_key = pass1_winner(ws_ptr, row, n_chunks, o_p1s, o_p1i, IS_F64, CB)
    scale = 1.4426950408889634 / t
    parts = check_parts_of(ws_ptr, o_p1i, row, n_rows, n_chunks, IS_F64)
    for j in range(0, per_program):
        chunk = tl.program_id(1) * per_program + j
        cols = chunk * CH + tl.arange(0, CH)
        mask = cols < n_cols
        x = to_compute(tl.load(x_ptr + row * x_row_stride + cols.to(tl.int64) * x_col_stride, mask=mask,
                               other=float("-inf")), IS_F64)
        inside = mask & (order_key(x, IS_F64) >= winner_key + 1)
        part = tl.sum(tl.where(inside, tl.exp2(log2_weight(x, m, scale)), 0.0), axis=0)
        tl.store(parts + chunk, part, mask=chunk < n_chunks)
