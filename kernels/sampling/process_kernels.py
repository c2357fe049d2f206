"""The two launches of the logits processors (``processors.py`` states the semantics and calls them).

``_lists`` (a program per row) runs first and touches only the tokens of the row's lists,
O(length of the lists): it writes their final values into ``y`` and marks them done. Then
``_dense`` (grid rows x column blocks), the part whose cost is the vocabulary, writes every
other token: ``x`` (float32) where the grammar (and the allowed list, by its flag) allows it,
else -inf. A ``_dense`` block is a ``[WORDS, 32]`` tile, one flag or grammar word a line. In this
order the list kernel's scattered reads and writes (a 32-byte sector each) stay in L2, a few
MiB a batch; run after the dense pass, whose 8 bytes a logit stream L2 out, they went to DRAM:
79 us for the issue-26 batch on an H100.

``_lists`` runs in phases separated by barriers (``__syncthreads``, which also orders the
block's global memory accesses). A token is *masked* when the grammar or the allowed list
excludes it:

1. each allowed token sets its ``A`` bit (``atomic_or``);
2. each prompt token sets its ``P`` bit; each output token that is not masked and whose logit is
   not -inf sets its ``O`` bit, and the one lane that finds the bit clear (the old word says so)
   turns the token's ``y`` slot into an int32 count, 0;
3. every output token whose ``O`` bit is set adds 1 to that count (``atomic_add``);
4. each token of the bias, output and prompt lists is written once, by the lane that sets its
   ``T`` bit first: its final value from the original logit ``x``, the count and the flags, with
   the bias summed over the bias list in list order (the bias lanes claim first, behind a
   barrier of their own, so that only they sum biases); -inf where masked, whatever its bias;
5. banned tokens, and stop tokens while the output is shorter than ``min_tokens``: -inf, and
   their ``T`` bits set.

``_dense`` leaves the tokens whose ``T`` bit is set as they are.

The atomics are relaxed (``acq_rel``, Triton's default, fences each one: measured 101 us for
the issue-26 batch on an H100): the barriers order the phases, and reads of what atomics wrote
go to L2 (``.cg``). Every float is computed once per token from the original logit, in one
order (no float atomics), so the result does not depend on which lane won a race, nor on the
batch. Ids outside ``[0, V)`` are skipped; a row's span of a list is clamped into
``[0, len(ids)]``, so no offsets make a read go out of bounds.

The flags are bits of a zero-filled int32 workspace ``[B, 4, ceil(V / 32)]`` (``O``, ``P``,
``T``, ``A``): 16 bytes per 32 tokens, 6% of the dense pass's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable

# Flag arrays of the workspace, in this order a row: O (output token, counted), P (prompt token),
# T (final value written by _lists), A (allowed token).
N_FLAGS = tl.constexpr(4)


@launchable
@triton.jit(do_not_specialize=["n_cols", "g_words"])
def _dense(y_ptr, x_ptr, x_rs, x_cs, n_cols, g_ptr, g_words, flags_ptr,
           HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr, HAS_FLAGS: tl.constexpr, WORDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1) * WORDS + tl.arange(0, WORDS).to(tl.int64)
    wmask = word < g_words
    col = word[:, None] * 32 + tl.arange(0, 32)[None, :]
    lane = tl.arange(0, 32)[None, :]
    mask = col < n_cols
    keep = mask
    if HAS_GRAMMAR:
        g = tl.load(g_ptr + row * g_words + word, mask=wmask, other=0)
        keep = keep & (((g[:, None] >> lane) & 1) != 0)
    write = mask
    if HAS_FLAGS:
        flags = flags_ptr + row * N_FLAGS * g_words + word
        write = write & (((tl.load(flags + 2 * g_words, mask=wmask, other=0)[:, None] >> lane) & 1) == 0)
        if HAS_ALLOWED:
            keep = keep & (((tl.load(flags + 3 * g_words, mask=wmask, other=0)[:, None] >> lane) & 1) != 0)
    # Only the kept logits are read: under an allowed list, a few sectors of the row.
    x = tl.load(x_ptr + row * x_rs + col * x_cs, mask=keep & write, other=float("-inf")).to(tl.float32)
    tl.store(y_ptr + row * n_cols + col, x, mask=write)


@triton.jit
def _span(off_ptr, row, n_ids):
    """The row's span of a ragged list, clamped into ``[0, n_ids]``: offsets on CUDA are not
    checked on the host (that would cost a synchronisation), and no value may read past the ids."""
    lo = tl.load(off_ptr + row).to(tl.int64)
    hi = tl.load(off_ptr + row + 1).to(tl.int64)
    lo = tl.minimum(tl.maximum(lo, 0), n_ids)
    return lo, tl.minimum(tl.maximum(hi, lo), n_ids)


@triton.jit
def _tile(ids_ptr, s, hi, n_cols, TB: tl.constexpr):
    """Tokens ``ids[s:s + TB]`` below ``hi`` as (token, word, bit, lane valid); invalid lanes
    (past ``hi``, or an id outside ``[0, n_cols)``) read token 0."""
    j = s + tl.arange(0, TB)
    t = tl.load(ids_ptr + j, mask=j < hi, other=-1).to(tl.int64)
    ok = (j < hi) & (t >= 0) & (t < n_cols)
    t = tl.where(ok, t, 0)
    return t, t // 32, tl.full([TB], 1, tl.int32) << (t % 32).to(tl.int32), ok


@triton.jit
def _has(bits_ptr, word, bit, ok):
    # .cg: read at L2, where the atomics wrote (no stale L1 line).
    return (tl.load(bits_ptr + word, mask=ok, other=0, cache_modifier=".cg") & bit) != 0


@triton.jit
def _claim(bits_ptr, word, bit, ok):
    """Set the bits; true on the one lane per token that found its bit clear."""
    old = tl.atomic_or(bits_ptr + word, bit, mask=ok, sem="relaxed")
    return ok & ((old & bit) == 0)


@triton.jit
def _allowed(g_row, a_flags, word, bit, ok, HAS_GRAMMAR: tl.constexpr, HAS_ALLOWED: tl.constexpr):
    """Not masked: allowed by the grammar (when given) and by the allowed list (when given)."""
    keep = ok
    if HAS_GRAMMAR:
        keep = keep & _has(g_row, word, bit, ok)
    if HAS_ALLOWED:
        keep = keep & _has(a_flags, word, bit, ok)
    return keep


@triton.jit
def _final(y_row, x_row, x_cs, t, word, bit, w, o_flags, p_flags, keep, rep, freq, pres, bias,
           HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, WITH_BIAS: tl.constexpr):
    """Store the final value of tokens ``t`` on the writing lanes ``w``: penalties, then ``bias``,
    from the original logit; -inf where not ``keep`` (masked), whatever the bias."""
    v = tl.load(x_row + t * x_cs, mask=w, other=0.0).to(tl.float32)
    if HAS_OUTPUT:
        in_out = _has(o_flags, word, bit, w)
        # A counted output token holds its count in its y slot (phases 2-3).
        count = tl.load(y_row.to(tl.pointer_type(tl.int32)) + t, mask=w & in_out, other=0, cache_modifier=".cg")
        seen = in_out
        if HAS_PROMPT:
            seen = seen | _has(p_flags, word, bit, w)
        v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
        v = v - freq * count.to(tl.float32) - tl.where(count > 0, pres, 0.0)
    elif HAS_PROMPT:
        v = tl.where(_has(p_flags, word, bit, w), tl.where(v > 0, v / rep, v * rep), v)
    if WITH_BIAS:
        v = v + bias
    tl.store(y_row + t, tl.where(keep, v, float("-inf")), mask=w)


@triton.jit
def _write_list(y_row, x_row, x_cs, n_cols, ids, lo, hi, o_flags, p_flags, t_flags, a_flags, g_row, rep, freq, pres,
                HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, HAS_GRAMMAR: tl.constexpr,
                HAS_ALLOWED: tl.constexpr, TB: tl.constexpr):
    """Phase 4 for a list without biases (its bias tokens were written already)."""
    for s in range(lo, hi, TB):
        t, word, bit, ok = _tile(ids, s, hi, n_cols, TB)
        w = _claim(t_flags, word, bit, ok)
        keep = _allowed(g_row, a_flags, word, bit, w, HAS_GRAMMAR, HAS_ALLOWED)
        _final(y_row, x_row, x_cs, t, word, bit, w, o_flags, p_flags, keep, rep, freq, pres, 0.0, HAS_PROMPT,
               HAS_OUTPUT, False)


@triton.jit
def _mask_list(y_row, t_flags, n_cols, ids, lo, hi, length, min_length, TB: tl.constexpr):
    """Phase 5: -inf for the list's tokens if ``length < min_length``, marked done for ``_dense``."""
    for s in range(lo, hi, TB):
        t, word, bit, ok = _tile(ids, s, hi, n_cols, TB)
        ok = ok & (t * 0 + length < min_length)
        tl.store(y_row + t, tl.full([TB], float("-inf"), tl.float32), mask=ok)
        tl.atomic_or(t_flags + word, bit, mask=ok, sem="relaxed")


