"""The split passes of ``sample``: per-chunk statistics, the per-row merge, and the candidate gather.

A row of ``n_cols`` logits is cut into chunks of ``CH`` columns so that one row still spreads
over many programs (a single row is the latency case). Within a chunk, the ``CH`` values form
``NG`` strided groups (group ``j`` holds columns ``j, j + NG, j + 2 NG, ...``).

1. ``chunk_stats_kernel`` (grid rows x chunks): the chunk's max and first arg-max, its softmax
   partial ``sum(exp((x - max_c) / T))``, NaN / finite flags, and the max of each group.
2. ``row_merge_kernel`` (grid rows): the row's max, softmax total, validity and greedy token; it
   writes the answer of invalid (-1) and greedy rows. For the others it finds a lower bound
   ``L`` of the k-th largest logit: the k-th largest *group max*. k group maxima are k distinct
   tokens >= L, so at least k tokens are >= L and the k-th largest value is >= L; strided
   groups keep clusters of large logits in different groups, so the bound is tight.
3. ``gather_kernel`` (grid rows x chunks): every token >= L into a per-row candidate list of
   ``CAP`` slots (an atomic counter hands out positions). The list is then complete above L.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import launchable
from ._sampling_select import key_bits_to_i64, key_from_i64, order_key, rel_weight, select_key_in_block, to_compute

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def row_param(arg, row, stride, IS_TENSOR: tl.constexpr, dtype: tl.constexpr):
    """A per-row parameter as ``dtype``: element ``row`` of a tensor, or the scalar itself."""
    if IS_TENSOR:
        return tl.load(arg + row * stride).to(dtype)
    else:
        return tl.cast(arg, dtype)


@triton.jit
def row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg, mp_stride,
               T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr):
    """(temperature, top_k clipped to n_cols (int32), top_p, min_p, top_k < 0) for one row, float32 values."""
    t = row_param(t_arg, row, t_stride, T_TENSOR, tl.float32)
    k_raw = row_param(k_arg, row, k_stride, K_TENSOR, tl.int64)
    k = tl.minimum(k_raw, n_cols).to(tl.int32)
    p = row_param(p_arg, row, p_stride, P_TENSOR, tl.float32)
    mp = row_param(mp_arg, row, mp_stride, MP_TENSOR, tl.float32)
    return t, k, p, mp, k_raw < 0


@triton.jit
def ws_ptr_of(ws_ptr, byte_offset, dtype: tl.constexpr):
    """A typed view into the plan's byte workspace."""
    return (ws_ptr + byte_offset).to(tl.pointer_type(dtype))


@triton.jit
def ct_ptr_of(ws_ptr, byte_offset, IS_F64: tl.constexpr):
    """A view of compute-dtype values in the workspace."""
    if IS_F64:
        return (ws_ptr + byte_offset).to(tl.pointer_type(tl.float64))
    else:
        return (ws_ptr + byte_offset).to(tl.pointer_type(tl.float32))


@launchable
@triton.jit(do_not_specialize=["t_stride", "off_stats", "off_flags", "off_groups"])
def _chunk_stats(ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, n_cols, n_chunks, n_groups,
                 off_stats, off_flags, off_groups,
                 T_TENSOR: tl.constexpr, IS_F64: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr,
                 WITH_SOFTMAX: tl.constexpr, WITH_GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    GS: tl.constexpr = CH // NG
    col = chunk * CH + tl.arange(0, GS)[:, None] * NG + tl.arange(0, NG)[None, :]
    mask = col < n_cols
    x = tl.load(x_ptr + row * x_row_stride + col.to(tl.int64) * x_col_stride, mask=mask, other=float("-inf"))
    x = to_compute(x, IS_F64)
    is_nan = x != x
    finite = (x > float("-inf")) & (x < float("inf"))
    flags = tl.max(tl.max(is_nan.to(tl.int32), 1), 0) | (tl.max(tl.max(finite.to(tl.int32), 1), 0) << 1)
    x = tl.where(is_nan, float("-inf"), x)
    group_max = tl.max(x, axis=0)
    m = tl.max(group_max, axis=0)
    first = tl.min(tl.min(tl.where((x == m) & mask, col, INT32_MAX), 1), 0)
    slot = row * n_chunks + chunk
    stats = ct_ptr_of(ws_ptr, off_stats, IS_F64)
    flag_ptr = ws_ptr_of(ws_ptr, off_flags, tl.int32)
    tl.store(stats + 2 * slot, m)
    tl.store(flag_ptr + 2 * slot, flags)
    tl.store(flag_ptr + 2 * slot + 1, first)
    if WITH_SOFTMAX:
        # Online-softmax partial (Milakov and Gimelshein, arXiv:1805.02867): sum relative to this
        # chunk's max; the merge rescales by exp((m_c - m) / T).
        t = row_param(t_arg, row, t_stride, T_TENSOR, tl.float32)
        inv_t = 1.0 / tl.where(t > 0, t, 1.0)
        z = tl.sum(tl.sum(rel_weight(x, m, inv_t), 1), 0)
        tl.store(stats + 2 * slot + 1, tl.where(m == float("-inf"), 0.0, z))
    if WITH_GROUPS:
        groups = ct_ptr_of(ws_ptr, off_groups, IS_F64)
        tl.store(groups + row * n_groups + chunk * NG + tl.arange(0, NG), group_max)


@launchable
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "rv_stride",
                               "off_stats", "off_flags", "off_groups", "off_rowf", "off_rowi", "off_count"])
