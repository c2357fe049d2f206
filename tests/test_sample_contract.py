"""Two contracts of ``sample`` found by porting peers' suites (issue 33, item 5), on every backend.

The kept set (``return_kept``) is the support of the distribution drawn from: never a banned,
grammar-masked or -inf token, whether or not a filter is on (xgrammar's round-trip cases: the
kept bitmask lies within the grammar's). Top-n logprobs are ``[B, n]`` on every backend, even
where n passes the vocabulary (vLLM's ranks test, V = 1 and 5): the places past it id -1, -inf.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitserve import kernels
from logitserve.client import SampleResult
from logitserve.kernels import sample
from logitserve.v1 import logitserve_pb2 as pb
from test_sample_processors import bitmask

INF = float("inf")


def kept_tokens(kept_bitmask: torch.Tensor, n_cols: int) -> list[list[int]]:
    bits = (kept_bitmask.cpu().to(torch.int64)[:, :, None] >> torch.arange(32)) & 1
    return [row.reshape(-1)[:n_cols].nonzero()[:, 0].tolist() for row in bits]


@pytest.mark.parametrize("filters", [{}, dict(top_k=3), dict(top_k=4), dict(top_k=9), dict(top_p=0.999),
                                     dict(min_p=0.001), dict(temperature=0.5, top_k=0)])
def test_kept_set_is_the_support(backend, device, filters):
    # The row: token 3 banned, token 4 -inf; top-k off, exactly at, or past the finite logits.
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, -INF]], device=device)
    _, lp = sample(x, seed=1, return_kept=True, banned_token_ids=torch.tensor([3], device=device),
                   banned_offsets=torch.tensor([0, 1], device=device), backend=backend, **filters)
    assert kept_tokens(lp.kept_bitmask, 5) == [[0, 1, 2]]


def test_kept_set_is_what_can_be_drawn(backend, device):
    """Equal logits, some tokens -inf, banned or masked by the grammar: over 30 seeds (30 copies
    of a row in one batch) the draws are exactly the kept tokens (each missed with probability
    under 1e-4), and those lie within the grammar's bitmask."""
    v, copies = 40, 30
    x = torch.zeros(3, v)
    x[0, 5:] = -INF
    x[2, :] = -INF
    x[2, 7] = 1.0
    rows = [0] * copies + [1] * copies + [2]
    grammar = bitmask([range(v), range(0, 6, 2), range(v)], v)[rows].to(device)
    banned = [[[1, 3], [0], []][r] for r in rows]
    ids = torch.tensor([t for row in banned for t in row], device=device)
    offsets = torch.tensor([0, *torch.tensor([len(row) for row in banned]).cumsum(0).tolist()], device=device)
    tokens, lp = sample(x[rows].to(device), seed=torch.arange(len(rows), device=device), return_kept=True,
                        banned_token_ids=ids, banned_offsets=offsets, grammar_bitmask=grammar, backend=backend)
    want = [[0, 2, 4], [2, 4], [7]]
    assert kept_tokens(lp.kept_bitmask, v) == [want[r] for r in rows]
    drawn = tokens.cpu()
    assert [sorted(set(drawn[torch.tensor(rows) == r].tolist())) for r in range(3)] == want
    assert torch.equal(lp.kept_bitmask & ~grammar, torch.zeros_like(grammar))


@pytest.mark.parametrize("vocab", [1, 5])
@pytest.mark.parametrize("n", [6, 20])
def test_top_logprobs_past_the_vocabulary(backend, device, vocab, n):
    x = torch.randn(2, vocab, generator=torch.Generator().manual_seed(vocab)).to(device)
    tokens, lp = sample(x, seed=3, logprobs=n, backend=backend)
    assert lp.top_token_ids.shape == (2, n) and lp.top_logprobs.shape == (2, n)
    want = torch.log_softmax(x.double(), 1).sort(dim=1, descending=True, stable=True)
    assert torch.equal(lp.top_token_ids[:, :vocab].cpu(), want.indices.cpu())
    torch.testing.assert_close(lp.top_logprobs[:, :vocab].double().cpu(), want.values.cpu(), rtol=1e-5, atol=1e-5)
    assert (lp.top_token_ids[:, vocab:] == -1).all() and (lp.top_logprobs[:, vocab:] == -INF).all()
    assert torch.equal(lp.token_ranks.cpu(), (want.indices.cpu() == tokens.cpu()[:, None]).int().argmax(1) + 1)


def test_logprobs_have_one_name_in_the_kernels_the_client_and_the_wire():
    # kernels.Logprobs is exported and its fields are the client's and the proto's names.
    assert "Logprobs" in kernels.__all__
    names = [f.name for f in dataclasses.fields(kernels.Logprobs)]
    assert names == ["token_logprobs", "token_ranks", "top_token_ids", "top_logprobs", "kept_bitmask"]
    assert set(names) <= {f.name for f in dataclasses.fields(SampleResult)}
    assert set(names) <= set(pb.SampleResponse.DESCRIPTOR.fields_by_name)
