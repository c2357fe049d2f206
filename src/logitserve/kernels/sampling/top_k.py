"""Top-k: order keys and radix selection (the k-th largest value; by mass, a cumulative threshold).

A float maps to an unsigned integer key of its width that sorts like the float (the radix-sort
trick: flip every bit of a negative, set the sign bit of a positive; -0.0 is first made +0.0 so
that equal floats get equal keys). Selection then builds the answer key four bits at a time from
the top: the largest key ``K`` with ``count(key >= K) >= k`` is the k-th largest key, and the
largest with ``mass(key >= K) >= target`` is where a descending cumulative mass reaches the
target. Each round tests the 16 next digits at once, so 8 rounds settle a float32 key and 16 a
float64 one, in registers (``*_in_block``) or by passes over a row (``row_select_key``).

Where it is used: top_k's threshold ``t_k`` (the draw, ``top_p.py``), the merge's candidate
bound ``L`` (the k-th largest group max, ``stats.py``), and ``random_val`` mode's threshold by
mass (``random_val.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .weights import rel_weight, to_compute


@triton.jit
def order_key(x, IS_F64: tl.constexpr):
    """Unsigned key that orders like ``x`` (x has no NaN; -0.0 and +0.0 share a key)."""
    x = tl.where(x == 0, 0.0, x).to(x.dtype)
    if IS_F64:
        b = x.to(tl.uint64, bitcast=True)
        return tl.where((b >> 63) == 1, ~b, b | 0x8000000000000000)
    else:
        b = x.to(tl.uint32, bitcast=True)
        return tl.where((b >> 31) == 1, ~b, b | 0x80000000)


@triton.jit
def key_value(key, IS_F64: tl.constexpr):
    """The float a key came from (inverse of ``order_key``)."""
    if IS_F64:
        b = tl.where(key < 0x8000000000000000, ~key, key ^ 0x8000000000000000)
        return b.to(tl.float64, bitcast=True)
    else:
        b = tl.where(key < 0x80000000, ~key, key ^ 0x80000000)
        return b.to(tl.float32, bitcast=True)


@triton.jit
def key_bits_to_i64(key, IS_F64: tl.constexpr):
    """A key stored in an int64 slot of the workspace (bit pattern kept)."""
    if IS_F64:
        return key.to(tl.int64, bitcast=True)
    else:
        return key.to(tl.int64)


@triton.jit
def key_from_i64(v, IS_F64: tl.constexpr):
    if IS_F64:
        return v.to(tl.uint64, bitcast=True)
    else:
        return v.to(tl.uint32)


@triton.jit
def _digits(KEY_BITS: tl.constexpr):
    if KEY_BITS == 64:
        return tl.arange(0, 16).to(tl.uint64)
    else:
        return tl.arange(0, 16).to(tl.uint32)


@triton.jit
def _next_digit(acc, target):
    """Largest digit d whose total ``acc[d]`` still reaches ``target`` (acc falls as d grows); 0 if none."""
    return tl.maximum(tl.sum((acc >= target).to(tl.int32), axis=0) - 1, 0)


@triton.jit
def select_key_in_block(keys, weights, valid, target, WEIGHTED: tl.constexpr, KEY_BITS: tl.constexpr,
                        ROUNDS: tl.constexpr):
    """Largest key K with count (or weight sum) of valid keys >= K reaching ``target``, in registers.

    With fewer than KEY_BITS / 4 rounds the low bits stay 0: a key at most the exact answer.
    """
    digits = _digits(KEY_BITS)
    answer = tl.max(digits, axis=0) * 0
    for r in tl.static_range(ROUNDS):
        cand = answer | (digits << (KEY_BITS - 4 * (r + 1)))
        ge = (keys[:, None] >= cand[None, :]) & valid[:, None]
        if WEIGHTED:
            acc = tl.sum(tl.where(ge, weights[:, None], 0.0), axis=0)
        else:
            acc = tl.sum(ge.to(tl.int32), axis=0)
        answer = answer | (_next_digit(acc, target).to(answer.dtype) << (KEY_BITS - 4 * (r + 1)))
    return answer


@triton.jit
def row_select_key(x_ptr, x_stride, n, target, m, scale, WEIGHTED: tl.constexpr, IS_F64: tl.constexpr,
                   BLOCK: tl.constexpr, ROUNDS: tl.constexpr = 0, FROM_WORKSPACE: tl.constexpr = False):
    """``select_key_in_block`` over ``n`` values in memory, one pass per round (all rounds if 0).

    ``FROM_WORKSPACE``: the values were written by other programs of this launch (read past L1).
    """
    KEY_BITS: tl.constexpr = 64 if IS_F64 else 32
    N_ROUNDS: tl.constexpr = KEY_BITS // 4 if ROUNDS == 0 else ROUNDS
    digits = _digits(KEY_BITS)
    answer = tl.max(digits, axis=0) * 0
    for r in tl.static_range(N_ROUNDS):
        cand = answer | (digits << (KEY_BITS - 4 * (r + 1)))
        if WEIGHTED:
            acc = tl.zeros([16], m.dtype)
        else:
            acc = tl.zeros([16], tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            if FROM_WORKSPACE:
                x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            else:
                x = tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf"))
            x = to_compute(x, IS_F64)
            ge = (order_key(x, IS_F64)[:, None] >= cand[None, :]) & mask[:, None]
            if WEIGHTED:
                acc += tl.sum(tl.where(ge, rel_weight(x, m, scale)[:, None], 0.0), axis=0)
            else:
                acc += tl.sum(ge.to(tl.int32), axis=0)
        answer = answer | (_next_digit(acc, target).to(answer.dtype) << (KEY_BITS - 4 * (r + 1)))
    return answer