def _row_merge(out_ptr, ws_ptr, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg, mp_stride,
               rv_arg, rv_stride, n_cols, n_chunks, n_groups,
               off_stats, off_flags, off_groups, off_rowf, off_rowi, off_count,
               T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
               RV_MODE: tl.constexpr, RV_TENSOR: tl.constexpr, IS_F64: tl.constexpr,
               CH: tl.constexpr, NG: tl.constexpr, CB: tl.constexpr, GB: tl.constexpr,
               WITH_SOFTMAX: tl.constexpr, WITH_GROUPS: tl.constexpr, K_GATHER_MAX: tl.constexpr,
               K_GATHER_DEFAULT: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CB)
    cmask = c < n_chunks
    slot = row * n_chunks + c
    stats = ct_ptr_of(ws_ptr, off_stats, IS_F64)
    flag_ptr = ws_ptr_of(ws_ptr, off_flags, tl.int32)
    m_c = tl.load(stats + 2 * slot, mask=cmask, other=float("-inf"))
    flags = tl.load(flag_ptr + 2 * slot, mask=cmask, other=0)
    first = tl.load(flag_ptr + 2 * slot + 1, mask=cmask, other=INT32_MAX)
    m = tl.max(m_c, axis=0)
    greedy_token = tl.min(tl.where(cmask & (m_c == m), first, INT32_MAX), axis=0)

    t, k, p, mp, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg,
                                    mp_stride, T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    # Per-row tensor values are checked here, not on the host (that would cost a synchronisation):
    # a row whose parameter breaks its rule returns -1.
    bad = (tl.max(flags & 1, axis=0) != 0) | (tl.max((flags >> 1) & 1, axis=0) == 0)
    bad = bad | ((t >= 0) & (t < float("inf")) == 0) | k_neg | ((p > 0) & (p <= 1) == 0)
    bad = bad | ((mp >= 0) & (mp <= 1) == 0)
    if RV_MODE:
        r = row_param(rv_arg, row, rv_stride, RV_TENSOR, tl.float32)
        bad = bad | ((r >= 0) & (r < 1) == 0) | (mp != 0)
    done = bad | (t == 0) | (k == 1)
    rowi = ws_ptr_of(ws_ptr, off_rowi, tl.int64)
    tl.store(rowi + 2 * row, done.to(tl.int64))
    if done:
        tl.store(out_ptr + row, tl.where(bad, -1, greedy_token).to(out_ptr.dtype.element_ty))
    if WITH_SOFTMAX:
        inv_t = 1.0 / tl.where(t > 0, t, 1.0)
        z_c = tl.load(stats + 2 * slot + 1, mask=cmask, other=0.0)
        rowf = ct_ptr_of(ws_ptr, off_rowf, IS_F64)
        tl.store(rowf + 2 * row, m)
        tl.store(rowf + 2 * row + 1, tl.sum(z_c * rel_weight(m_c, m, inv_t), axis=0))
    if WITH_GROUPS:
        # top_k within the gather's reach sets the bound; no top_k gathers the K_GATHER_DEFAULT
        # largest (enough for a peaked nucleus); a larger top_k skips the gather (counter past CAP).
        k_on = (k > 0) & (k < n_cols)
        k_bound = tl.where(k_on & (k <= K_GATHER_MAX), k, K_GATHER_DEFAULT)
        g = tl.arange(0, GB)
        gmask = (g < n_groups) & ((g // NG) * CH + g % NG < n_cols)
        group_max = tl.load(ct_ptr_of(ws_ptr, off_groups, IS_F64) + row * n_groups + g, mask=gmask,
                            other=float("-inf"))
        keys = order_key(group_max, IS_F64)
        bound = select_key_in_block(keys, keys, gmask, k_bound, False, 64 if IS_F64 else 32)
        bound = tl.where(k_bound > tl.sum(gmask.to(tl.int32), axis=0), 0, bound)
        tl.store(rowi + 2 * row + 1, key_bits_to_i64(bound, IS_F64))
        count_ptr = ws_ptr_of(ws_ptr, off_count, tl.int32)
        tl.store(count_ptr + row, tl.where(k_on & (k > K_GATHER_MAX), CAP + 1, 0))


@launchable
@triton.jit(do_not_specialize=["off_rowi", "off_count", "off_cx", "off_ci"])
def _gather(ws_ptr, x_ptr, x_row_stride, x_col_stride, n_cols, off_rowi, off_count, off_cx, off_ci,
            IS_F64: tl.constexpr, CH: tl.constexpr, CAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    rowi = ws_ptr_of(ws_ptr, off_rowi, tl.int64)
    count_ptr = ws_ptr_of(ws_ptr, off_count, tl.int32)
    if (tl.load(rowi + 2 * row) != 0) | (tl.load(count_ptr + row) > CAP):
        return
    bound = key_from_i64(tl.load(rowi + 2 * row + 1), IS_F64)
    col = chunk * CH + tl.arange(0, CH)
    mask = col < n_cols
    x = tl.load(x_ptr + row * x_row_stride + col.to(tl.int64) * x_col_stride, mask=mask, other=float("-inf"))
    x = to_compute(x, IS_F64)
    sel = mask & (order_key(x, IS_F64) >= bound)
    n_sel = tl.sum(sel.to(tl.int32), axis=0)
    if n_sel > 0:
        base = tl.atomic_add(count_ptr + row, n_sel)
        pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        ok = sel & (pos < CAP)
        tl.store(ct_ptr_of(ws_ptr, off_cx, IS_F64) + row * CAP + pos, x, mask=ok)
        tl.store(ws_ptr_of(ws_ptr, off_ci, tl.int32) + row * CAP + pos, col, mask=ok)
