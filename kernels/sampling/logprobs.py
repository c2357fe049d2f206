"""Logprobs of sampled tokens: for each row the log-probability and rank of the chosen token, and
the top-n tokens (ties to the lower token id) with their log-probabilities.

``raw`` mode: the log-softmax of the logits as given (before processors, temperature and
filters), as vLLM's ``raw_logprobs``. A row whose token is -1 (invalid) gets a logprob of NaN
and rank 0; its top-n are computed all the same (NaN logits read as -inf).

Two launches after the draw (plain sampling never runs them). ``_lp_chunks`` (grid rows x
chunks, one read of the row at full bandwidth) reduces each chunk to its max, its softmax
partial ``sum(exp(x - max_c))`` (online softmax, Milakov and Gimelshein, arXiv:1805.02867), the
count of logits strictly above the chosen one, and its own top-n (value descending, then lowest
id). ``_lp_merge`` (a program per row) combines them: ``log Z``, rank = 1 + the counts, and the
top-n among the chunks' top-n (every token of the row's top-n is in its chunk's). Chunk widths
depend on V alone (:func:`chunk_width`), so a row's sums do not change with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._backend import launchable, resolve_backend
from .params import LOGPROBS_MODES, MAX_LOGPROBS
from .weights import to_compute

INT32_MAX = tl.constexpr(2147483647)


def chunk_width(n_cols: int) -> int:
    """Columns a ``_lp_chunks`` program reads: about V / 16, a power of two in [256, 4096]. 4096
    (16 KiB of float32, 16 values a thread of 8 warps) at vocabularies of 64K and more: 32 chunks
    a row of 128256, enough programs to fill an H100 from 8 rows up; the merge's candidates are
    then 32 n. Smaller vocabularies still get several chunks."""
    return max(256, min(4096, triton.next_power_of_2(triton.cdiv(n_cols, 16))))


@launchable
@triton.jit(do_not_specialize=["n_cols", "n_chunks"])
def _lp_chunks(part_ptr, above_ptr, cv_ptr, ci_ptr, tok_ptr, x_ptr, x_rs, x_cs, n_cols, n_chunks,
               N: tl.constexpr, CH: tl.constexpr, IS_F64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = x_ptr + row * x_rs
    tok = tl.load(tok_ptr + row).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < n_cols)
    xc = to_compute(tl.load(x_row + tl.where(tok_ok, tok, 0) * x_cs), IS_F64)
    xc = tl.where(xc != xc, float("-inf"), xc)
    col = chunk * CH + tl.arange(0, CH)
    mask = col < n_cols
    x = to_compute(tl.load(x_row + col.to(tl.int64) * x_cs, mask=mask, other=float("-inf")), IS_F64)
    x = tl.where(x != x, float("-inf"), x)  # NaN reads as -inf (the reference's rule)
    m = tl.max(x, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)
    slot = row * n_chunks + chunk
    tl.store(part_ptr + 2 * slot, m)
    tl.store(part_ptr + 2 * slot + 1, tl.sum(tl.exp(x - safe), axis=0))
    tl.store(above_ptr + slot, tl.sum((x > xc).to(tl.int32), axis=0))
    # The chunk's top-n: each the largest (value, then lowest id) not taken yet; INT32_MAX where
    # the chunk has fewer than n columns.
    taken = col < 0
    for j in tl.static_range(N):
        v = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        i = tl.min(tl.where((x == v) & (taken == 0) & mask, col, INT32_MAX), axis=0)
        taken = taken | (col == i)
        tl.store(cv_ptr + slot * N + j, v)
        tl.store(ci_ptr + slot * N + j, i)


@launchable
@triton.jit(do_not_specialize=["n_cols", "n_chunks"])
def _lp_merge(lp_ptr, rank_ptr, top_i_ptr, top_lp_ptr, tok_ptr, x_ptr, x_rs, x_cs, n_cols, n_chunks, part_ptr,
              above_ptr, cv_ptr, ci_ptr, N: tl.constexpr, CB: tl.constexpr, NB: tl.constexpr,
              IS_F64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
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
    xc = to_compute(tl.load(x_ptr + row * x_rs + tl.where(tok_ok, tok, 0) * x_cs), IS_F64)
    xc = tl.where(xc != xc, float("-inf"), xc)
    tl.store(lp_ptr + row, tl.where(tok_ok, xc - log_z, float("nan")).to(tl.float32))
    above = tl.sum(tl.load(above_ptr + slot, mask=cm, other=0), axis=0)
    tl.store(rank_ptr + row, tl.where(tok_ok, above + 1, 0).to(tl.int64))
    if N > 0:
        k = tl.arange(0, NB)
        km = k < n_chunks * N
        cv = tl.load(cv_ptr + row * n_chunks * N + k, mask=km, other=float("-inf"))
        ci = tl.load(ci_ptr + row * n_chunks * N + k, mask=km, other=INT32_MAX)
        taken = k < 0
        for j in tl.static_range(N):
            v = tl.max(tl.where(taken, float("-inf"), cv), axis=0)
            i = tl.min(tl.where((cv == v) & (taken == 0), ci, INT32_MAX), axis=0)
            taken = taken | (ci == i)
            tl.store(top_i_ptr + row * N + j, tl.where(i < n_cols, i, -1).to(tl.int64))
            tl.store(top_lp_ptr + row * N + j, (v - log_z).to(tl.float32))


@dataclass
class Logprobs:
    """Per row: ``token_logprob`` float32 [B], ``token_rank`` int64 [B] (1 = most probable),
    ``top_token_ids`` int64 [B, n], ``top_logprobs`` float32 [B, n] (descending, ties to the
    lower id)."""

    token_logprob: torch.Tensor | None = None
    token_rank: torch.Tensor | None = None
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
    n_chunks = triton.cdiv(n_cols, ch)
    part = torch.empty((n_rows, n_chunks, 2), dtype=ct, device=dev)
    above = torch.empty((n_rows, n_chunks), dtype=torch.int32, device=dev)
    cv = torch.empty((n_rows, n_chunks, max(n, 1)), dtype=ct, device=dev)
    ci = torch.empty((n_rows, n_chunks, max(n, 1)), dtype=torch.int32, device=dev)
    args = (token_ids, logits, *logits.stride(), n_cols, n_chunks)
    _lp_chunks.for_backend(backend)[(n_rows, n_chunks)](part, above, cv, ci, *args, N=n, CH=ch, IS_F64=is_f64,
                                                       num_warps=8)
    _lp_merge.for_backend(backend)[(n_rows,)](
        out.token_logprob, out.token_rank, out.top_token_ids, out.top_logprobs, *args, part, above, cv, ci, N=n,
        CB=triton.next_power_of_2(n_chunks), NB=triton.next_power_of_2(max(n_chunks * n, 1)), IS_F64=is_f64,
        num_warps=4)
    return out
