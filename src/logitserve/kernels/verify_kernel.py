"""The Triton kernels of ``verify`` (chain speculative sampling): the kept set, then the walk and the draw.

``verify`` reads the target logits ``[B, n + 1, V]`` as ``B (n + 1)`` rows of ``sample``'s
pipeline (``sampling/stats.py``: max, softmax total, greedy token, validity, and with filters the
candidate bound and list of ``sampling/gather.py``), then two launches of its own:

- ``_thresholds`` (a program per target row, only with filters): the kept set of the row, as
  the order key ``t = max(t_k, t_p)`` every kept token reaches and the kept mass ``Z`` of the
  tokens with ``key >= t`` and ``w >= min_p`` (``w = p / max(p)``, ``sampling/weights.py``). A
  row's filtered probability is then ``p(v) = w_v / Z`` on that set. ``t_k`` is the k-th largest
  key and ``t_p`` the largest key whose mass at or above it reaches ``top_p`` of the reference
  mass (the top-k set's for ``top_k_first``, the row's for ``joint``): the token that crosses
  the threshold is kept, ties with it too, as ``sample`` keeps them. Both come by radix
  selection (``sampling/top_k.py``) over the candidate list where it holds every kept token
  (top_k within its reach, or the list's mass reaching top_p, or min_p rejecting its bound),
  else over the row.
- ``_verify_draw`` (grid batch rows x chunks of the vocabulary): each program first walks its
  row's draft (the ``n`` positions at once, a lane each: a few gathers): position ``i`` accepts
  ``d_i`` when ``u_i * q_i(d_i) < p_i(d_i)`` (probability ``min(1, p / q)``; Leviathan et al.,
  arXiv:2211.17192; Chen et al., arXiv:2302.01318), greedy rows while ``d_i`` is the arg-max.
  At the first rejection ``a`` (``a = n``: all accepted) the emitted token is the exponential
  race ``argmax_v log2(r_v) + gumbel_v`` over ``r = max(0, p_a - q_a)`` (``r = p_n`` for the
  bonus), which draws in proportion to ``r`` without normalising it; each program races its
  chunk, and the row's last program (an atomic ticket, as ``stats.py``'s merge) picks the winner
  and writes the row. Should ``r`` be all zero (``p == q`` in float rounding) the race over
  ``p_a`` decides. Greedy and invalid rows need no race: chunk 0 writes them.

The uniforms ``u_i`` hash position ``i`` under the row's ``(seed, step)`` keys with
``ACCEPT_MIX`` folded into the second; the race uses ``sample``'s noise for ``(seed, step)``
(``sampling/noise.py``). ``reference/verify.py`` is the torch twin.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._backend import launchable
from .sampling.noise import fmix32, gumbel, row_keys, u64_halves, uniform, uniform_bits
from .sampling.stats import INT32_MAX, row_params
from .sampling.top_k import key_bits_to_i64, key_from_i64, key_value, order_key, row_select_key, select_key_in_block
from .sampling.weights import log2_weight, rel_weight, to_compute
from .sampling.workspace import CAP, ROW_STATE_DONE, ct_ptr_of, ws_offsets, ws_ptr_of

# reference/verify.py holds the same constant.
ACCEPT_MIX = tl.constexpr(0x13198A2E)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _align16(n):
    return (n + 15) // 16 * 16


@triton.jit
def race_layout(rows, n_chunks, CT: tl.constexpr):
    """Byte offsets of the draw's workspace: int32 tickets ``[rows]`` at 0, then each chunk's two
    winners' scores (compute dtype, ``[rows, chunks, 2]``: residual race, fallback race) and
    their int32 indices; then the total size. ``CT``: bytes of the compute dtype."""
    o_scores = _align16(4 * rows)
    o_index = o_scores + _align16(CT * rows * n_chunks * 2)
    return o_scores, o_index, o_index + _align16(4 * rows * n_chunks * 2)


@triton.jit
def _kept_mass(x_ptr, x_stride, n, lo, m, scale, min_p, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of ``w`` over the tokens with ``key >= lo`` and ``w >= min_p``, one pass over ``n`` values."""
    acc = tl.zeros([BLOCK], m.dtype)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        x = to_compute(tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf")), IS_F64)
        w = rel_weight(x, m, scale)
        acc += tl.where(mask & (order_key(x, IS_F64) >= lo) & (w >= min_p), w, 0.0)
    return tl.sum(acc, axis=0)


@launchable
@triton.jit(do_not_specialize=["t_stride", "k_arg", "k_stride", "p_stride", "mp_stride", "n_rows"])
def _thresholds(kept_key_ptr, kept_mass_ptr, ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, k_arg,
                k_stride, p_arg, p_stride, mp_arg, mp_stride, n_rows, n_cols,
                T_TENSOR: tl.constexpr, K_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr,
                IS_F64: tl.constexpr, TOP_K_FIRST: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr,
                BLOCK: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
        n_rows, n_chunks, NG, IS_F64)
    rowi = ws_ptr_of(ws_ptr, o_rowi, tl.int64)
    if tl.load(rowi + 2 * row) == ROW_STATE_DONE:  # greedy or invalid: no kept set to find
        return
    t, k, p, min_p, k_neg = row_params(row, n_cols, t_arg, t_stride, k_arg, k_stride, p_arg, p_stride, mp_arg,
                                       mp_stride, T_TENSOR, K_TENSOR, P_TENSOR, MP_TENSOR)
    KEY_BITS: tl.constexpr = 64 if IS_F64 else 32
    rowf = ct_ptr_of(ws_ptr, o_rowf, IS_F64)
    m = tl.load(rowf + 2 * row)
    z = tl.load(rowf + 2 * row + 1)
    scale = LOG2E / t
    k_on = (k > 0) & (k < n_cols)
    bound = key_from_i64(tl.load(rowi + 2 * row + 1), IS_F64)
    t_key = bound * 0
    mass = z
    count = tl.load(ws_ptr_of(ws_ptr, o_count, tl.int32) + row, cache_modifier=".cg")
    # No filter on this row (per-row parameters): every token, the row's total.
    searching = k_on | (p < 1) | (min_p > 0)
    from_row = searching & (count > CAP)
    if searching & (count <= CAP):
        lanes = tl.arange(0, CAP)
        valid = lanes < count
        cx = to_compute(tl.load(ct_ptr_of(ws_ptr, o_cx, IS_F64) + row * CAP + lanes, mask=valid,
                                other=float("-inf"), cache_modifier=".cg"), IS_F64)
        keys = order_key(cx, IS_F64)
        w = tl.where(valid, rel_weight(cx, m, scale), 0.0)
        t_k = bound * 0
        if k_on:
            t_k = select_key_in_block(keys, keys, valid, k, False, KEY_BITS, KEY_BITS // 4)
        z_k = tl.sum(tl.where(keys >= t_k, w, 0.0), axis=0)
        if TOP_K_FIRST:
            target = p * tl.where(k_on, z_k, z)
        else:
            target = p * z
        t_p = bound * 0
        if p < 1:
            t_p = select_key_in_block(keys, w, valid, target, True, KEY_BITS, KEY_BITS // 4)
        t_key = tl.maximum(t_k, t_p)
        mass = tl.sum(tl.where((keys >= t_key) & (w >= min_p), w, 0.0), axis=0)
        # The list decides the kept set when every kept token is on it: top_k in its reach, the
        # whole row gathered, the list's mass reaching top_p, or min_p rejecting its bound.
        w_bound = rel_weight(key_value(bound, IS_F64), m, scale)
        from_row = ~(k_on | (count == n_cols) | ((p < 1) & (tl.sum(w, axis=0) >= target))
                     | ((min_p > 0) & (w_bound < min_p)))
    if from_row:
        x_row = x_ptr + row * x_row_stride
        t_k = bound * 0
        z_ref = z
        if k_on:
            t_k = row_select_key(x_row, x_col_stride, n_cols, k, m, scale, False, IS_F64, SELECT_BLOCK)
            if TOP_K_FIRST:
                z_ref = _kept_mass(x_row, x_col_stride, n_cols, t_k, m, scale, 0.0, IS_F64, BLOCK)
        t_p = bound * 0
        if p < 1:
            t_p = row_select_key(x_row, x_col_stride, n_cols, p * z_ref, m, scale, True, IS_F64, SELECT_BLOCK)
        t_key = tl.maximum(t_k, t_p)
        mass = _kept_mass(x_row, x_col_stride, n_cols, t_key, m, scale, min_p, IS_F64, BLOCK)
    tl.store(kept_key_ptr + row, key_bits_to_i64(t_key, IS_F64))
    tl.store(kept_mass_ptr + row, mass)


@triton.jit
def _at(v, lanes, a):
    """Lane ``a`` of vector ``v`` as a scalar."""
    return tl.sum(tl.where(lanes == a, v, v * 0), axis=0)


@triton.jit
def _lane_param(arg, rows, stride, mask, other, IS_TENSOR: tl.constexpr, dtype: tl.constexpr):
    """A per-row parameter at each of ``rows`` (masked lanes: ``other``), or the scalar itself."""
    if IS_TENSOR:
        return tl.load(arg + rows * stride, mask=mask, other=other).to(dtype)
    else:
        return tl.cast(arg, dtype)


@launchable
@triton.jit(do_not_specialize=["ids_row_stride", "ids_col_stride", "x_s0", "x_s1", "q_s0", "q_s1", "dt_arg",
                               "dt_stride", "t_stride", "mp_stride", "seed_arg", "seed_hi", "seed_stride",
                               "step_arg", "step_hi", "step_stride", "n_rows", "n_draft"])
def _verify_draw(tokens_ptr, accepted_ptr, valid_ptr, race_ptr, ws_ptr, greedy_ptr, kept_key_ptr, kept_mass_ptr,
                 ids_ptr, ids_row_stride, ids_col_stride, x_ptr, x_s0, x_s1, x_s2, q_ptr, q_s0, q_s1, q_s2,
                 d_ws_ptr, d_greedy_ptr, dt_arg, dt_stride, t_arg, t_stride, mp_arg, mp_stride,
                 seed_arg, seed_hi, seed_stride, step_arg, step_hi, step_stride, n_rows, n_draft, n_cols,
                 T_TENSOR: tl.constexpr, MP_TENSOR: tl.constexpr, DT_TENSOR: tl.constexpr,
                 SEED_TENSOR: tl.constexpr, STEP_TENSOR: tl.constexpr, IS_F64: tl.constexpr,
                 DRAFT_F64: tl.constexpr, FROM_LOGITS: tl.constexpr, FILTERED: tl.constexpr, CH: tl.constexpr,
                 NG: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
        n_rows * (n_draft + 1), n_chunks, NG, IS_F64)
    rowi = ws_ptr_of(ws_ptr, o_rowi, tl.int64)
    rowf = ct_ptr_of(ws_ptr, o_rowf, IS_F64)

    # The walk: lane i is position i (target row b (n + 1) + i, draft row b n + i).
    lanes = tl.arange(0, NB)
    on_target = lanes <= n_draft
    on_draft = lanes < n_draft
    r = b * (n_draft + 1) + lanes
    state = tl.load(rowi + 2 * r, mask=on_target, other=0)
    greedy_token = tl.load(greedy_ptr + r, mask=on_target, other=0)
    done = on_target & (state == ROW_STATE_DONE)
    bad = done & (greedy_token < 0)
    d = tl.load(ids_ptr + b * ids_row_stride + lanes * ids_col_stride, mask=on_draft, other=0).to(tl.int64)
    d_ok = (d >= 0) & (d < n_cols)
    bad = bad | (on_draft & ~d_ok)
    d = tl.where(on_draft & d_ok, d, 0)
    sampled = on_draft & ~done
    x_d = to_compute(tl.load(x_ptr + b * x_s0 + lanes * x_s1 + d * x_s2, mask=on_draft, other=0.0), IS_F64)
    m = tl.load(rowf + 2 * r, mask=on_target & ~done, other=0.0)
    t = _lane_param(t_arg, r, t_stride, on_target, 1.0, T_TENSOR, tl.float32)
    scale = LOG2E / tl.where(t > 0, t, 1.0)
    w_d = rel_weight(x_d, m, scale)
    if FILTERED:
        min_p = _lane_param(mp_arg, r, mp_stride, on_target, 0.0, MP_TENSOR, tl.float32)
        t_key = key_from_i64(tl.load(kept_key_ptr + r, mask=on_target & ~done, other=0), IS_F64)
        mass = tl.load(kept_mass_ptr + r, mask=on_target & ~done, other=1.0)
        kept_d = (order_key(x_d, IS_F64) >= t_key) & (w_d >= min_p)
    else:
        mass = tl.load(rowf + 2 * r + 1, mask=on_target & ~done, other=1.0)
        kept_d = w_d >= 0
    p_d = tl.where(kept_d, w_d / mass, 0.0)
    # The draft's probability of its token: given, or from its logits' statistics.
    s = b * n_draft + lanes
    if FROM_LOGITS:
        d_count, d_o_rowi, d_o_rowf, d_flags, d_stats, d_groups, d_cx, d_ci, d_p1s, d_p1i, d_parts = ws_offsets(
            n_rows * n_draft, n_chunks, NG, DRAFT_F64)
        d_rowi = ws_ptr_of(d_ws_ptr, d_o_rowi, tl.int64)
        d_rowf = ct_ptr_of(d_ws_ptr, d_o_rowf, DRAFT_F64)
        d_done = tl.load(d_rowi + 2 * s, mask=on_draft, other=0) == ROW_STATE_DONE
        d_token = tl.load(d_greedy_ptr + s, mask=on_draft, other=0)
        bad = bad | (on_draft & d_done & (d_token < 0))
        y_d = to_compute(tl.load(q_ptr + b * q_s0 + lanes * q_s1 + d * q_s2, mask=on_draft, other=0.0), IS_F64)
        dt = _lane_param(dt_arg, s, dt_stride, on_draft, 1.0, DT_TENSOR, tl.float32)
        dm = to_compute(tl.load(d_rowf + 2 * s, mask=on_draft & ~d_done, other=0.0), IS_F64)
        dz = to_compute(tl.load(d_rowf + 2 * s + 1, mask=on_draft & ~d_done, other=1.0), IS_F64)
        q_d = tl.where(d_done, (d == d_token).to(m.dtype), rel_weight(y_d, dm, LOG2E / tl.where(dt > 0, dt, 1.0)) / dz)
    else:
        q_d = to_compute(tl.load(q_ptr + b * q_s0 + lanes * q_s1 + d * q_s2, mask=on_draft, other=0.0), IS_F64)
    s_lo, s_hi = u64_halves(seed_arg, seed_hi, b, seed_stride, SEED_TENSOR)
    c_lo, c_hi = u64_halves(step_arg, step_hi, b, step_stride, STEP_TENSOR)
    k0, k1 = row_keys(s_lo, s_hi, c_lo, c_hi)
    u = uniform(uniform_bits(lanes, k0, fmix32(k1 ^ ACCEPT_MIX))).to(m.dtype)
    accept = tl.where(sampled, u * q_d < p_d, d == greedy_token)
    a = tl.min(tl.where(on_draft & ~accept, lanes, n_draft), axis=0)
    row_bad = tl.max(bad.to(tl.int32), axis=0) > 0
    greedy_at = _at(done.to(tl.int32), lanes, a) != 0

    out_row = tokens_ptr + b * (n_draft + 1) + lanes
    if row_bad | greedy_at:
        if chunk == 0:
            emitted = _at(greedy_token, lanes, a)
            tokens = tl.where(lanes < a, d, tl.where(lanes == a, emitted, -1))
            tl.store(out_row, tl.where(row_bad, -1, tokens), mask=on_target)
            tl.store(accepted_ptr + b, tl.where(row_bad, 0, a).to(tl.int64))
            tl.store(valid_ptr + b, (~row_bad).to(tl.int8))
        return

    # This chunk's part of the race at position a, over r = max(0, p_a - q_a) (p_n for the bonus).
    cols = chunk * CH + tl.arange(0, CH)
    cmask = cols < n_cols
    x = to_compute(tl.load(x_ptr + b * x_s0 + a * x_s1 + cols.to(tl.int64) * x_s2, mask=cmask,
                           other=float("-inf")), IS_F64)
    m_a, scale_a, mass_a = _at(m, lanes, a), _at(scale, lanes, a), _at(mass, lanes, a)
    log2_w = log2_weight(x, m_a, scale_a)
    w = tl.exp2(log2_w)
    kept = cmask & (w > 0)
    if FILTERED:
        kept = kept & (order_key(x, IS_F64) >= _at(t_key, lanes, a)) & (w >= _at(min_p, lanes, a))
    p = tl.where(kept, w / mass_a, 0.0)
    q = p * 0
    if a < n_draft:
        q_cols = q_ptr + b * q_s0 + a * q_s1 + cols.to(tl.int64) * q_s2
        if FROM_LOGITS:
            if _at(d_done.to(tl.int32), lanes, a) != 0:
                q = (cols == _at(d_token, lanes, a)).to(p.dtype)
            else:
                y = to_compute(tl.load(q_cols, mask=cmask, other=float("-inf")), IS_F64)
                q = rel_weight(y, _at(dm, lanes, a), LOG2E / _at(tl.where(dt > 0, dt, 1.0), lanes, a))
                q = q / _at(dz, lanes, a)
        else:
            q = to_compute(tl.load(q_cols, mask=cmask, other=0.0), IS_F64)
    residual = p - q
    g = gumbel(uniform_bits(cols, k0, k1)).to(p.dtype)
    positive = cmask & (residual > 0)
    score = tl.where(positive, tl.log2(tl.where(positive, residual, 1.0)) + g, float("-inf"))
    fallback = tl.where(kept, log2_w + g, float("-inf"))
    top = tl.max(score, axis=0)
    top_fb = tl.max(fallback, axis=0)
    CT: tl.constexpr = 8 if IS_F64 else 4
    o_scores, o_index, _ = race_layout(n_rows, n_chunks, CT)
    scores = ct_ptr_of(race_ptr, o_scores, IS_F64)
    index = ws_ptr_of(race_ptr, o_index, tl.int32)
    slot = 2 * (b * n_chunks + chunk)
    tl.store(scores + slot, top)
    tl.store(scores + slot + 1, top_fb)
    tl.store(index + slot, tl.min(tl.where(score == top, cols, INT32_MAX), axis=0))
    tl.store(index + slot + 1, tl.min(tl.where(fallback == top_fb, cols, INT32_MAX), axis=0))

    # The row's last program: every thread's stores, then one release-acquire ticket.
    tl.debug_barrier()
    tickets = ws_ptr_of(race_ptr, 0, tl.int32)
    if tl.atomic_add(tickets + b, 1, sem="acq_rel") != n_chunks - 1:
        return
    tl.store(tickets + b, 0)  # left at zero for the next call
    c = tl.arange(0, CB)
    cslot = 2 * (b * n_chunks + c)
    cmask2 = c < n_chunks
    s_all = tl.load(scores + cslot, mask=cmask2, other=float("-inf"), cache_modifier=".cg")
    fb_all = tl.load(scores + cslot + 1, mask=cmask2, other=float("-inf"), cache_modifier=".cg")
    i_all = tl.load(index + cslot, mask=cmask2, other=INT32_MAX, cache_modifier=".cg")
    ifb_all = tl.load(index + cslot + 1, mask=cmask2, other=INT32_MAX, cache_modifier=".cg")
    best = tl.max(s_all, axis=0)
    winner = tl.min(tl.where(s_all == best, i_all, INT32_MAX), axis=0)
    best_fb = tl.max(fb_all, axis=0)
    winner_fb = tl.min(tl.where(fb_all == best_fb, ifb_all, INT32_MAX), axis=0)
    emitted = tl.where(best == float("-inf"), winner_fb, winner).to(tl.int64)
    tokens = tl.where(lanes < a, d, tl.where(lanes == a, emitted, -1))
    tl.store(out_row, tokens, mask=on_target)
    tl.store(accepted_ptr + b, a.to(tl.int64))
    tl.store(valid_ptr + b, tl.full([], 1, tl.int8))
