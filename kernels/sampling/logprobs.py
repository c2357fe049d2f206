"""Logprobs of sampled tokens: for each row the log-probability and rank of the chosen token, and
the top-n tokens (ties to the lower token id) with their log-probabilities.

``raw`` mode: the log-softmax of the logits as given (before processors, temperature and
filters), as vLLM's ``raw_logprobs``. A row whose token is -1 (invalid) gets a logprob of NaN
and rank 0; its top-n are computed all the same (NaN logits read as -inf).

``_logprobs`` is one Triton kernel, a program per row: one pass for the max, the softmax total
(online, per lane) and the count of logits strictly above the chosen one (rank = that + 1); a
second pass gathers the tokens at or above a bound of the n-th largest logit (the n-th largest
lane max) into a short list; then the top-n entries, each the largest (value, lowest id)
strictly below the previous one in that order, by passes over that list (over the row where
more than ``CANDIDATES`` tokens reach the bound). A separate launch after the draw: plain sampling never runs it.
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
# Top-n candidate slots a row (gathered at or above the n-th largest lane max).
CANDIDATES = 512


@launchable
@triton.jit(do_not_specialize=["n_cols"])
def _logprobs(lp_ptr, rank_ptr, top_i_ptr, top_lp_ptr, tok_ptr, x_ptr, x_rs, x_cs, n_cols, cv_ptr, ci_ptr,
              N: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, IS_F64: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_rs
    tok = tl.load(tok_ptr + row).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < n_cols)
    xc = to_compute(tl.load(x_row + tl.where(tok_ok, tok, 0) * x_cs), IS_F64)
    xc = tl.where(xc != xc, float("-inf"), xc)
    m_l = to_compute(tl.full([BLOCK], float("-inf"), tl.float32), IS_F64)
    s_l = to_compute(tl.zeros([BLOCK], tl.float32), IS_F64)
    above = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        col = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(x_row + col * x_cs, mask=col < n_cols, other=float("-inf"))
        x = to_compute(x, IS_F64)
        x = tl.where(x != x, float("-inf"), x)
        m_new = tl.maximum(m_l, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_l = s_l * tl.exp(m_l - safe) + tl.exp(x - safe)
        m_l = m_new
        above += (x > xc).to(tl.int32)
    m = tl.max(m_l, axis=0)
    safe_m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_l * tl.exp(m_l - safe_m), axis=0)
    log_z = safe_m + tl.log(s)
    lp = tl.where(tok_ok, xc - log_z, float("nan"))
    tl.store(lp_ptr + row, lp.to(tl.float32))
    tl.store(rank_ptr + row, tl.where(tok_ok, tl.sum(above, axis=0) + 1, 0).to(tl.int64))
    # Top-n candidates: the n-th largest lane max L bounds the n-th largest logit from below (n
    # lanes hold n distinct tokens >= L), so the top-n lie among the tokens >= L: one pass gathers
    # them into the row's CAP slots, and the selection runs over those. More than CAP of them
    # (ties, or fewer than n finite lanes): the selection runs over the row instead.
    lanes = tl.arange(0, BLOCK)
    taken = lanes < 0
    bound = m
    for j in tl.static_range(N):
        bound = tl.max(tl.where(taken, float("-inf"), m_l), axis=0)
        lane = tl.min(tl.where((m_l == bound) & (taken == 0), lanes, BLOCK), axis=0)
        taken = taken | (lanes == lane)
    count = tl.sum(lanes * 0, axis=0)
    if N > 0:
        for start in range(0, n_cols, BLOCK):
            col = start + tl.arange(0, BLOCK).to(tl.int64)
            x = to_compute(tl.load(x_row + col * x_cs, mask=col < n_cols, other=float("-inf")), IS_F64)
            x = tl.where(x != x, float("-inf"), x)
            keep = (col < n_cols) & (x >= bound)
            pos = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            ok = keep & (pos < CAP)
            tl.store(cv_ptr + row * CAP + pos, x, mask=ok)
            tl.store(ci_ptr + row * CAP + pos, col, mask=ok)
            count += tl.sum(keep.to(tl.int32), axis=0)
        tl.debug_barrier()
    use_list = count <= CAP
    # Each entry: the largest (value, then lowest id) strictly after the previous one.
    prev_v = to_compute(tl.full([], float("inf"), tl.float32), IS_F64)
    prev_i = tl.full([], -1, tl.int64)
    for j in tl.static_range(N):
        bv = to_compute(tl.full([BLOCK], float("-inf"), tl.float32), IS_F64)
        bi = tl.full([BLOCK], INT32_MAX, tl.int64)
        if use_list:
            for start in range(0, count, BLOCK):
                idx = start + tl.arange(0, BLOCK)
                live = idx < count
                x = tl.load(cv_ptr + row * CAP + idx, mask=live, other=float("-inf"))
                col = tl.load(ci_ptr + row * CAP + idx, mask=live, other=INT32_MAX)
                after = live & ((x < prev_v) | ((x == prev_v) & (col > prev_i)))
                better = after & ((x > bv) | ((x == bv) & (col < bi)))
                bv = tl.where(better, x, bv)
                bi = tl.where(better, col, bi)
        else:
            for start in range(0, n_cols, BLOCK):
                col = start + tl.arange(0, BLOCK).to(tl.int64)
                x = to_compute(tl.load(x_row + col * x_cs, mask=col < n_cols, other=float("-inf")), IS_F64)
                x = tl.where(x != x, float("-inf"), x)
                after = (col < n_cols) & ((x < prev_v) | ((x == prev_v) & (col > prev_i)))
                better = after & ((x > bv) | ((x == bv) & (col < bi)))
                bv = tl.where(better, x, bv)
                bi = tl.where(better, col, bi)
        v = tl.max(bv, axis=0)
        i = tl.min(tl.where(bv == v, bi, INT32_MAX), axis=0)
        tl.store(top_i_ptr + row * N + j, tl.where(i < n_cols, i, -1))
        tl.store(top_lp_ptr + row * N + j, (v - log_z).to(tl.float32))
        prev_v = v
        prev_i = i


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
    block = min(2048, triton.next_power_of_2(max(n_cols, 16)))
    slots = n_rows * CANDIDATES if n else 1
    cv = torch.empty(slots, dtype=torch.float64 if is_f64 else torch.float32, device=dev)
    ci = torch.empty(slots, dtype=torch.int64, device=dev)
    _logprobs.for_backend(backend)[(n_rows,)](
        out.token_logprob, out.token_rank, out.top_token_ids, out.top_logprobs, token_ids, logits,
        *logits.stride(), n_cols, cv, ci, N=n, BLOCK=block, CAP=CANDIDATES, IS_F64=is_f64, num_warps=8)
    return out
