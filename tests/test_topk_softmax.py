"""topk_softmax against a float64 reference: weights, exact indices (ties to the lower index),
-inf experts, NaN / +inf / all -inf rows, strided and transposed layouts, bad arguments.

Logits are multiples of 1/32 in [-8, 8): exact in every input dtype, with many exact ties, and
distinct values far enough apart (weights differ by >= 3%) that float32 and float64 agree on
the order, so indices compare exactly. Experts rank by logit (the order of their exact
probabilities), equal logits to the lower index.
"""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import assert_close, poison, strided
from logitserve.kernels import TensorSpec, TopkSoftmaxPlan, topk_softmax
from logitserve.kernels.reference.topk_softmax import topk_softmax as reference

topk_module = sys.modules["logitserve.kernels.topk_softmax"]
# The interpreter runs -inf - -inf in numpy, which warns; the kernel handles the NaN it makes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

EXPERTS = (1, 3, 8, 60, 64, 128, 256, 257, 1000, 4096)
CASES = sorted({(e, k) for e in EXPERTS for k in (1, 2, 8, e) if k <= e})
# (dtype, renormalize): every dtype, renormalize on and off, without the full product.
VARIANTS = [(torch.bfloat16, False), (torch.float16, True), (torch.float32, False), (torch.float32, True)]
# Weights are float32 computed from exact inputs, whatever the input dtype.
W_ATOL, W_RTOL = 1e-6, 1e-5


@pytest.fixture(params=[torch.bfloat16, torch.float16, torch.float32], ids=lambda d: str(d).removeprefix("torch."))
def dtype_all(request) -> torch.dtype:
    return request.param


def quantized_logits(n: int, e: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-256, 256, (n, e), generator=gen).to(torch.float32) / 32


def check(x: torch.Tensor, k: int, renormalize: bool, weights: torch.Tensor, indices: torch.Tensor) -> None:
    want_w, want_i = reference(x.cpu().to(torch.float64), k, renormalize)
    assert weights.dtype == torch.float32 and indices.dtype == torch.int32
    assert indices.shape == want_i.shape, f"indices: shape {tuple(indices.shape)} != {tuple(want_i.shape)}"
    got_i = indices.cpu()
    if not torch.equal(got_i, want_i):
        bad = (got_i != want_i).nonzero()
        raise AssertionError(f"indices: {bad.shape[0]} differ; first at {bad[0].tolist()}: "
                             f"got {got_i[tuple(bad[0])].item()} want {want_i[tuple(bad[0])].item()}")
    assert_close(weights, want_w, torch.float32, atol=W_ATOL, rtol=W_RTOL, what="weights")


@pytest.mark.parametrize("dtype,renormalize", VARIANTS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("e,k", CASES, ids=lambda v: str(v))
def test_matches_reference(backend, device, gen, e, k, dtype, renormalize):
    n = 3 if e >= 1000 else 9
    x = quantized_logits(n, e, gen).to(dtype).to(device)
    weights, indices = topk_softmax(x, k, renormalize=renormalize, backend=backend)
    check(x, k, renormalize, weights, indices)
    if renormalize:
        assert_close(weights.sum(-1), torch.ones(n), torch.float32, atol=1e-5, rtol=0, what="weight sums")


@pytest.mark.parametrize("k", [1, 3, 8, 40])
def test_ties_go_to_lower_index(backend, device, k):
    e = 64
    x = torch.zeros(4, e)
    x[1, ::3] = 1.0                       # 22 equal maxima at 0, 3, 6, ...
    x[2] = torch.arange(e) % 4            # runs of equal values, ties across the k boundary
    x[3, [5, 9, 40, 41]] = 2.0
    x = x.to(device)
    weights, indices = topk_softmax(x, k, backend=backend)
    assert indices[0].tolist() == list(range(k))
    assert_close(weights[0], torch.full((k,), 1 / e), torch.float32, atol=W_ATOL, rtol=W_RTOL)
    assert indices[1].tolist() == ([3 * i for i in range(22)] + [i for i in range(e) if i % 3])[:k]
    assert indices[2].tolist() == sorted(range(e), key=lambda i: (-(i % 4), i))[:k]
    assert indices[3].tolist() == ([5, 9, 40, 41] + [i for i in range(e) if i not in (5, 9, 40, 41)])[:k]
    check(x, k, False, weights, indices)


@pytest.mark.parametrize("k", [4, 12])
def test_experts_rank_by_logit(backend, device, dtype_all, k):
    # Probabilities that round to the same value (0 after underflow, or one float32 for logits
    # an ulp apart) still rank by logit; equal logits, -0.0 and +0.0 included, by index.
    dtype = dtype_all
    x = torch.full((3, 16), -30000.0)
    x[0, :4] = torch.tensor([0.0, -300.0, -200.0, -250.0])        # all but the first underflow
    x[1, :6] = torch.tensor([-0.0, 0.0, -0.0, 1.0, 1.0, float("-inf")])
    x[2, :3] = torch.tensor([1.0, 1.0, 1.0])
    x[2, 1] = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(2.0, dtype=dtype)).item()
    x = x.to(dtype).to(device)
    weights, indices = topk_softmax(x, k, backend=backend)
    assert indices[0, :4].tolist() == [0, 2, 3, 1]
    assert indices[1, :min(k, 5)].tolist() == [3, 4, 0, 1, 2][:k]
    assert indices[2, :3].tolist() == [1, 0, 2]
    check(x, k, False, weights, indices)


