"""sample(random_val=...): InfiniCore's random_sample, reproduced exactly.

Held to ``test_sample_expected.infinicore_random_sample``, a plain NumPy statement of the
algorithm (sort, cumulative softmax, threshold, first crossing), token for token, on rows with
and without ties, for every top_k / top_p / temperature regime: on every row where float32
arithmetic can decide the token (the threshold more than 1e-5 from a cumulative boundary).
"""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA
from logitserve.kernels import sample
from test_sample_expected import infinicore_random_sample

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CONFIGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=5, top_p=1.0),
    dict(temperature=1.3, top_k=0, top_p=0.6), dict(temperature=0.5, top_k=8, top_p=0.8),
    dict(temperature=2.0, top_k=1000, top_p=0.95), dict(temperature=0.9, top_k=2, top_p=0.05),
    dict(temperature=0.0, top_k=4, top_p=0.9), dict(temperature=1.0, top_k=1, top_p=0.9),
]


def rows(n_rows: int, vocab: int, seed: int, ties: bool, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: long runs of equal logits, ties at every boundary
        return torch.randint(-3, 3, (n_rows, vocab), generator=gen).float()
    return torch.randn(n_rows, vocab, generator=gen, dtype=torch.float64).float() * scale


def uniforms(n_rows: int, seed: int) -> torch.Tensor:
    r = torch.rand(n_rows, generator=torch.Generator().manual_seed(seed))
    r[0], r[1] = 0.0, 0.9999  # near both ends of [0, 1) (1 - 2**-24 is within rounding of the last boundary)
    return r


# Below this distance (in probability) between the threshold and a cumulative boundary, float32
# sums cannot decide the token (a 128K-token sum of float32 rounds by up to ~1e-6).
DECIDABLE = 1e-5


def expected(x: torch.Tensor, r: torch.Tensor, kw, with_margin: bool = False) -> list:
    return [infinicore_random_sample(x[i].double().numpy(), kw["temperature"], kw["top_k"], kw["top_p"],
                                     float(r[i]), with_margin) for i in range(x.shape[0])]


def check(x, r, backend, device, kw):
    got = sample(x.to(device), random_val=r.to(device), backend=backend, **kw).cpu().tolist()
    want = expected(x, r, kw, with_margin=True)
    decidable = [i for i, (_, margin) in enumerate(want) if margin > DECIDABLE]
    assert len(decidable) >= 0.8 * len(got), "too few rows a float32 computation can decide"
    bad = [(i, got[i], want[i][0]) for i in decidable if got[i] != want[i][0]]
    assert not bad, f"{len(bad)} of {len(decidable)} rows differ (row, got, want): {bad[:5]}"


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_infinicore_torch(kw, ties):
    x = rows(200, 37, seed=len(str(kw)), ties=ties)
    check(x, uniforms(200, 5), "torch", "cpu", kw)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("kw", [CONFIGS[0], CONFIGS[3], CONFIGS[5]], ids=["plain", "top_k,top_p", "tiny top_p"])
def test_matches_infinicore_interpret(kw, ties):
    x = rows(12, 29, seed=3, ties=ties)
    check(x, uniforms(12, 6), "interpret", "cpu", kw)


def test_scalar_random_val_and_float64(backend, device):
    x = rows(6, 300, seed=8, ties=False).double()
    for r in (0.0, 0.42, 0.999):
        kw = dict(temperature=0.8, top_k=40, top_p=0.9)
        got = sample(x.to(device), random_val=r, backend=backend, **kw).cpu().tolist()
        assert got == expected(x, torch.full((6,), r), kw)


def test_invalid_rows_and_wide_vocab(backend, device):
    x = rows(4, 5000, seed=9, ties=True)
    x[2, 7] = float("nan")
    r = uniforms(4, 7)
    kw = dict(temperature=1.0, top_k=0, top_p=0.9)
    got = sample(x.to(device), random_val=r.to(device), backend=backend, **kw).cpu().tolist()
    want = expected(x, r, kw, with_margin=True)
    assert got[2] == -1
    assert [got[i] for i in (0, 1, 3) if want[i][1] > DECIDABLE] == [want[i][0] for i in (0, 1, 3)
                                                                     if want[i][1] > DECIDABLE]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_infinicore_triton(kw):
    # The wide rows are sharper (logits of standard deviation 8, as a trained model's are): with
    # 128K near-equal probabilities of ~1e-5 each, most thresholds would fall within float32
    # rounding of a boundary and no row could be checked.
    for ties, vocab, scale in ((False, 37, 2.0), (True, 37, 2.0), (False, 128256, 8.0)):
        x = rows(64, vocab, seed=vocab, ties=ties, scale=scale)
        check(x, uniforms(64, 5), "triton", "cuda", kw)
