"""The two launches of the logits processors (``processors.py`` states the semantics and calls them).

``_dense`` (grid rows x column blocks) is the part whose cost is the vocabulary: ``y = x``
(float32), grammar-masked, or -inf everywhere where an allowed list is given; it also zeroes the
row's flag words (below) for its block. A block is a ``[WORDS, 32]`` tile, one grammar word a
line, so the mask is one load of ``WORDS`` words. It moves ``4V`` bytes read (float32 logits)
and ``4V`` written a row, at copy bandwidth.

``_lists`` (a program per row) touches only the tokens of the row's lists, O(length of the
lists), in phases separated by barriers (``__syncthreads``, which also orders the block's
global memory accesses):

1. the allowed tokens get their logits back (grammar permitting);
2. flags: each prompt token sets its ``P`` bit; each output token that is not masked
   (``y != -inf``) sets its ``O`` bit with ``atomic_or``, and the one lane that finds the bit
   clear (the old word says so) turns the token's ``y`` slot into an int32 count, 0;
3. every output token whose ``O`` bit is set adds 1 to that count (``atomic_add``);
4. each token of the bias, output and prompt lists is written once, by the lane that sets its
   ``T`` bit first: its final value from the original logit ``x``, the count and the flags, with
   the bias summed over the bias list in list order (the bias lanes claim first, behind a
   barrier of their own, so that only they sum biases). A token masked by ``_dense`` or phase 1
   (its ``y`` -inf, no ``O`` bit) stays -inf whatever its bias;
5. banned tokens, and stop tokens while the output is shorter than ``min_tokens``: -inf.

The atomics are relaxed (``acq_rel``, Triton's default, fences each one: measured 101 us for
the issue-26 batch on an H100): the barriers order the phases, and reads of what atomics wrote
go to L2 (``.cg``). Every float is computed once per token from the original logit, in one
order (no float atomics), so the result does not depend on which lane won a race, nor on the
batch. Ids outside ``[0, V)`` are skipped; a row's span of a list is clamped into
``[0, len(ids)]``, so no offsets make a read go out of bounds.

The flags are 4 bits a token of an int32 workspace ``[B, 4 ceil(V / 32)]`` (``O``, ``P``, ``T``
in one word, so the ``T`` claim's atomic returns the token's ``O`` and ``P`` too): 16 bytes per
32 tokens, 6% of the dense pass's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable

# A token's flags: 4 bits of one int32 word (word t // 8, bits from 4 (t % 8)), so that every
# flag access of a token touches one 32-byte sector. Separate bit arrays, a sector each, made
# the list kernel 76 us on the H100 (40% of DRAM bandwidth in scattered sectors).
FLAG_O = tl.constexpr(1)  # an output token, not masked: counted
FLAG_P = tl.constexpr(2)  # a prompt token
FLAG_T = tl.constexpr(4)  # its final value is written
FLAG_WORDS_PER_GRAMMAR_WORD = tl.constexpr(4)

# A list table (``TABLE`` mode of ``_lists``): one int64 row a batch row, each list held by
# address: (address, length) of the prompt, the output, the bias ids, then the bias values'
# address (float32), (address, length) of the banned and the stop tokens, min_tokens, and the
# output's capacity (the ids its buffer has room for: ``_append``). Addresses are the list
# owner's to keep valid (a server's sequences: server/sequences/lists.py).
COL_PROMPT = tl.constexpr(0)
COL_OUTPUT = tl.constexpr(2)
COL_BIAS = tl.constexpr(4)
COL_BIAS_VALUES = tl.constexpr(6)
COL_BANNED = tl.constexpr(7)
COL_STOP = tl.constexpr(9)
COL_MIN_TOKENS = tl.constexpr(11)
COL_OUTPUT_CAPACITY = tl.constexpr(12)
TABLE_COLUMNS = tl.constexpr(13)


@launchable
@triton.jit(do_not_specialize=["n_cols", "g_words"])
def _dense(y_ptr, x_ptr, x_rs, x_cs, n_cols, g_ptr, g_words, flags_ptr,
           HAS_ALLOWED: tl.constexpr, HAS_GRAMMAR: tl.constexpr, HAS_FLAGS: tl.constexpr, WORDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    word = tl.program_id(1) * WORDS + tl.arange(0, WORDS).to(tl.int64)
    wmask = word < g_words
    col = word[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = col < n_cols
    if HAS_ALLOWED:
        x = tl.full([WORDS, 32], float("-inf"), tl.float32)
    else:
        x = tl.load(x_ptr + row * x_rs + col * x_cs, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_GRAMMAR:
            g = tl.load(g_ptr + row * g_words + word, mask=wmask, other=0)
            x = tl.where(((g[:, None] >> tl.arange(0, 32)[None, :]) & 1) != 0, x, float("-inf"))
    tl.store(y_ptr + row * n_cols + col, x, mask=mask)
    if HAS_FLAGS:
        F: tl.constexpr = FLAG_WORDS_PER_GRAMMAR_WORD
        fw = tl.program_id(1) * (WORDS * F) + tl.arange(0, WORDS * F).to(tl.int64)
        tl.store(flags_ptr + row * g_words * F + fw, tl.zeros([WORDS * F], tl.int32), mask=fw < g_words * F)


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
    """Tokens ``ids[s:s + TB]`` below ``hi`` as (token, flag word, flag shift, lane valid);
    invalid lanes (past ``hi``, or an id outside ``[0, n_cols)``) read token 0."""
    j = s + tl.arange(0, TB)
    t = tl.load(ids_ptr + j, mask=j < hi, other=-1).to(tl.int64)
    ok = (j < hi) & (t >= 0) & (t < n_cols)
    t = tl.where(ok, t, 0)
    return t, t // 8, (t % 8).to(tl.int32) * 4, ok


@triton.jit
def _bit(sh, FLAG: tl.constexpr):
    """The flag's bit in the words of tokens with flag shifts ``sh``."""
    return tl.full(sh.shape, FLAG, tl.int32) << sh


