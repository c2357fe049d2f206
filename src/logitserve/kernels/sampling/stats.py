"""Candidate statistics: the first launch of ``sample``, per-chunk statistics then the per-row merge.

A row of ``n_cols`` logits is cut into chunks of ``CH`` columns so that one row still spreads
over many programs (a single row is the latency case). A chunk is loaded as a
``[CH / (8 NG), NG, 8]`` tile; ``tile[:, j, :]`` is group ``j``: runs of 8 adjacent tokens (one
32-byte sector), repeating every ``8 NG`` tokens. A group is spread across its chunk (a cluster
of large logits lands in several groups) yet costs only its own sectors to read back. (A 2-D
tile reshaped into groups is slower: the reshape goes through shared memory.)

``_stats_merge`` (grid rows x chunks): each program reduces its chunk to its max, first arg-max,
softmax partial ``sum(exp((x - max_c) / T))``, a NaN / finite flag and its group maxima. The
last program of a row to finish (an atomic ticket: the classic last-block pattern, CUDA's
threadFenceReduction sample) merges the row: max, softmax total, validity, greedy token. It
writes the answer of invalid (-1) and greedy rows. For the others it finds a lower bound ``L``
of the k-th largest logit, the k-th largest *group max*: k group maxima are k distinct tokens
>= L, so the k-th largest value is >= L. Strided groups put a cluster of large logits into
different groups, which keeps the bound tight.

The merge also marks the rows whose candidate list may not decide the draw (no top_k, and the
group maxima at or above L do not already carry top_p of the mass, nor does min_p reject L):
for those the gather launch computes the first pass of the draw in parallel (ROW_STATE_PASS1).

The merge is also where per-row parameter tensors on CUDA are checked (a row that breaks a rule
of ``params.py`` returns -1), and where greedy rows (``temperature == 0`` or ``top_k == 1``) are
answered.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable
from .top_k import key_bits_to_i64, key_value, order_key, row_select_key
from .weights import rel_weight, to_compute
from .workspace import CAP, ROW_STATE_DONE, ROW_STATE_PASS1, ROW_STATE_SAMPLE, ct_ptr_of, ws_offsets, ws_ptr_of

INT32_MAX = tl.constexpr(2147483647)
# A top_k up to K_GATHER_MAX (or, without top_k, the K_GATHER_DEFAULT largest logits) sets the
# gather bound (CAP in workspace.py: the list's slots); a larger top_k skips the gather.
K_GATHER_MAX = tl.constexpr(128)
K_GATHER_DEFAULT = tl.constexpr(128)
# The bound needs only be a lower bound: 5 rounds of 4 bits settle sign, exponent and 11
# mantissa bits of the k-th group max (0.05% of its value), in 5 of the 8 rounds.
BOUND_ROUNDS = tl.constexpr(5)


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
def chunk_tile(chunk, n_cols, CH: tl.constexpr, NG: tl.constexpr):
    """Columns and in-row mask of a chunk's [CH / (8 NG), NG, 8] tile (``[:, j, :]`` is group j)."""
    R: tl.constexpr = CH // (8 * NG)
    col = (chunk * CH + tl.arange(0, R)[:, None, None] * (8 * NG) + tl.arange(0, NG)[None, :, None] * 8
           + tl.arange(0, 8)[None, None, :])
    return col, col < n_cols


@triton.jit
def tile_max(v):
    return tl.max(tl.max(tl.max(v, axis=2), axis=1), axis=0)


@triton.jit
def tile_min(v):
    return tl.min(tl.min(tl.min(v, axis=2), axis=1), axis=0)


@triton.jit
def tile_sum(v):
    return tl.sum(tl.sum(tl.sum(v, axis=2), axis=1), axis=0)