@launchable
@triton.jit(do_not_specialize=["n_cols", "g_words", "p_n", "o_n", "b_n", "a_n", "n_n", "s_n"])
def _lists(y_ptr, x_ptr, x_rs, x_cs, n_cols, flags_ptr, g_ptr, g_words, rep_ptr, freq_ptr, pres_ptr,
           p_ids, p_off, p_n, o_ids, o_off, o_n, b_ids, b_vals, b_off, b_n, a_ids, a_off, a_n, n_ids, n_off, n_n,
           s_ids, s_off, s_n, mt_ptr,
           HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_ALLOWED: tl.constexpr, HAS_BANNED: tl.constexpr, HAS_MIN_TOKENS: tl.constexpr,
           HAS_GRAMMAR: tl.constexpr, TB: tl.constexpr, BT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_rs
    y_row = y_ptr + row * n_cols
    g_row = g_ptr + row * g_words
    o_flags = flags_ptr + row * N_FLAGS * g_words
    p_flags = o_flags + g_words
    t_flags = p_flags + g_words
    a_flags = t_flags + g_words
    # (1) The allowed list's flags.
    if HAS_ALLOWED:
        a_lo, a_hi = _span(a_off, row, a_n)
        for s in range(a_lo, a_hi, TB):
            t, word, bit, ok = _tile(a_ids, s, a_hi, n_cols, TB)
            tl.atomic_or(a_flags + word, bit, mask=ok, sem="relaxed")
        tl.debug_barrier()
    if HAS_PROMPT or HAS_OUTPUT or HAS_BIAS:
        rep = tl.load(rep_ptr + row)
        freq = tl.load(freq_ptr + row)
        pres = tl.load(pres_ptr + row)
        # (2) Flags; an output token's first lane turns its y slot into a count.
        if HAS_PROMPT:
            p_lo, p_hi = _span(p_off, row, p_n)
            for s in range(p_lo, p_hi, TB):
                t, word, bit, ok = _tile(p_ids, s, p_hi, n_cols, TB)
                tl.atomic_or(p_flags + word, bit, mask=ok, sem="relaxed")
        if HAS_OUTPUT:
            y_int = y_row.to(tl.pointer_type(tl.int32))
            o_lo, o_hi = _span(o_off, row, o_n)
            for s in range(o_lo, o_hi, TB):
                t, word, bit, ok = _tile(o_ids, s, o_hi, n_cols, TB)
                # A masked or -inf token's value is -inf whatever its count: it is not counted.
                live = _allowed(g_row, a_flags, word, bit, ok, HAS_GRAMMAR, HAS_ALLOWED)
                live = live & (tl.load(x_row + t * x_cs, mask=live, other=float("-inf")) != float("-inf"))
                tl.store(y_int + t, tl.zeros([TB], tl.int32), mask=_claim(o_flags, word, bit, live))
            tl.debug_barrier()
            # (3) The counts.
            for s in range(o_lo, o_hi, TB):
                t, word, bit, ok = _tile(o_ids, s, o_hi, n_cols, TB)
                tl.atomic_add(y_int + t, tl.full([TB], 1, tl.int32), mask=_has(o_flags, word, bit, ok),
                              sem="relaxed")
        tl.debug_barrier()
        # (4) Final values: the bias tokens first, their biases summed in list order.
        if HAS_BIAS:
            b_lo, b_hi = _span(b_off, row, b_n)
            for s in range(b_lo, b_hi, BT):
                t, word, bit, ok = _tile(b_ids, s, b_hi, n_cols, BT)
                w = _claim(t_flags, word, bit, ok)
                bias = tl.zeros([BT], tl.float32)
                for s2 in range(b_lo, b_hi, BT):
                    j = s2 + tl.arange(0, BT)
                    jm = j < b_hi
                    b = tl.load(b_ids + j, mask=jm, other=-1).to(tl.int64)
                    bv = tl.load(b_vals + j, mask=jm, other=0.0).to(tl.float32)
                    bias += tl.sum(tl.where((t[:, None] == b[None, :]) & jm[None, :], bv[None, :], 0.0), axis=1)
                keep = _allowed(g_row, a_flags, word, bit, w, HAS_GRAMMAR, HAS_ALLOWED)
                _final(y_row, x_row, x_cs, t, word, bit, w, o_flags, p_flags, keep, rep, freq, pres, bias,
                       HAS_PROMPT, HAS_OUTPUT, True)
            tl.debug_barrier()
        if HAS_OUTPUT:
            o_lo, o_hi = _span(o_off, row, o_n)
            _write_list(y_row, x_row, x_cs, n_cols, o_ids, o_lo, o_hi, o_flags, p_flags, t_flags, a_flags, g_row,
                        rep, freq, pres, HAS_PROMPT, HAS_OUTPUT, HAS_GRAMMAR, HAS_ALLOWED, TB)
        if HAS_PROMPT:
            p_lo, p_hi = _span(p_off, row, p_n)
            _write_list(y_row, x_row, x_cs, n_cols, p_ids, p_lo, p_hi, o_flags, p_flags, t_flags, a_flags, g_row,
                        rep, freq, pres, HAS_PROMPT, HAS_OUTPUT, HAS_GRAMMAR, HAS_ALLOWED, TB)
        tl.debug_barrier()
    # (5) Banned tokens, and stop tokens while the output is shorter than min_tokens.
    if HAS_BANNED:
        n_lo, n_hi = _span(n_off, row, n_n)
        _mask_list(y_row, t_flags, n_cols, n_ids, n_lo, n_hi, 0, 1, TB)
    if HAS_MIN_TOKENS:
        out_lo, out_hi = _span(o_off, row, o_n)
        s_lo, s_hi = _span(s_off, row, s_n)
        _mask_list(y_row, t_flags, n_cols, s_ids, s_lo, s_hi, out_hi - out_lo, tl.load(mt_ptr + row).to(tl.int64), TB)