@pytest.mark.parametrize("e,k", [(8, 8), (256, 8), (4096, 2), (4096, 64)])
def test_all_equal_rows_of_every_width(backend, device, e, k):
    x = torch.full((2, e), 0.5, device=device)
    weights, indices = topk_softmax(x, k, renormalize=True, backend=backend)
    assert indices.cpu().tolist() == [list(range(k))] * 2
    assert_close(weights, torch.full((2, k), 1 / k), torch.float32, atol=W_ATOL, rtol=W_RTOL)


@pytest.mark.parametrize("k", [2, 6, 32])
def test_neg_inf_experts_have_zero_weight(backend, device, gen, k):
    x = quantized_logits(3, 40, gen)
    x[0, 4:] = float("-inf")              # 4 finite experts: the rest fill in by index, weight 0
    x[1, ::2] = float("-inf")
    x = x.to(device)
    for renormalize in (False, True):
        weights, indices = topk_softmax(x, k, renormalize=renormalize, backend=backend)
        check(x, k, renormalize, weights, indices)
    assert indices[0, 4:].tolist() == list(range(4, k))
    assert (weights[0, 4:] == 0).all()


@pytest.mark.parametrize("k", [3, 32])
def test_rows_without_a_softmax_give_nan_weights_at_the_lowest_indices(backend, device, gen, k):
    x = quantized_logits(5, 48, gen)
    x[1, 7] = float("nan")
    x[2, 30] = float("inf")
    x[3] = float("-inf")
    x = x.to(device)
    for renormalize in (False, True):
        weights, indices = topk_softmax(x, k, renormalize=renormalize, backend=backend)
        for row in (1, 2, 3):
            assert indices[row].tolist() == list(range(k)), f"row {row}"
            assert torch.isnan(weights[row]).all(), f"row {row}"
        check(x[[0, 4]], k, renormalize, weights[[0, 4]], indices[[0, 4]])   # other rows unaffected


@pytest.mark.parametrize("k", [2, 8, 20])
def test_layouts(backend, device, gen, k):
    base = quantized_logits(11, 100, gen).to(torch.bfloat16)
    views = {
        "padded rows": strided(base.to(device), pad=5),
        "transposed": base.t().contiguous().t().to(device),
        "column stride 2": torch.stack([base, base], dim=-1).flatten(1).to(device)[:, ::2],
        "row stride 0": base[:1].expand(4, -1).to(device),
    }
    for name, x in views.items():
        weights, indices = topk_softmax(x, k, renormalize=True, backend=backend)
        want_w, want_i = topk_softmax(x.contiguous(), k, renormalize=True, backend=backend)
        assert torch.equal(indices.cpu(), want_i.cpu()), name
        assert torch.equal(weights.cpu(), want_w.cpu()), name
        check(x, k, True, weights, indices)