@triton.jit
def _has(flags_row, word, bit, ok):
    # .cg: read at L2, where the atomics wrote (no stale L1 line).
    return (tl.load(flags_row + word, mask=ok, other=0, cache_modifier=".cg") & bit) != 0


@triton.jit
def _final(y_row, x_row, x_cs, t, sh, w, flags, rep, freq, pres, bias,
           HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, WITH_BIAS: tl.constexpr):
    """Store the final value of tokens ``t`` on the writing lanes ``w`` (``flags``: their flag
    words): penalties, then ``bias``, from the original logit; -inf where masked (the bias
    cannot bring a masked token back)."""
    # Masked: y still -inf. (An output token that is not masked holds its count there, phases
    # 2-3: a small positive int, whose bits never read as -inf.)
    masked = tl.load(y_row + t, mask=w, other=float("-inf"), cache_modifier=".cg") == float("-inf")
    v = tl.load(x_row + t * x_cs, mask=w, other=0.0).to(tl.float32)
    if HAS_OUTPUT:
        in_out = ((flags >> sh) & FLAG_O) != 0
        count = tl.load(y_row.to(tl.pointer_type(tl.int32)) + t, mask=w & in_out, other=0, cache_modifier=".cg")
        seen = in_out
        if HAS_PROMPT:
            seen = seen | (((flags >> sh) & FLAG_P) != 0)
        v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
        v = v - freq * count.to(tl.float32) - tl.where(count > 0, pres, 0.0)
    elif HAS_PROMPT:
        v = tl.where(((flags >> sh) & FLAG_P) != 0, tl.where(v > 0, v / rep, v * rep), v)
    if WITH_BIAS:
        v = v + bias
    tl.store(y_row + t, tl.where(masked, float("-inf"), v), mask=w)


@triton.jit
def _write_list(y_row, x_row, x_cs, n_cols, ids, lo, hi, f_row, rep, freq, pres,
                HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, TB: tl.constexpr):
    """Phase 4 for a list without biases (its bias tokens were written already): the lane that
    sets a token's T flag writes it, reading its O and P flags in the word the atomic returns."""
    for s in range(lo, hi, TB):
        t, word, sh, ok = _tile(ids, s, hi, n_cols, TB)
        old = tl.atomic_or(f_row + word, _bit(sh, FLAG_T), mask=ok, sem="relaxed")
        w = ok & (((old >> sh) & FLAG_T) == 0)
        _final(y_row, x_row, x_cs, t, sh, w, old, rep, freq, pres, 0.0, HAS_PROMPT, HAS_OUTPUT, False)


