"""Reference for the logits processors (``kernels/sampling/processors.py``), written plainly in
float64 from the semantics: penalties -> bias -> allowed / banned / min_tokens / grammar mask."""

from __future__ import annotations

import torch


def _rows(value, n_rows):
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value.tolist()]
    return [float(value)] * n_rows


def _row_list(pair, r):
    if pair is None:
        return None
    ids, offsets = pair[0], pair[1]
    lo, hi = int(offsets[r]), int(offsets[r + 1])
    return ids[lo:hi].to(torch.int64).cpu()


def process(logits: torch.Tensor, procs) -> torch.Tensor:
    """The processed logits, float64 ``[B, V]`` (``procs``: a ``processors.Processors``)."""
    n_rows, n_cols = logits.shape
    x = logits.detach().to(torch.float64).cpu().clone()
    rep, freq, pres = (_rows(getattr(procs, n), n_rows) for n in
                       ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    min_tokens = _rows(procs.min_tokens, n_rows)
    for r in range(n_rows):
        row = x[r]
        penalties = procs.penalties_on
        out = _row_list(procs.output, r)
        prompt = _row_list(procs.prompt, r)
        if penalties and (out is not None or prompt is not None):
            count = torch.zeros(n_cols, dtype=torch.float64)
            if out is not None:
                count.index_add_(0, out, torch.ones(len(out), dtype=torch.float64))
            seen = count > 0
            if prompt is not None:
                seen[prompt] = True
            row = torch.where(seen, torch.where(row > 0, row / rep[r], row * rep[r]), row)
            row = row - freq[r] * count - pres[r] * (count > 0).to(torch.float64)
        if procs.logit_bias is not None:
            lo, hi = int(procs.logit_bias[1][r]), int(procs.logit_bias[1][r + 1])
            ids = procs.logit_bias[0][lo:hi].to(torch.int64).cpu()
            row = row.index_add(0, ids, procs.logit_bias[2][lo:hi].to(torch.float64).cpu())
        keep = torch.ones(n_cols, dtype=torch.bool)
        allowed = _row_list(procs.allowed, r)
        if allowed is not None:
            keep = torch.zeros(n_cols, dtype=torch.bool)
            keep[allowed] = True
        banned = _row_list(procs.banned, r)
        if banned is not None:
            keep[banned] = False
        if procs.min_tokens_on and len(out if out is not None else _row_list(procs.output, r)) < min_tokens[r]:
            keep[_row_list(procs.stop, r)] = False
        if procs.grammar_bitmask is not None:
            words = procs.grammar_bitmask[r].cpu().to(torch.int64) & 0xFFFFFFFF
            bits = (words[:, None] >> torch.arange(32)) & 1
            keep &= bits.reshape(-1)[:n_cols].bool()
        x[r] = torch.where(keep, row, float("-inf"))
    return x.to(logits.device)
