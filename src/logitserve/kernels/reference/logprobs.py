"""Reference for logprobs (``kernels/sampling/logprobs.py``): float64 log-softmax, rank, and the
top-n by a stable descending sort (ties to the lower token id)."""

from __future__ import annotations

import torch


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int):
    """``(token_logprobs, token_ranks, top_token_ids, top_logprobs)`` in float64 / int64; the top
    ``[B, n]`` even where ``n`` passes the vocabulary, the places past it id -1 and -inf (as the
    kernels answer)."""
    x = logits.detach().to(torch.float64)
    x = torch.where(torch.isnan(x), float("-inf"), x)
    lp = torch.log_softmax(x, dim=1)
    tok = token_ids.to(torch.int64)
    ok = (tok >= 0) & (tok < x.shape[1])
    chosen = lp.gather(1, tok.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    rank = (lp > chosen[:, None]).sum(1) + 1
    sorted_lp, order = torch.sort(lp, dim=1, descending=True, stable=True)
    past = max(0, n - x.shape[1])
    top_ids = torch.nn.functional.pad(order[:, :n], (0, past), value=-1)
    top_lp = torch.nn.functional.pad(sorted_lp[:, :n], (0, past), value=float("-inf"))
    return torch.where(ok, chosen, float("nan")), torch.where(ok, rank, 0), top_ids, top_lp
