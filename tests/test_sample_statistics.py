"""sample: statistics. The noise (bit-identical across backends, uniform, independent) and the
goodness of fit of the draws to the renormalised distribution of ``kept_probabilities``.

Each fit draws one row many times in one call (a batch of the same row, ``step = 0..N-1``)
and applies a G-test (``scipy.stats.power_divergence``, log-likelihood) at p > 1e-4. Seeds are
fixed, so every run sees the same draws; ``test_fit_rejects_wrong_distributions`` shows the
test has the power to fail at these sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest, power_divergence

from conftest import HAS_CUDA
from logitserve.kernels import sample
from logitserve.kernels.sampling.noise import noise as kernel_noise
from logitserve.kernels.reference.sample import noise as torch_noise
from test_sample_expected import kept_probabilities

P_MIN = 1e-4
CONFIGS = [
    dict(), dict(top_k=5), dict(top_p=0.7), dict(min_p=0.15), dict(top_k=10, top_p=0.8),
    dict(top_k=10, top_p=0.8, filter_order="joint"), dict(top_k=8, top_p=0.9, min_p=0.05),
    dict(top_k=8, top_p=0.9, min_p=0.05, filter_order="joint"), dict(top_p=0.95, min_p=0.02),
]


def config_id(kw) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "temperature only"


def g_test(tokens: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the draws under ``probs``; draws outside its support fail outright."""
    counts = np.bincount(tokens, minlength=len(probs))
    outside = counts[probs == 0].sum()
    assert outside == 0, f"{outside} draws outside the kept set"
    observed, expected = counts[probs > 0], probs[probs > 0] * len(tokens)
    small = expected < 5  # pool sparse cells, as the chi-square approximation asks
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(observed) < 2:
        return 1.0
    return power_divergence(observed, expected, lambda_="log-likelihood").pvalue


def draws(row: torch.Tensor, n: int, backend: str, device: str = "cpu", seed: int = 2024, **kw) -> np.ndarray:
    x = row.to(device)[None, :].expand(n, -1)  # one row, n times (row stride 0)
    tokens = sample(x, seed=seed, step=torch.arange(n, device=device), backend=backend, **kw)
    return tokens.cpu().numpy()


def fixed_row(vocab: int, seed: int = 7, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * scale


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, -1, 2**40 + 5])
@pytest.mark.parametrize("step", [0, 1, 2**33 + 7])
def test_noise_bits_identical_across_backends(seed, step):
    bits, gumbels = torch_noise(torch.tensor([seed]), torch.tensor([step]), 3000)
    kbits, kgumbels = kernel_noise(seed, step, 3000, backend="interpret")
    assert torch.equal(bits[0], kbits)
    torch.testing.assert_close(gumbels[0], kgumbels, rtol=1e-6, atol=1e-6)  # two log2 roundings
    if HAS_CUDA:  # the GPU's log2 is the fast approximation (2**-22 absolute)
        gbits, ggumbels = kernel_noise(seed, step, 3000, device="cuda", backend="triton")
        assert torch.equal(bits[0], gbits.cpu())
        torch.testing.assert_close(gumbels[0], ggumbels.cpu(), rtol=1e-5, atol=1e-5)


def test_noise_uniform_and_independent():
    seeds = torch.tensor([0, 1, 99, 2**62 + 3])
    bits, gumbels = torch_noise(seeds, torch.zeros(4, dtype=torch.int64), 1 << 16)
    exps = np.exp2(-gumbels.double().numpy()) * np.log(2)  # G = -log2(E / ln 2), E ~ Exp(1)
    u = (bits >> 9).double().numpy() / 2**23
    for r in range(4):
        assert chisquare(np.bincount((u[r] * 256).astype(int), minlength=256)).pvalue > P_MIN
        assert abs(np.corrcoef(u[r, :-1], u[r, 1:])[0, 1]) < 0.02  # neighbouring tokens
        assert kstest(exps[r], "expon").pvalue > P_MIN
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 0.02  # neighbouring seeds
    # One token across consecutive steps (the decode loop's axis).
    bits, _ = torch_noise(torch.full((20000,), 5), torch.arange(20000), 3)
    across = (bits[:, 1] >> 9).double().numpy() / 2**23
    assert chisquare(np.bincount((across * 100).astype(int), minlength=100)).pvalue > P_MIN
    assert abs(np.corrcoef(across[:-1], across[1:])[0, 1]) < 0.03


@pytest.mark.parametrize("kw", CONFIGS, ids=config_id)
def test_fit_torch(kw):
    row = fixed_row(30)
    tokens = draws(row, 20000, "torch", temperature=0.9, **kw)
    assert g_test(tokens, kept_probabilities(row.numpy(), 0.9, **kw)) > P_MIN


@pytest.mark.parametrize("kw", [dict(), dict(top_k=6, top_p=0.8, min_p=0.05),
                                dict(top_k=6, top_p=0.8, min_p=0.05, filter_order="joint")], ids=config_id)
def test_fit_interpret(kw):
    # The interpreter runs the Triton kernels themselves, slowly: fewer draws over fewer tokens.
    row = fixed_row(12, seed=3)
    tokens = draws(row, 500, "interpret", temperature=1.1, **kw)
    assert g_test(tokens, kept_probabilities(row.numpy(), 1.1, **kw)) > P_MIN


def test_fit_rejects_wrong_distributions():
    row = fixed_row(30)
    kw = dict(top_k=10, top_p=0.8)
    tokens = draws(row, 20000, "torch", temperature=0.9, **kw)
    right = kept_probabilities(row.numpy(), 0.9, **kw)
    assert g_test(tokens, right) > P_MIN
    # Another temperature, the other filter order, or a slightly tilted distribution: rejected.
    for wrong in (kept_probabilities(row.numpy(), 1.0, **kw),
                  kept_probabilities(row.numpy(), 0.9, filter_order="joint", **kw) * 0.99 + right * 0.01,
                  right * np.exp(0.08 * np.arange(30)) / (right * np.exp(0.08 * np.arange(30))).sum()):
        assert g_test(tokens, wrong) < P_MIN
    with pytest.raises(AssertionError, match="outside the kept set"):
        g_test(tokens, kept_probabilities(row.numpy(), 0.9, top_k=3))


def test_greedy_and_uniform_extremes():
    row = fixed_row(16)
    assert set(draws(row, 50, "torch", temperature=0.0).tolist()) == {int(row.argmax())}
    # A huge temperature flattens p to uniform.
    assert g_test(draws(row, 16000, "torch", temperature=1e6), np.full(16, 1 / 16)) > P_MIN


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kw", [dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(min_p=0.05),
                                dict(top_k=50, top_p=0.9, filter_order="joint"), dict(top_k=300, top_p=0.95)],
                         ids=config_id)
def test_fit_triton_full_vocab(kw):
    # One 128256-token row drawn 200000 times on the GPU (the batch is a stride-0 view).
    row = fixed_row(128256, seed=11, scale=4.0)
    tokens = draws(row, 200000, "triton", device="cuda", temperature=0.8, **kw)
    assert g_test(tokens, kept_probabilities(row.numpy(), 0.8, **kw)) > P_MIN