@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("e,k", [(3, 2), (60, 6), (64, 20), (257, 8)])
def test_multi_row_tiles(backend, device, gen, monkeypatch, rows, e, k):
    # The row heuristic gives one row per program below 256 programs: force tiles of several
    # rows (with a ragged last tile) to test the [ROWS, E] path at test sizes.
    monkeypatch.setattr(topk_module, "rows_per_program", lambda n_rows, block_e: rows)
    x = quantized_logits(2 * rows + 1, e, gen).to(device)
    x[1, 0] = float("nan")
    plan = TopkSoftmaxPlan(TensorSpec.of(x), k, renormalize=True, backend=backend)
    weights, indices = plan(x)
    assert torch.isnan(weights[1]).all() and indices[1].tolist() == list(range(k))
    keep = [i for i in range(x.shape[0]) if i != 1]
    check(x[keep], k, True, weights[keep], indices[keep])


def test_every_output_written_and_nothing_past_it(backend, device, gen):
    n, e, k = 13, 96, 5
    x = quantized_logits(n, e, gen).to(device)
    plan = TopkSoftmaxPlan(TensorSpec.of(x), k, backend=backend)
    w_buf = poison(torch.empty(n + 2, k, device=device))
    i_buf = poison(torch.empty(n + 2, k, dtype=torch.int32, device=device))
    weights, indices = plan(x, w_buf[:n], i_buf[:n])
    check(x, k, False, weights, indices)
    assert torch.isnan(w_buf[n:]).all() and (i_buf[n:] == -7).all()


def test_no_rows(backend, device):
    weights, indices = topk_softmax(torch.empty(0, 16, device=device), 4, backend=backend)
    assert weights.shape == (0, 4) and indices.shape == (0, 4)


def test_plans_are_cached():
    x = torch.zeros(4, 8)
    plan = topk_module._cached_plan(TensorSpec.of(x), 2, renormalize=False, backend="torch")
    assert topk_module._cached_plan(TensorSpec.of(x), 2, renormalize=False, backend="torch") is plan
    assert plan.workspace_size == 0


@pytest.mark.parametrize("make,k,error,words", [
    (lambda: torch.zeros(4, 8), 0, ValueError, ["k", "1 <= k <= num_experts"]),
    (lambda: torch.zeros(4, 8), 9, ValueError, ["k", "num_experts (8)"]),
    (lambda: torch.zeros(4, 8), 2.0, TypeError, ["k", "int"]),
    (lambda: torch.zeros(4, 8), True, TypeError, ["k", "int"]),
    (lambda: torch.zeros(2, 4097), 2, ValueError, ["gate_logits", "num_experts", "4096"]),
    (lambda: torch.zeros(2, 0), 1, ValueError, ["gate_logits", "num_experts"]),
    (lambda: torch.zeros(8), 2, ValueError, ["gate_logits", "2-D"]),
    (lambda: torch.zeros(2, 3, 8), 2, ValueError, ["gate_logits", "2-D"]),
    (lambda: torch.zeros(4, 8, dtype=torch.int32), 2, TypeError, ["gate_logits", "dtype", "int32"]),
    (lambda: torch.zeros(4, 8, dtype=torch.float64), 2, TypeError, ["gate_logits", "dtype", "float64"]),
    (lambda: [[0.0, 1.0]], 1, TypeError, ["gate_logits", "torch.Tensor"]),
])
def test_bad_arguments(make, k, error, words):
    for backend in ("torch", "interpret"):
        with pytest.raises(error) as info:
            topk_softmax(make(), k, backend=backend)
        for word in words:
            assert word in str(info.value), f"{word!r} not in {info.value}"


def test_bad_options():
    x = torch.zeros(4, 8)
    with pytest.raises(TypeError, match="renormalize"):
        topk_softmax(x, 2, renormalize=1)
    with pytest.raises(ValueError, match="backend"):
        topk_softmax(x, 2, backend="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("n,e,k", [(16384, 256, 8), (64, 256, 8), (16384, 64, 6), (16384, 1024, 8),
                                   (512, 4096, 8), (64, 4096, 4096), (1024, 257, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_full_size_on_gpu(n, e, k, dtype):
    gen = torch.Generator().manual_seed(n * 7 + e * 3 + k)
    x = quantized_logits(n, e, gen).to(dtype)
    x[0, :] = 0.0
    x[1, :5] = float("-inf")
    x = x.cuda()
    for renormalize in (False, True):
        weights, indices = topk_softmax(x, k, renormalize=renormalize, backend="triton")
        check(x, k, renormalize, weights, indices)
