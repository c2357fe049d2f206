"""top_p: the walk that draws from the nucleus without finding its threshold.

Every filter keeps the tokens at or above a value (ties with the boundary included), so the
kept set is ``{key >= t_k} & {key >= t_p} & {w >= min_p}`` where ``w = p / max(p)``. The draw
is the exponential race ``argmax w_i / E_i`` (in logs: ``log2 w_i + gumbel_i``) over that set,
with no need to find ``t_p`` (:func:`walk`):

  best = the winner over ``{key >= t_k}``; while the mass strictly above best reaches
  ``top_p`` of the reference mass, best was outside the nucleus, and so was everything at or
  below it: the next best is the winner over ``{key > best}``.

A check costs a pass of sums only; a rejection (probability about 1 - top_p) a pass with the
noise (:func:`_walk_pass`). The passes run over the row's candidate list when that list provably
holds every token the answer depends on (``draw.py``), else over the whole row.

On a whole row, the first two passes are spread over the row's chunks where the merge marked
the row ROW_STATE_PASS1 (no top_k in reach; ``stats.py``):

- the first pass, the winner over every token, by the gather launch (:func:`first_pass_chunk`
  per chunk, merged by :func:`pass1_winner` in the row's draw program);
- with top_p, the first check, the mass strictly above that winner, by a launch of its own
  between the gather and the draw (:func:`_check`, grid rows x groups of ``per_program``
  chunks), which otherwise would be a pass of one program over the whole row, the longest step
  of a one-row call on a large vocabulary. A chunk a program for a few rows (the latency case); for many, a
  few chunks a program keep the grid near ``CHECK_PROGRAMS`` (``plan.py``), since in a batch
  with top_k most programs leave at once. The terms are ``_walk_pass``'s, summed in chunks of a
  width that depends on the vocabulary alone, so a row's sum does not change with its batch.

min_p has no pass of its own: it is the ``w >= min_p`` condition of the race's scores here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._backend import launchable
from .noise import gumbel, uniform_bits
from .stats import INT32_MAX, row_param, tile_max, tile_min
from .top_k import key_bits_to_i64, key_from_i64, order_key
from .weights import log2_weight, to_compute
from .workspace import CAP, ROW_STATE_PASS1, ct_ptr_of, ws_offsets, ws_ptr_of


@triton.jit
def _walk_pass(x_ptr, x_stride, idx_ptr, n, lo, m, scale, min_p, k0, k1, WITH_BEST: tl.constexpr,
               CANDIDATES: tl.constexpr, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """Over tokens with key >= lo: (their mass, winner index, winner key); a winner needs w >= min_p.

    Each lane keeps its own running sum and best, so a block costs no reduction. Candidate lists
    were written by other programs of this launch: read them past L1 (``.cg``).
    """
    lanes = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], m.dtype)
    if WITH_BEST:
        best_s = tl.full([BLOCK], float("-inf"), m.dtype)
        best_i = tl.full([BLOCK], INT32_MAX, tl.int32)
        best_k = lo + lanes.to(lo.dtype) * 0
    for start in range(0, n, BLOCK):
        offs = start + lanes
        mask = offs < n
        if CANDIDATES:
            x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            idx = tl.load(idx_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        else:
            x = tl.load(x_ptr + offs.to(tl.int64) * x_stride, mask=mask, other=float("-inf"))
            idx = offs
        x = to_compute(x, IS_F64)
        key = order_key(x, IS_F64)
        inside = mask & (key >= lo)
        d = log2_weight(x, m, scale)
        w = tl.exp2(d)
        mass += tl.where(inside, w, 0.0)
        if WITH_BEST:
            g = gumbel(uniform_bits(idx, k0, k1)).to(m.dtype)
            score = tl.where(inside & (w >= min_p), d + g, float("-inf"))
            better = (score > best_s) | ((score == best_s) & (idx < best_i))
            best_s = tl.where(better, score, best_s)
            best_i = tl.where(better, idx, best_i)
            best_k = tl.where(better, key, best_k)
    if WITH_BEST:
        top = tl.max(best_s, axis=0)
        winner = tl.min(tl.where(best_s == top, best_i, INT32_MAX), axis=0)
        winner_key = tl.max(tl.where((best_s == top) & (best_i == winner), best_k, lo * 0), axis=0)
    else:
        winner = tl.sum(lanes * 0, axis=0)
        winner_key = lo
    return tl.sum(mass, axis=0), winner, winner_key


@triton.jit
def _source_pass(use_cand, cx_ptr, ci_ptr, count, x_row_ptr, x_col_stride, n_cols, lo, m, scale, min_p, k0, k1,
                 WITH_BEST: tl.constexpr, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """``_walk_pass`` over the candidate list (``use_cand``) or over the whole row."""
    if use_cand:
        mass, winner, winner_key = _walk_pass(cx_ptr, 1, ci_ptr, count, lo, m, scale, min_p, k0, k1, WITH_BEST, True,
                                              IS_F64, CAP)
    else:
        mass, winner, winner_key = _walk_pass(x_row_ptr, x_col_stride, ci_ptr, n_cols, lo, m, scale, min_p, k0, k1,
                                              WITH_BEST, False, IS_F64, BLOCK)
    return mass, winner, winner_key


@triton.jit
def walk(winner, winner_key, first_checked, checked_above, p, z_ref, use_cand, cx, ci, count, x_row, x_col_stride,
         n_cols, m, scale, min_p, k0, k1, IS_F64: tl.constexpr, BLOCK: tl.constexpr):
    """The drawn token: top_p's walk from ``winner``, the race's winner over ``{key >= t_k}``.

    While the mass strictly above the winner reaches ``p`` of ``z_ref``, the winner is outside
    the nucleus, and so is everything at or below it: the next is the winner over ``{key >
    winner_key}``. ``first_checked``: the first check's mass is ``checked_above`` (summed by the
    check launch). The passes run over the candidate list (``use_cand``) or the whole row.
    """
    searching = p < 1
    while searching:
        if first_checked != 0:
            above = checked_above
        else:
            above, unused, unused_key = _source_pass(use_cand, cx, ci, count, x_row, x_col_stride, n_cols,
                                                     winner_key + 1, m, scale, min_p, k0, k1, False, IS_F64, BLOCK)
        first_checked = first_checked * 0
        searching = above >= p * z_ref
        if searching:
            above, winner, winner_key = _source_pass(use_cand, cx, ci, count, x_row, x_col_stride, n_cols,
                                                     winner_key + 1, m, scale, min_p, k0, k1, True, IS_F64, BLOCK)
    return winner


@triton.jit
def first_pass_chunk(ws_ptr, x, key, col, mask, slot, m, scale, min_p, k0, k1, o_p1s, o_p1i, IS_F64: tl.constexpr):
    """The walk's first pass over one chunk's tile (the gather launch runs it for ROW_STATE_PASS1
    rows): the race ``log2(w) + gumbel`` among the tokens min_p keeps; its winner (score, index,
    key) is stored at ``slot`` for :func:`pass1_winner`. The scores are :func:`_walk_pass`'s."""
    d = log2_weight(x, m, scale)
    g = gumbel(uniform_bits(col, k0, k1)).to(m.dtype)
    score = tl.where(mask & (tl.exp2(d) >= min_p), d + g, float("-inf"))
    top = tile_max(score)
    winner = tile_min(tl.where(score == top, col, INT32_MAX))
    winner_key = tile_max(tl.where(col == winner, key, key * 0))
    tl.store(ct_ptr_of(ws_ptr, o_p1s, IS_F64) + slot, top)
    tl.store(ws_ptr_of(ws_ptr, o_p1i, tl.int64) + 2 * slot, winner.to(tl.int64))
    tl.store(ws_ptr_of(ws_ptr, o_p1i, tl.int64) + 2 * slot + 1, key_bits_to_i64(winner_key, IS_F64))


