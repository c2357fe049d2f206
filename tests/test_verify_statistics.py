"""verify: statistics. The emitted tokens follow the target's filtered distribution, token by token,
and the acceptance rate is its expectation ``sum_v min(p(v), q(v))``.

Each test verifies one draft against one target many times in one call: a batch of the same
target logits and draft distribution, each row's draft tokens drawn from ``q`` (torch's seeded
generator), seeds fixed and ``step = 0..N-1``. The expected distributions are
``test_sample_expected.kept_probabilities`` (written from the specification). Checks, each at
p > 1e-4: a G-test of the first emitted token against ``p_0``, of the correction token of the
rows that rejected ``d_0`` against ``norm(max(0, p_0 - q_0))``, of the second token of the rows
that accepted ``d_0`` against ``p_1``; a binomial test of the acceptance rate.
``test_fit_rejects_a_draft_not_drawn_from_q`` shows the checks have the power to fail.

Rows: ``ROWS_TORCH`` on the reference, ``ROWS_INTERPRET`` through the Triton interpreter (which
draws the same tokens, test_verify.py; it is slow), ``ROWS_CUDA`` compiled on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from conftest import HAS_CUDA
from logitserve.kernels import verify
from test_sample_expected import kept_probabilities
from test_sample_statistics import g_test

P_MIN = 1e-4
ROWS_TORCH = 100000
ROWS_INTERPRET = 100
ROWS_CUDA = 200000
CHUNK = 32768  # rows a verify call takes in run()
CONFIGS = [dict(), dict(temperature=0.8, top_k=4), dict(top_p=0.7), dict(min_p=0.1),
           dict(top_k=6, top_p=0.8, min_p=0.02, filter_order="joint"), dict(temperature=0.0),
           dict(top_p=0.9, draft_temperature=0.7)]


def config_id(kw) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "plain"


def target_distribution(row: np.ndarray, kw: dict) -> np.ndarray:
    """p of one target position under ``kw`` (greedy: one-hot at the first arg-max)."""
    if kw.get("temperature", 1.0) == 0:
        return np.eye(len(row))[int(np.argmax(row))]
    return kept_probabilities(row, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0),
                              kw.get("min_p", 0.0), kw.get("filter_order", "top_k_first"))


def scenario(vocab: int, n: int, seed: int):
    """One target ``[n + 1, V]`` and one draft ``[n, V]`` (logits), somewhat alike."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(n + 1, vocab, generator=gen, dtype=torch.float64) * 1.5
    draft = 0.6 * target[:n] + 0.8 * torch.randn(n, vocab, generator=gen, dtype=torch.float64)
    return target, draft


def run(backend: str, device: str, rows: int, kw: dict, vocab: int = 16, n: int = 2, wrong_draft: bool = False):
    """``(result on the CPU, p [n + 1, V], q [n, V])`` for ``rows`` verifications of one scenario."""
    kw = dict(kw)
    draft_temperature = kw.pop("draft_temperature", None)
    target, draft = scenario(vocab, n, seed=vocab + n)
    q = torch.softmax(draft / (draft_temperature or 1.0), -1)
    gen = torch.Generator().manual_seed(rows)
    drawn_from = torch.full_like(q, 1 / vocab) if wrong_draft else q
    ids = torch.multinomial(drawn_from.repeat(rows, 1), 1, replacement=True, generator=gen).reshape(rows, n)
    # Rows verified CHUNK at a time (seeded by their row index as step, so the same draws as one
    # call): the GPU run's 10^5 rows at V = 1000 would hold gigabytes per test worker at once.
    parts = []
    for start in range(0, rows, CHUNK):
        size = min(CHUNK, rows - start)
        x = target.float().to(device)[None].expand(size, -1, -1)
        if draft_temperature is None:
            draft_arg = dict(draft_probs=q.float().to(device)[None].expand(size, -1, -1))
        else:
            draft_arg = dict(draft_logits=draft.float().to(device)[None].expand(size, -1, -1),
                             draft_temperature=draft_temperature)
        parts.append(verify(ids[start:start + size].to(device), x, seed=1234, backend=backend,
                            step=torch.arange(start, start + size, device=device), **draft_arg, **kw))
    result = [torch.cat(column) for column in zip(*parts)]
    p = np.stack([target_distribution(target[i].float().double().numpy(), kw) for i in range(n + 1)])
    return [t.cpu() for t in result], p, q.float().double().numpy()


def fit(result, p: np.ndarray, q: np.ndarray) -> dict[str, float]:
    """The p-values of the four checks (module docstring)."""
    tokens, accepted, valid = (t.numpy() for t in result)
    assert valid.all()
    first = tokens[:, 0]
    rejected = accepted == 0
    residual = np.maximum(p[0] - q[0], 0.0)
    checks = {"first token": g_test(first, p[0]),
              "acceptance rate": binomtest(int((~rejected).sum()), len(first), float(np.minimum(p[0], q[0]).sum()))
              .pvalue}
    if rejected.sum() and residual.sum() > 0:
        checks["correction token"] = g_test(first[rejected], residual / residual.sum())
    if (~rejected).sum():
        checks["second token"] = g_test(tokens[~rejected, 1], p[1])
    return checks


def assert_fits(result, p, q, what: str) -> None:
    checks = fit(result, p, q)
    failed = {name: value for name, value in checks.items() if value <= P_MIN}
    assert not failed, f"{what}: {failed}"


@pytest.mark.parametrize("kw", CONFIGS, ids=config_id)
def test_emitted_tokens_follow_the_target_reference(kw):
    assert_fits(*run("torch", "cpu", ROWS_TORCH, kw), config_id(kw))


@pytest.mark.parametrize("kw", [dict(top_k=5, top_p=0.9)], ids=config_id)
def test_emitted_tokens_follow_the_target_interpret(kw):
    # The Triton kernels themselves, slowly: fewer rows over fewer tokens.
    assert_fits(*run("interpret", "cpu", ROWS_INTERPRET, kw, vocab=8, n=1), config_id(kw))


def test_fit_rejects_a_draft_not_drawn_from_q():
    # Draft tokens drawn uniformly while q says otherwise: the emitted tokens no longer follow p
    # (the acceptance rule assumes d ~ q), and the checks see it.
    checks = fit(*run("torch", "cpu", ROWS_TORCH, {}, wrong_draft=True))
    assert min(checks.values()) < 1e-6, checks


def test_greedy_acceptance_is_exactly_the_arg_max_rule():
    result, p, q = run("torch", "cpu", 2000, dict(temperature=0.0))
    argmax = p.argmax(1)
    tokens, accepted, _ = (t.numpy() for t in result)
    # Accepted draft tokens are the arg-max, and the token after them is the arg-max of its position.
    for a in range(3):
        rows = accepted == a
        assert (tokens[rows, :a] == argmax[:a]).all() and (tokens[rows, a] == argmax[a]).all()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kw", CONFIGS, ids=config_id)
def test_emitted_tokens_follow_the_target_cuda(kw):
    assert_fits(*run("triton", "cuda", ROWS_CUDA, kw), config_id(kw))
    assert_fits(*run("triton", "cuda", ROWS_CUDA, kw, vocab=1000, n=4), f"V=1000, {config_id(kw)}")
