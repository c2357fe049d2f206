"""InfiniCore's ``random_sample`` (``sample(..., random_val=...)``): exact, without a sort.

In descending order (ties: lower index first) the cumulative softmax ``c`` reaches
``threshold = random_val * min(top_p, c[k - 1])`` first inside the tie group of ``v*``, the
largest value whose mass at or above it reaches the threshold. Radix selection by mass finds
``v*`` (``top_k.py``); within its tie group every token adds the same ``w(v*)``, so the
answer is the group's ``ceil((threshold - mass above v*) / w(v*))``-th token by index. One
program per row, a pass over the row per radix round: this mode need not be fast.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable
from .stats import INT32_MAX, row_param, row_params
from .top_k import key_value, order_key, row_select_key
from .weights import rel_weight, to_compute
from .workspace import ROW_STATE_DONE, ct_ptr_of, ws_offsets, ws_ptr_of


@triton.jit
def _above(x_ptr, x_stride, n, key_k, m, scale, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
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
        mass += tl.where(gt, rel_weight(x, m, scale), 0.0)
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
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "rv_stride", "n_rows"])
def _random_val(out_ptr, ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, k_arg, k_stride, p_arg,
                p_stride, mp_arg, mp_stride, rv_arg, rv_stride, n_rows, n_cols,
                T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
                RV_TENSOR: tl.constexpr, IS_F64: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr,
                BLOCK: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
        n_rows, tl.cdiv(n_cols, CH), NG, IS_F64)
    if tl.load(ws_ptr_of(ws_ptr, o_rowi, tl.int64) + 2 * row) == ROW_STATE_DONE:
        return
    rowf = ct_ptr_of(ws_ptr, o_rowf, IS_F64)
    m = tl.load(rowf + 2 * row)
    z = tl.load(rowf + 2 * row + 1)
    t, k, p, min_p, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg,
                                       mp_stride, T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    r = row_param(rv_arg, row, rv_stride, RV_TENSOR, tl.float32).to(m.dtype)
    scale = 1.4426950408889634 / t  # log2(e) / T
    x_row = x_ptr + row * x_row_stride
    k_on = (k > 0) & (k < n_cols)
    key_m = order_key(m, IS_F64)
    t_k = key_m * 0
    mass_k = z
    if k_on:
        t_k = row_select_key(x_row, x_col_stride, n_cols, k, m, scale, False, IS_F64, SELECT_BLOCK)
        above, n_above, n_equal = _above(x_row, x_col_stride, n_cols, t_k, m, scale, IS_F64, BLOCK)
        mass_k = above + (k - n_above).to(m.dtype) * rel_weight(key_value(t_k, IS_F64), m, scale)
    threshold = r * tl.minimum(p.to(m.dtype) * z, mass_k)
    target = row_select_key(x_row, x_col_stride, n_cols, threshold, m, scale, True, IS_F64, SELECT_BLOCK)
    target = tl.where(threshold > 0, tl.maximum(target, t_k), key_m)
    above, n_above, n_equal = _above(x_row, x_col_stride, n_cols, target, m, scale, IS_F64, BLOCK)
    if n_equal == 0:
        # Rounding put the threshold past the row's total mass: the answer is the last token in order.
        target = row_select_key(x_row, x_col_stride, n_cols, n_cols, m, scale, False, IS_F64, SELECT_BLOCK)
        above, n_above, n_equal = _above(x_row, x_col_stride, n_cols, target, m, scale, IS_F64, BLOCK)
    last = tl.where(k_on & (target == t_k), k - n_above, n_equal)
    step = tl.ceil((threshold - above) / rel_weight(key_value(target, IS_F64), m, scale))
    rank = tl.minimum(tl.maximum(step, 1.0), last.to(m.dtype)).to(tl.int32)
    token = _nth_equal(x_row, x_col_stride, n_cols, target, rank, IS_F64, BLOCK)
    tl.store(out_ptr + row, token.to(out_ptr.dtype.element_ty))
