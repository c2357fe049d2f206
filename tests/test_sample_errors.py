"""sample: bad arguments raise ValueError / TypeError naming the argument and the rule, before any launch."""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA
from logitserve.kernels import SamplePlan, TensorSpec, sample

X = torch.zeros(3, 10)


@pytest.mark.parametrize("kw, error, match", [
    (dict(temperature=-0.5), ValueError, "temperature must be finite and >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
    (dict(temperature="hot"), TypeError, "temperature must be a float"),
    (dict(temperature=True), TypeError, "temperature must be a float"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_k=2.5), TypeError, "top_k must be an int"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.01), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), ValueError, "top_p must be in"),
    (dict(min_p=-0.01), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(random_val=1.0), ValueError, r"random_val must be in \[0, 1\)"),
    (dict(random_val=-0.2), ValueError, r"random_val must be in \[0, 1\)"),
    (dict(random_val=0.5, min_p=0.1), ValueError, "min_p must be 0 when random_val is given"),
    # Checked as the kernels read them, in float32.
    (dict(temperature=1e300), ValueError, "temperature must be finite and >= 0 in float32, got 1e"),
    (dict(top_p=1e-300), ValueError, r"top_p must be in \(0, 1\].* in float32, got 1e-300"),
    (dict(random_val=1 - 1e-12), ValueError, r"random_val must be in \[0, 1\) in float32"),
    (dict(filter_order="nucleus_first"), ValueError, "filter_order must be one of"),
    (dict(out_dtype=torch.float32), TypeError, "out_dtype: dtype must be one of int32, int64"),
    (dict(seed=1 << 64), ValueError, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(step=-1), ValueError, r"step must be an integer in \[0, 2\*\*63\)"),
    (dict(step="3"), TypeError, "step must be an int"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(backend="triton"), ValueError, "backend 'triton' needs CUDA tensors"),
])
def test_bad_scalar_arguments(kw, error, match):
    with pytest.raises(error, match=match):
        sample(X, **{"seed": 1, **kw})


@pytest.mark.parametrize("logits, error, match", [
    ([[0.0, 1.0]], TypeError, "logits must be a torch.Tensor"),
    (torch.zeros(10), ValueError, r"logits: must be 2-D \(batch_size, vocab_size\)"),
    (torch.zeros(2, 3, 4), ValueError, "logits: must be 2-D"),
    (torch.zeros(2, 5, dtype=torch.int32), TypeError, "logits: dtype must be one of float16, bfloat16, float32"),
    (torch.zeros(2, 0), ValueError, "logits: vocab_size must be >= 1"),
])
def test_bad_logits(logits, error, match):
    with pytest.raises(error, match=match):
        sample(logits, seed=1)


@pytest.mark.parametrize("kw, error, match", [
    (dict(temperature=torch.ones(4)), ValueError, r"temperature: a per-row tensor must have shape \[3\]"),
    (dict(top_k=torch.ones(3, 1, dtype=torch.int64)), ValueError, r"top_k: a per-row tensor must have shape \[3\]"),
    (dict(top_k=torch.ones(3)), TypeError, "top_k: dtype must be one of int32, int64"),
    (dict(top_p=torch.ones(3, dtype=torch.int64)), TypeError, "top_p: dtype must be one of float16"),
    (dict(seed=torch.ones(3)), TypeError, "seed: dtype must be one of int32, int64"),
    (dict(random_val=torch.zeros(2)), ValueError, r"random_val: a per-row tensor must have shape \[3\]"),
    # Values of per-row CPU tensors are checked on the host, naming the first bad row.
    (dict(temperature=torch.tensor([1.0, -1.0, 1.0])), ValueError, "temperature must be finite and >= 0, got -1.0 in"),
    (dict(top_k=torch.tensor([1, 2, -3])), ValueError, "top_k must be >= 0.*got -3 in row 2"),
    (dict(top_p=torch.tensor([0.5, 0.0, 1.0])), ValueError, r"top_p must be in \(0, 1\].*row 1"),
    (dict(min_p=torch.tensor([0.0, 0.0, 2.0])), ValueError, r"min_p must be in \[0, 1\].*row 2"),
    (dict(random_val=torch.tensor([0.1, 1.0, 0.2])), ValueError, r"random_val must be in \[0, 1\).*row 1"),
    (dict(top_p=torch.tensor([0.5, 1e-300, 1.0], dtype=torch.float64)), ValueError, r"top_p must be in \(0, 1\].*row 1"),
    (dict(random_val=torch.zeros(3), min_p=torch.tensor([0.0, 0.1, 0.0])), ValueError, "min_p must be 0 when"),
])
def test_bad_per_row_tensors(kw, error, match):
    with pytest.raises(error, match=match):
        sample(X, **{"seed": 1, **kw})


def test_plan_validates_its_layout():
    with pytest.raises(ValueError, match=r"top_p: a per-row tensor must have shape \[3\], got \[5\]"):
        SamplePlan(TensorSpec.of(X), top_p=TensorSpec.of(torch.ones(5)))
    with pytest.raises(TypeError, match="min_p: dtype must be one of"):
        SamplePlan(TensorSpec.of(X), min_p=TensorSpec.of(torch.ones(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="filter_order must be one of"):
        SamplePlan(TensorSpec.of(X), filter_order="both")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_per_row_tensor_on_another_device():
    with pytest.raises(ValueError, match="top_k: must be on cuda"):
        sample(X.cuda(), top_k=torch.ones(3, dtype=torch.int64), seed=1)