@triton.jit
def _listed(tab_row, COL: tl.constexpr):
    """A list held by address (a list table's row, ``TABLE`` mode): its int64 ids and length."""
    return tl.load(tab_row + COL).to(tl.pointer_type(tl.int64)), tl.load(tab_row + COL + 1)


@launchable
@triton.jit(do_not_specialize=["n_cols", "g_words", "p_n", "o_n", "b_n", "a_n", "n_n", "s_n"])
def _lists(y_ptr, x_ptr, x_rs, x_cs, n_cols, flags_ptr, g_ptr, g_words, rep_ptr, freq_ptr, pres_ptr,
           p_ids, p_off, p_n, o_ids, o_off, o_n, b_ids, b_vals, b_off, b_n, a_ids, a_off, a_n, n_ids, n_off, n_n,
           s_ids, s_off, s_n, mt_ptr, tab_ptr,
           HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_ALLOWED: tl.constexpr, HAS_BANNED: tl.constexpr, HAS_MIN_TOKENS: tl.constexpr,
           HAS_GRAMMAR: tl.constexpr, TABLE: tl.constexpr, TB: tl.constexpr, BT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_rs
    y_row = y_ptr + row * n_cols
    f_row = flags_ptr + row * g_words * FLAG_WORDS_PER_GRAMMAR_WORD
    # Each list's ids and span: ragged (ids, offsets), or with TABLE by address from the row of
    # the list table (every list but the allowed one, which a table does not hold).
    tab_row = tab_ptr + row * TABLE_COLUMNS
    if HAS_PROMPT:
        if TABLE:
            p_ids, p_hi = _listed(tab_row, COL_PROMPT)
            p_lo = p_hi * 0
        else:
            p_lo, p_hi = _span(p_off, row, p_n)
    if HAS_OUTPUT or HAS_MIN_TOKENS:
        if TABLE:
            o_ids, o_hi = _listed(tab_row, COL_OUTPUT)
            o_lo = o_hi * 0
        else:
            o_lo, o_hi = _span(o_off, row, o_n)
    if HAS_BIAS:
        if TABLE:
            b_ids, b_hi = _listed(tab_row, COL_BIAS)
            b_vals = tl.load(tab_row + COL_BIAS_VALUES).to(tl.pointer_type(tl.float32))
            b_lo = b_hi * 0
        else:
            b_lo, b_hi = _span(b_off, row, b_n)
    if HAS_BANNED:
        if TABLE:
            n_ids, n_hi = _listed(tab_row, COL_BANNED)
            n_lo = n_hi * 0
        else:
            n_lo, n_hi = _span(n_off, row, n_n)
    if HAS_MIN_TOKENS:
        if TABLE:
            s_ids, s_hi = _listed(tab_row, COL_STOP)
            s_lo = s_hi * 0
            min_len = tl.load(tab_row + COL_MIN_TOKENS)
        else:
            s_lo, s_hi = _span(s_off, row, s_n)
            min_len = tl.load(mt_ptr + row).to(tl.int64)
    # (1) The allowed tokens back, where the grammar allows them too.
    if HAS_ALLOWED:
        a_lo, a_hi = _span(a_off, row, a_n)
        for s in range(a_lo, a_hi, TB):
            t, word, sh, ok = _tile(a_ids, s, a_hi, n_cols, TB)
            x = tl.load(x_row + t * x_cs, mask=ok, other=float("-inf")).to(tl.float32)
            if HAS_GRAMMAR:
                g = tl.load(g_ptr + row * g_words + t // 32, mask=ok, other=0)
                x = tl.where(((g >> (t % 32).to(tl.int32)) & 1) != 0, x, float("-inf"))
            tl.store(y_row + t, x, mask=ok)
        tl.debug_barrier()
    if HAS_PROMPT or HAS_OUTPUT or HAS_BIAS:
        rep = tl.load(rep_ptr + row)
        freq = tl.load(freq_ptr + row)
        pres = tl.load(pres_ptr + row)
        # (2) Flags; an output token's first lane turns its y slot into a count.
        if HAS_PROMPT:
            for s in range(p_lo, p_hi, TB):
                t, word, sh, ok = _tile(p_ids, s, p_hi, n_cols, TB)
                tl.atomic_or(f_row + word, _bit(sh, FLAG_P), mask=ok, sem="relaxed")
        if HAS_OUTPUT:
            y_int = y_row.to(tl.pointer_type(tl.int32))
            for s in range(o_lo, o_hi, TB):
                t, word, sh, ok = _tile(o_ids, s, o_hi, n_cols, TB)
                # A lane that reads the first lane's 0 (not -inf) agrees that the token is live.
                live = ok & (tl.load(y_row + t, mask=ok, other=float("-inf")) != float("-inf"))
                old = tl.atomic_or(f_row + word, _bit(sh, FLAG_O), mask=live, sem="relaxed")
                tl.store(y_int + t, tl.zeros([TB], tl.int32), mask=live & (((old >> sh) & FLAG_O) == 0))
            tl.debug_barrier()
            # (3) The counts.
            for s in range(o_lo, o_hi, TB):
                t, word, sh, ok = _tile(o_ids, s, o_hi, n_cols, TB)
                tl.atomic_add(y_int + t, tl.full([TB], 1, tl.int32), mask=_has(f_row, word, _bit(sh, FLAG_O), ok),
                              sem="relaxed")
        tl.debug_barrier()
        # (4) Final values: the bias tokens first, their biases summed in list order.
        if HAS_BIAS:
            for s in range(b_lo, b_hi, BT):
                t, word, sh, ok = _tile(b_ids, s, b_hi, n_cols, BT)
                old = tl.atomic_or(f_row + word, _bit(sh, FLAG_T), mask=ok, sem="relaxed")
                w = ok & (((old >> sh) & FLAG_T) == 0)
                bias = tl.zeros([BT], tl.float32)
                for s2 in range(b_lo, b_hi, BT):
                    j = s2 + tl.arange(0, BT)
                    jm = j < b_hi
                    b = tl.load(b_ids + j, mask=jm, other=-1).to(tl.int64)
                    bv = tl.load(b_vals + j, mask=jm, other=0.0).to(tl.float32)
                    bias += tl.sum(tl.where((t[:, None] == b[None, :]) & jm[None, :], bv[None, :], 0.0), axis=1)
                _final(y_row, x_row, x_cs, t, sh, w, old, rep, freq, pres, bias, HAS_PROMPT, HAS_OUTPUT, True)
            tl.debug_barrier()
        if HAS_OUTPUT:
            _write_list(y_row, x_row, x_cs, n_cols, o_ids, o_lo, o_hi, f_row, rep, freq, pres, HAS_PROMPT,
                        HAS_OUTPUT, TB)
        if HAS_PROMPT:
            _write_list(y_row, x_row, x_cs, n_cols, p_ids, p_lo, p_hi, f_row, rep, freq, pres, HAS_PROMPT,
                        HAS_OUTPUT, TB)
        tl.debug_barrier()
    # (5) Banned tokens, and stop tokens while the output is shorter than min_tokens.
    if HAS_BANNED:
        for s in range(n_lo, n_hi, TB):
            t, word, sh, ok = _tile(n_ids, s, n_hi, n_cols, TB)
            tl.store(y_row + t, tl.full([TB], float("-inf"), tl.float32), mask=ok)
    if HAS_MIN_TOKENS:
        out_len = o_hi - o_lo
        for s in range(s_lo, s_hi, TB):
            t, word, sh, ok = _tile(s_ids, s, s_hi, n_cols, TB)
            tl.store(y_row + t, tl.full([TB], float("-inf"), tl.float32), mask=ok & (t * 0 + out_len < min_len))


@launchable
@triton.jit
def _append(tab_ptr, tokens_ptr, n_rows, BLOCK: tl.constexpr):
    """Each row's drawn token (when one was drawn: >= 0) appended to its output list in a list
    table (``TABLE`` mode): stored after the output's ``length`` ids, where the row's capacity
    leaves room. The table itself is the caller's to advance."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = rows < n_rows
    tab = tab_ptr + rows * TABLE_COLUMNS
    token = tl.load(tokens_ptr + rows, mask=live, other=-1).to(tl.int64)
    length = tl.load(tab + COL_OUTPUT + 1, mask=live, other=0)
    room = tl.load(tab + COL_OUTPUT_CAPACITY, mask=live, other=0)
    ids = tl.load(tab + COL_OUTPUT, mask=live, other=0).to(tl.pointer_type(tl.int64))
    tl.store(ids + length, token, mask=live & (token >= 0) & (length < room))
