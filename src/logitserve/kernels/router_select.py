"""Row-wise top-n selection for the router kernels, on int32 keys held in registers.

A key is a float32 made order-preserving (:func:`ordered_bits`). Two ways to take the ``n``
largest keys of each row of a ``[ROWS, W]`` tile, ties to the lower index:

- :func:`exact_rounds`: ``n`` rounds of (the largest key, then the lowest index holding it):
  two warp reductions a round, exact for any keys.
- :func:`packed_rounds`: the key's low ``IDX_BITS`` bits replaced by the reversed index, so keys
  are distinct and one reduction a round finds both the value and the index. Exact when those
  bits carry no information (a 16-bit logit's float32 bits); otherwise it also reports, per
  row, whether the result is provably the exact one (every pick's high bits strictly above the
  next pick's, the (n+1)-th included), and the caller redoes the rows where it is not.

Both return ``picks [ROWS, BLOCK_N]`` (index of the r-th largest in column r) and the keys with
the picked ones set to ``MARK``. Reductions over int32 are one ``redux.sync`` a warp on sm_80+;
the int64 keys these replace cost about ten instructions a compare.
"""

from __future__ import annotations

import triton
import triton.language as tl

MARK = tl.constexpr(-(2 ** 31))      # picked: below every key
DROP = tl.constexpr(-(2 ** 31) + 1)  # out of the race (padding, dropped groups): below every real key


@triton.jit
def ordered_bits(v):
    # float32 -> int32 with the floats' order: negatives get their magnitude bits flipped; + 0.0
    # first turns -0.0 into +0.0. -inf maps to -2**31 + 0x7FFFFF, above MARK and DROP.
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def has_nan(v):
    # Per row of a [ROWS, W] float32 tile: any NaN (either sign), by the magnitude bits.
    return tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1) > 0x7F800000


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _top2(a1, a2, b1, b2):
    # The two largest of a multiset, merged: (max, max(min of the maxima, max of the seconds)).
    # NaN-propagating, so a group with a NaN scores NaN and its row is caught as a NaN row.
    return _max_nan(a1, b1), _max_nan(tl.minimum(a1, b1, propagate_nan=tl.PropagateNan.ALL), _max_nan(a2, b2))


@triton.jit
def group_scores(c, TOP2: tl.constexpr):
    # [ROWS, GROUPS, BLOCK_G] biased scores (-inf where no expert) -> [ROWS, GROUPS]: the sum of
    # each group's two largest, or its largest. One pass over the group either way.
    if TOP2:
        first, second = tl.reduce((c, tl.full(c.shape, float("-inf"), tl.float32)), 2, _top2)
        return first + second
    else:
        return tl.reduce(c, 2, _max_nan)


@triton.jit
def exact_rounds(key, index, N: tl.constexpr, BLOCK_N: tl.constexpr, BIG: tl.constexpr):
    # key [ROWS, W]; index [1, W] (distinct, < BIG): the order of ties.
    slot = tl.arange(0, BLOCK_N)[None, :]
    picks = tl.zeros([key.shape[0], BLOCK_N], tl.int32)
    for r in tl.static_range(N):
        best = tl.max(key, axis=1)
        first = tl.min(tl.where(key == best[:, None], index, BIG), axis=1)
        picks = tl.where(slot == r, first[:, None], picks)
        key = tl.where(index == first[:, None], MARK, key)
    return picks, key


@triton.jit
def packed_rounds(key, N: tl.constexpr, BLOCK_N: tl.constexpr, IDX_BITS: tl.constexpr, CHECK: tl.constexpr):
    # key [ROWS, W]: candidates distinct, their low IDX_BITS bits the reversed index. Returns
    # (picks, key, exact): exact[row] is True where the picks equal exact_rounds' on the full
    # keys (always, without CHECK). A row's high bits strictly decreasing from pick to pick and
    # on to the best key left means every pick beats all keys after it by its high bits alone,
    # which no lost low bit can overturn; equal high bits (ties, near-ties) fail the check.
    slot = tl.arange(0, BLOCK_N)[None, :]
    picks = tl.zeros([key.shape[0], BLOCK_N], tl.int32)
    exact = tl.full([key.shape[0]], 1, tl.int1)
    prev = tl.full([key.shape[0]], 0, tl.int32)
    for r in tl.static_range(N):
        best = tl.max(key, axis=1)
        if CHECK and r > 0:
            exact = exact & ((best >> IDX_BITS) < (prev >> IDX_BITS))
        picks = tl.where(slot == r, ((1 << IDX_BITS) - 1 - (best & ((1 << IDX_BITS) - 1)))[:, None], picks)
        key = tl.where(key == best[:, None], MARK, key)
        prev = best
    if CHECK:
        exact = exact & ((tl.max(key, axis=1) >> IDX_BITS) < (prev >> IDX_BITS))
    return picks, key, exact


def index_bits(n: int) -> int:
    """Bits that hold an index below ``n`` (at least 1)."""
    return max(1, (n - 1).bit_length())