@triton.jit
def pass1_winner(ws_ptr, row, n_chunks, o_p1s, o_p1i, IS_F64: tl.constexpr, CB: tl.constexpr):
    """The row's first-pass winner (index, key) from its chunks' winners: lowest index on equal scores."""
    c = tl.arange(0, CB)
    slot = row * n_chunks + c
    cmask = c < n_chunks
    score = tl.load(ct_ptr_of(ws_ptr, o_p1s, IS_F64) + slot, mask=cmask, other=float("-inf"))
    index = tl.load(ws_ptr_of(ws_ptr, o_p1i, tl.int64) + 2 * slot, mask=cmask, other=INT32_MAX)
    keys = key_from_i64(tl.load(ws_ptr_of(ws_ptr, o_p1i, tl.int64) + 2 * slot + 1, mask=cmask, other=0), IS_F64)
    top = tl.max(score, axis=0)
    winner = tl.min(tl.where(score == top, index, INT32_MAX), axis=0).to(tl.int32)
    return winner, tl.max(tl.where(index == winner, keys, keys * 0), axis=0)


@launchable
@triton.jit(do_not_specialize=["t_stride", "p_stride", "n_rows", "per_program"])
def _check(ws_ptr, x_ptr, x_row_stride, x_col_stride, t_arg, t_stride, p_arg, p_stride, n_rows, n_cols, per_program,
           T_TENSOR: tl.constexpr, P_TENSOR: tl.constexpr, IS_F64: tl.constexpr, CH: tl.constexpr,
           NG: tl.constexpr, CB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_chunks = tl.cdiv(n_cols, CH)
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts = ws_offsets(
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
    parts = ct_ptr_of(ws_ptr, o_parts, IS_F64) + row * n_chunks
    for j in range(0, per_program):
        chunk = tl.program_id(1) * per_program + j
        cols = chunk * CH + tl.arange(0, CH)
        mask = cols < n_cols
        x = to_compute(tl.load(x_ptr + row * x_row_stride + cols.to(tl.int64) * x_col_stride, mask=mask,
                               other=float("-inf")), IS_F64)
        inside = mask & (order_key(x, IS_F64) >= winner_key + 1)
        part = tl.sum(tl.where(inside, tl.exp2(log2_weight(x, m, scale)), 0.0), axis=0)
        tl.store(parts + chunk, part, mask=chunk < n_chunks)