@launchable
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "rv_stride", "n_rows"])
def _stats_merge(out_ptr, ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, k_arg, k_stride, p_arg,
                 p_stride, mp_arg, mp_stride, rv_arg, rv_stride, n_rows, n_cols,
                 T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
                 RV_MODE: tl.constexpr, RV_TENSOR: tl.constexpr, IS_F64: tl.constexpr, CH: tl.constexpr,
                 NG: tl.constexpr, CB: tl.constexpr, SELECT_BLOCK: tl.constexpr, WITH_SOFTMAX: tl.constexpr,
                 WITH_GROUPS: tl.constexpr, WITH_ARGMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
        n_rows, n_chunks, NG, IS_F64)
    stats = ct_ptr_of(ws_ptr, o_stats, IS_F64)
    flag_ptr = ws_ptr_of(ws_ptr, o_flags, tl.int32)
    groups = ct_ptr_of(ws_ptr, o_groups, IS_F64)
    t, k, p, mp, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg,
                                    mp_stride, T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    scale = 1.4426950408889634 / tl.where(t > 0, t, 1.0)  # log2(e) / T

    # This chunk's partials.
    col, mask = chunk_tile(chunk, n_cols, CH, NG)
    x = tl.load(x_ptr + row * x_row_stride + col.to(tl.int64) * x_col_stride, mask=mask, other=float("-inf"))
    x = to_compute(x, IS_F64)
    is_nan = x != x
    # One reduction for both flags: 2 if a NaN (the row is invalid whatever else), else 1 if a finite value.
    flag = tile_max(tl.where(is_nan, 2, ((x > float("-inf")) & (x < float("inf"))).to(tl.int32)))
    x = tl.where(is_nan, float("-inf"), x)
    if WITH_GROUPS:
        group_max = tl.max(tl.max(x, axis=2), axis=0)
        m = tl.max(group_max, axis=0)
    else:
        m = tile_max(x)
    slot = row * n_chunks + chunk
    tl.store(stats + 2 * slot, m)
    tl.store(flag_ptr + 2 * slot, flag)
    if WITH_ARGMAX:
        tl.store(flag_ptr + 2 * slot + 1, tile_min(tl.where((x == m) & mask, col, INT32_MAX)))
    if WITH_SOFTMAX:
        # Online-softmax partial (Milakov and Gimelshein, arXiv:1805.02867): relative to this
        # chunk's max; the merge rescales by exp((m_c - m) / T).
        z = tile_sum(rel_weight(x, m, scale))
        tl.store(stats + 2 * slot + 1, tl.where(m == float("-inf"), 0.0, z))
    if WITH_GROUPS:
        tl.store(groups + row * n_chunks * NG + chunk * NG + tl.arange(0, NG), group_max)

    # Last program of the row: every thread's stores, then one release-acquire ticket.
    tl.debug_barrier()
    tickets = ws_ptr_of(ws_ptr, 0, tl.int32)
    if tl.atomic_add(tickets + row, 1, sem="acq_rel") != n_chunks - 1:
        return
    tl.store(tickets + row, 0)  # left at zero for the next call
    c = tl.arange(0, CB)
    cmask = c < n_chunks
    cslot = row * n_chunks + c
    m_c = tl.load(stats + 2 * cslot, mask=cmask, other=float("-inf"), cache_modifier=".cg")
    flags = tl.max(tl.load(flag_ptr + 2 * cslot, mask=cmask, other=0, cache_modifier=".cg"), axis=0)
    m = tl.max(m_c, axis=0)
    if WITH_ARGMAX:
        first = tl.load(flag_ptr + 2 * cslot + 1, mask=cmask, other=INT32_MAX, cache_modifier=".cg")
        greedy_token = tl.min(tl.where(cmask & (m_c == m), first, INT32_MAX), axis=0)
    else:
        greedy_token = flags * 0
    # Per-row tensor values are checked here, not on the host (that would cost a synchronisation):
    # a row whose parameter breaks its rule returns -1. The rules are params.py's, as comparisons
    # that NaN fails: temperature finite and >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1];
    # with random_val, random_val in [0, 1) and min_p 0.
    bad = (flags != 1) | ((t >= 0) & (t < float("inf")) == 0) | k_neg | ((p > 0) & (p <= 1) == 0)
    bad = bad | ((mp >= 0) & (mp <= 1) == 0)
    if RV_MODE:
        r = row_param(rv_arg, row, rv_stride, RV_TENSOR, tl.float32)
        bad = bad | ((r >= 0) & (r < 1) == 0) | (mp != 0)
    done = bad | (t == 0) | (k == 1)
    rowi = ws_ptr_of(ws_ptr, o_rowi, tl.int64)
    if done:
        tl.store(rowi + 2 * row, ROW_STATE_DONE)
        tl.store(out_ptr + row, tl.where(bad, -1, greedy_token).to(out_ptr.dtype.element_ty))
        return
    z = tl.full([], 0.0, m.dtype)
    if WITH_SOFTMAX:
        z_c = tl.load(stats + 2 * cslot + 1, mask=cmask, other=0.0, cache_modifier=".cg")
        z = tl.sum(z_c * rel_weight(m_c, m, scale), axis=0)
        rowf = ct_ptr_of(ws_ptr, o_rowf, IS_F64)
        tl.store(rowf + 2 * row, m)
        tl.store(rowf + 2 * row + 1, z)
    k_on = (k > 0) & (k < n_cols)
    # Without top_k the candidates decide the row only if their mass reaches top_p or min_p
    # rejects the bound; the group maxima at or above it are a lower bound of their mass.
    sure = k_on
    if WITH_GROUPS:
        # top_k within the gather's reach sets the bound; no top_k gathers the K_GATHER_DEFAULT
        # largest (enough for a peaked nucleus); a larger top_k skips the gather (count past CAP).
        # Empty groups of a partial last chunk hold -inf: they can only lower the bound.
        k_bound = tl.where(k_on & (k <= K_GATHER_MAX), k, K_GATHER_DEFAULT)
        n_groups = n_chunks * NG
        group_row = groups + row * n_groups
        bound = row_select_key(group_row, 1, n_groups, k_bound, m, scale, False, IS_F64, SELECT_BLOCK,
                               BOUND_ROUNDS, True)
        bound = tl.where(k_bound > n_groups, 0, bound)
        tl.store(rowi + 2 * row + 1, key_bits_to_i64(bound, IS_F64))
        tl.store(ws_ptr_of(ws_ptr, o_count, tl.int32) + row, tl.where(k_on & (k > K_GATHER_MAX), CAP + 1, 0))
        if k_on == 0:
            lower = tl.zeros([SELECT_BLOCK], m.dtype)
            for start in range(0, n_groups, SELECT_BLOCK):
                g = start + tl.arange(0, SELECT_BLOCK)
                gm = tl.load(group_row + g, mask=g < n_groups, other=float("-inf"), cache_modifier=".cg")
                lower += tl.where(order_key(gm, IS_F64) >= bound, rel_weight(gm, m, scale), 0.0)
            w_bound = rel_weight(key_value(bound, IS_F64), m, scale)
            sure = ((p < 1) & (tl.sum(lower, axis=0) >= p * z)) | ((mp > 0) & (w_bound < mp))
    tl.store(rowi + 2 * row, tl.where(sure, ROW_STATE_SAMPLE, ROW_STATE_PASS1).to(tl.int64))
