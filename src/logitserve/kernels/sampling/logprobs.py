"""Logprobs of sampled tokens: for each row the log-probability and rank of the chosen token, and
the top-n tokens (ties to the lower token id) with their log-probabilities.

``raw`` mode: the log-softmax of the logits as given (before processors, temperature and
filters), as vLLM's ``raw_logprobs``. A row whose token is -1 (invalid) gets a logprob of NaN
and rank 0; its top-n are computed all the same (NaN logits read as -inf).

Two launches after the draw (plain sampling never runs them). ``_lp_chunks`` (grid rows x
chunks, one read of the row at full bandwidth) reduces each chunk to its max, its softmax
partial ``sum(exp(x - max_c))`` (online softmax, Milakov and Gimelshein, arXiv:1805.02867), the
count of logits strictly above the chosen one, and the best token (largest value, then lowest
id) of each of its groups of ``GROUP`` tokens (``stats.py``'s strided groups: runs of 8 adjacent
tokens). ``_lp_merge`` (a program per row) combines them: ``log Z``, rank = 1 + the counts, and
the top-n. Those lie in the n groups whose best tokens come first: a group holding a top-n
token ``t`` has a best token at or before ``t``, and n groups ranked before it would hold n
tokens before ``t``. So the merge selects n groups among the row's bests, reads their
``n * GROUP`` logits again (a few KiB a row) and selects the top-n there, n rounds each.
Selecting the top-n in each chunk instead costs n full-chunk reductions a chunk: 205 us for
the issue-26 batch on an H100, against a read of the row's 45.

Chunk widths depend on V alone (:func:`chunk_width`), so a row's sums do not change with the
batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._backend import launchable, resolve_backend
from .params import LOGPROBS_MODES, MAX_LOGPROBS
from .stats import chunk_tile, tile_sum
from .weights import to_compute

INT32_MAX = tl.constexpr(2147483647)
GROUP = tl.constexpr(128)  # tokens a group: the merge reads n groups of a row again


def chunk_width(n_cols: int) -> int:
    """Columns a ``_lp_chunks`` program reads: about V / 16, a power of two in [256, 4096]. 4096
    (16 KiB of float32, 16 values a thread of 8 warps) at vocabularies of 64K and more: 32 chunks
    of 32 groups a row of 128256, enough programs to fill an H100 from 8 rows up. Smaller
    vocabularies still get several chunks."""
    return max(256, min(4096, triton.next_power_of_2(triton.cdiv(n_cols, 16))))


@triton.jit
def _group_cols(best, CH: tl.constexpr, NG: tl.constexpr):
    """The columns of the group holding token ``best [NP]``, ``[NP, GROUP]`` (chunk_tile's order)."""
    q = tl.arange(0, GROUP)
    base = best // CH * CH + (best % CH) // 8 % NG * 8
    return base[:, None] + ((q // 8) * (8 * NG) + q % 8)[None, :]


@launchable
@triton.jit(do_not_specialize=["n_cols", "n_chunks"])
def _lp_chunks(part_ptr, above_ptr, gv_ptr, gi_ptr, tok_ptr, x_ptr, x_rs, x_cs, n_cols, n_chunks,
               WITH_TOP: tl.constexpr, CH: tl.constexpr, NG: tl.constexpr, IS_F64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = x_ptr + row * x_rs
    tok = tl.load(tok_ptr + row).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < n_cols)
    xc = to_compute(tl.load(x_row + tl.where(tok_ok, tok, 0) * x_cs), IS_F64)
    xc = tl.where(xc != xc, float("-inf"), xc)
    col, mask = chunk_tile(chunk, n_cols, CH, NG)
    x = to_compute(tl.load(x_row + col.to(tl.int64) * x_cs, mask=mask, other=float("-inf")), IS_F64)
    x = tl.where(x != x, float("-inf"), x)  # NaN reads as -inf (the reference's rule)
    group_max = tl.max(tl.max(x, axis=2), axis=0)
    m = tl.max(group_max, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    slot = row * n_chunks + chunk
    tl.store(part_ptr + 2 * slot, m)
    tl.store(part_ptr + 2 * slot + 1, tile_sum(tl.exp(x - safe)))
    tl.store(above_ptr + slot, tile_sum((x > xc).to(tl.int32)))
    if WITH_TOP:
        # Each group's best token: its max, first id (INT32_MAX for a group past the row's end).
        first = tl.where((x == group_max[None, :, None]) & mask, col, INT32_MAX)
        g = slot * NG + tl.arange(0, NG)
        tl.store(gv_ptr + g, group_max)
        tl.store(gi_ptr + g, tl.min(tl.min(first, axis=2), axis=0))


@triton.jit
def _take_best(v, i, taken):
    """The largest ``v`` not taken, then the lowest id ``i`` among equals: (value, id)."""
    best_v = tl.max(tl.where(taken, float("-inf"), v), axis=0)
    return best_v, tl.min(tl.where((v == best_v) & (taken == 0), i, INT32_MAX), axis=0)


@launchable
@triton.jit(do_not_specialize=["n_cols", "n_chunks"])
def _lp_merge(lp_ptr, rank_ptr, top_i_ptr, top_lp_ptr, tok_ptr, x_ptr, x_rs, x_cs, n_cols, n_chunks, part_ptr,
              above_ptr, gv_ptr, gi_ptr, N: tl.constexpr, NP: tl.constexpr, CB: tl.constexpr, GB: tl.constexpr,
              CH: tl.constexpr, NG: tl.constexpr, IS_F64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_rs
    c = tl.arange(0, CB)
    cm = c < n_chunks
    slot = row * n_chunks + c
    m_c = tl.load(part_ptr + 2 * slot, mask=cm, other=float("-inf"))
    s_c = tl.load(part_ptr + 2 * slot + 1, mask=cm, other=0.0)
    m = tl.max(m_c, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    log_z = safe + tl.log(tl.sum(s_c * tl.exp(m_c - safe), axis=0))
    tok = tl.load(tok_ptr + row).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < n_cols)
    xc = to_compute(tl.load(x_row + tl.where(tok_ok, tok, 0) * x_cs), IS_F64)
    xc = tl.where(xc != xc, float("-inf"), xc)
    tl.store(lp_ptr + row, tl.where(tok_ok, xc - log_z, float("nan")).to(tl.float32))
    above = tl.sum(tl.load(above_ptr + slot, mask=cm, other=0), axis=0)
    tl.store(rank_ptr + row, tl.where(tok_ok, above + 1, 0).to(tl.int64))
    if N > 0:
        # The n groups whose best tokens come first (ids are unique: INT32_MAX only past the row).
        k = tl.arange(0, GB)
        km = k < n_chunks * NG
        gv = tl.load(gv_ptr + row * n_chunks * NG + k, mask=km, other=float("-inf"))
        gi = tl.load(gi_ptr + row * n_chunks * NG + k, mask=km, other=INT32_MAX)
        taken = k < 0
        lanes = tl.arange(0, NP)
        chosen = tl.full([NP], INT32_MAX, tl.int32)
        for j in tl.static_range(N):
            v, i = _take_best(gv, gi, taken)
            taken = taken | (gi == i)
            chosen = tl.where(lanes == j, i, chosen)
        # Their logits, and the top-n among them.
        cols = _group_cols(tl.where(chosen < INT32_MAX, chosen, 0), CH, NG)
        ok = (chosen < INT32_MAX)[:, None] & (cols < n_cols)
        x = to_compute(tl.load(x_row + cols.to(tl.int64) * x_cs, mask=ok, other=float("-inf")), IS_F64)
        x = tl.where(x != x, float("-inf"), x)
        ids = tl.where(ok, cols, INT32_MAX)
        taken = ids < 0
        for j in tl.static_range(N):
            v = tl.max(tl.max(tl.where(taken, float("-inf"), x), axis=1), axis=0)
            i = tl.min(tl.min(tl.where((x == v) & (taken == 0), ids, INT32_MAX), axis=1), axis=0)
            taken = taken | (ids == i)
            tl.store(top_i_ptr + row * N + j, tl.where(i < n_cols, i, -1).to(tl.int64))
            tl.store(top_lp_ptr + row * N + j, (v - log_z).to(tl.float32))


@dataclass
class Logprobs:
    """Per row: ``token_logprobs`` float32 [B], ``token_ranks`` int64 [B] (1 = most probable),
    ``top_token_ids`` int64 [B, n], ``top_logprobs`` float32 [B, n] (descending, ties to the
    lower id; where n passes the vocabulary, the places past it id -1 and -inf)."""

    token_logprobs: torch.Tensor | None = None
    token_ranks: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # With return_kept: the tokens the filters kept, int32 [B, ceil(V / 32)] (xgrammar's layout).
    kept_bitmask: torch.Tensor | None = None


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[B, V]`` as int32 ``[B, ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32``."""
    n_rows, n_cols = mask.shape
    words = (n_cols + 31) // 32
    padded = torch.zeros((n_rows, words * 32), dtype=torch.int64, device=mask.device)
    padded[:, :n_cols] = mask.to(torch.int64)
    packed = (padded.view(n_rows, words, 32) << torch.arange(32, device=mask.device)).sum(2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def check_logprobs(n, mode: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"logprobs must be an int or None, got {type(n).__name__}")
    if not 0 <= n <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {n}")
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int = 0, *, mode: str = "raw",
             backend: str = "auto") -> Logprobs:
    """Logprobs of ``token_ids [B]`` under ``logits [B, V]`` and the top-``n`` (``n <= 20``).

    Parameters
    ----------
    logits : torch.Tensor
        ``(batch_size, vocab_size)``, any float dtype (float64 computes in float64).
    token_ids : torch.Tensor
        ``(batch_size,)`` int32 / int64, as ``sample`` returns them (-1: invalid row).
    n : int
        Top tokens a row, in [0, 20].
    mode : ``"raw"``
        The log-softmax of the logits as given (``sample``'s ``processed`` mode passes the
        processed, scaled and filtered logits here).

    Returns
    -------
    Logprobs
    """
    check_logprobs(n, mode)
    if mode != "raw":
        raise ValueError(f"logprobs(): mode must be 'raw' (sample(..., logprobs_mode='processed') computes the "
                         f"processed logits first), got {mode!r}")
    n_rows, n_cols = logits.shape
    dev = logits.device
    out = Logprobs(torch.empty(n_rows, dtype=torch.float32, device=dev),
                   torch.empty(n_rows, dtype=torch.int64, device=dev),
                   torch.empty((n_rows, n), dtype=torch.int64, device=dev),
                   torch.empty((n_rows, n), dtype=torch.float32, device=dev))
    backend = resolve_backend(backend, dev)
    if n_rows == 0:
        return out
    if backend == "torch":
        from ..reference.logprobs import logprobs as reference
        ref = reference(logits, token_ids, n)
        return Logprobs(ref[0].to(torch.float32), ref[1], ref[2], ref[3].to(torch.float32))
    is_f64 = logits.dtype == torch.float64
    ct = torch.float64 if is_f64 else torch.float32
    ch = chunk_width(n_cols)
    ng = ch // GROUP.value
    n_chunks = triton.cdiv(n_cols, ch)
    part = torch.empty((n_rows, n_chunks, 2), dtype=ct, device=dev)
    above = torch.empty((n_rows, n_chunks), dtype=torch.int32, device=dev)
    groups = (n_rows, n_chunks * ng) if n else (1,)
    gv = torch.empty(groups, dtype=ct, device=dev)
    gi = torch.empty(groups, dtype=torch.int32, device=dev)
    args = (token_ids, logits, *logits.stride(), n_cols, n_chunks)
    _lp_chunks.for_backend(backend)[(n_rows, n_chunks)](part, above, gv, gi, *args, WITH_TOP=n > 0, CH=ch, NG=ng,
                                                       IS_F64=is_f64, num_warps=8)
    _lp_merge.for_backend(backend)[(n_rows,)](
        out.token_logprobs, out.token_ranks, out.top_token_ids, out.top_logprobs, *args, part, above, gv, gi, N=n,
        NP=triton.next_power_of_2(max(n, 1)), CB=triton.next_power_of_2(n_chunks),
        GB=triton.next_power_of_2(n_chunks * ng), CH=ch, NG=ng, IS_F64=is_f64, num_warps=4)
    return out
