"""causal_softmax: every backend against a row-by-row float64 softmax of each row's visible prefix."""

from __future__ import annotations

import pytest
import torch

from conftest import HAS_CUDA
from helpers import assert_close, poison, strided, wide_row_rtol
from logitserve.kernels import CausalSoftmaxPlan, TensorSpec, causal_softmax

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_BACKENDS = ("interpret", "triton") if HAS_CUDA else ("interpret",)
# The interpreter evaluates -inf - -inf (a row of -inf, as torch.softmax: NaN) through numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def visible(s: int, t: int) -> torch.Tensor:
    """Row i sees columns j <= T - S + i (InfiniCore: width + row >= col + height)."""
    return torch.arange(t)[None, :] <= t - s + torch.arange(s)[:, None]


def expected(x: torch.Tensor) -> torch.Tensor:
    """Row by row in float64: softmax over the first T - S + i + 1 columns, zeros after."""
    x = x.cpu().to(torch.float64)
    s, t = x.shape[-2:]
    want = torch.zeros_like(x)
    for i in range(s):
        n = t - s + i + 1
        want[..., i, :n] = torch.softmax(x[..., i, :n], dim=-1)
    return want


def randn(shape, dtype, device, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype).to(device)


def check(y: torch.Tensor, x_values: torch.Tensor, dtype: torch.dtype, what: str = "output",
          rtol: float | None = None) -> None:
    assert_close(y, expected(x_values), dtype, rtol=rtol, what=what)
    hidden = ~visible(*y.shape[-2:]).to(y.device).expand(y.shape)
    assert (y[hidden] == 0).all(), f"{what}: masked cells must be exactly 0"


def kernel_device(backend: str) -> str:
    return "cuda" if backend == "triton" else "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (5, 5), (3, 10), (2, 1, 1), (2, 4, 37), (3, 33, 33), (2, 6, 300)])
def test_shapes(backend, device, dtype, shape, gen):
    x = randn(shape, dtype, device, gen)
    y = causal_softmax(x, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    check(y, x, dtype)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("shape", [(1, 2, 32000), (2, 128256), (1, 1, 151936)])
def test_vocab_widths(backend, device, dtype, shape, gen):
    x = randn(shape, dtype, device, gen)
    check(causal_softmax(x, backend=backend), x, dtype, rtol=wide_row_rtol(dtype, shape[-1]))


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32))
def test_masked_cells_are_never_read(backend, device, dtype, gen):
    # NaN in every masked cell: were any read into the softmax, its row would turn NaN.
    x = randn((2, 9, 40), dtype, device, gen)
    x[~visible(9, 40).to(device).expand(x.shape)] = float("nan")
    check(causal_softmax(x, backend=backend), x, dtype)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float64))
def test_views_out_and_in_place(backend, device, dtype, gen):
    x = randn((3, 5, 21), dtype, device, gen)
    check(causal_softmax(strided(x, pad=4), backend=backend), x, dtype, what="padded rows")
    xt = randn((3, 21, 5), dtype, device, gen).transpose(1, 2)
    check(causal_softmax(xt, backend=backend), xt, dtype, what="transposed")
    out = poison(torch.empty_like(x))
    assert causal_softmax(x, out=out, backend=backend) is out
    check(out, x, dtype, what="out")
    out_t = poison(torch.empty(3, 21, 5, dtype=dtype, device=device)).transpose(1, 2)
    check(causal_softmax(x, out=out_t, backend=backend), x, dtype, what="transposed out")
    y = x.clone()
    assert causal_softmax(y, out=y, backend=backend) is y
    check(y, x, dtype, what="in place")
    y = x[1].clone()
    check(causal_softmax(y, out=y, backend=backend), x[1], dtype, what="2-d in place")


def test_edge_values(backend, device, gen):
    x = randn((6, 9), torch.float32, device, gen)
    x[0, :4] = float("-inf")      # row 0 sees 4 columns: all -inf -> NaN there, as torch
    x[1, 2] = float("-inf")
    x[2, 0] = float("nan")        # NaN in view: the visible part is NaN, masked cells stay 0
    x[3, 8] = float("nan")        # NaN masked: never read
    y = causal_softmax(x, backend=backend)
    check(y, x, torch.float32)
    assert torch.isnan(y[0, :4]).all() and torch.isnan(y[2, :6]).all()
    assert not torch.isnan(y[3]).any()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cooperative", (True, False))
def test_split_rows(backend, dtype, cooperative, gen):
    # max_block=16 cuts T into chunks, some entirely masked for the first rows.
    device = kernel_device(backend)
    for shape in [(3, 50), (2, 20, 70), (1, 40)]:
        x = randn(shape, dtype, device, gen)
        out = poison(torch.empty_like(x))
        plan = CausalSoftmaxPlan(TensorSpec.of(x), TensorSpec.of(out), backend=backend, max_block=16,
                                 cooperative=cooperative)
        assert plan.launch.split > 1
        check(plan(x, out), x, dtype, what=str(shape))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_exact_loads(backend, gen):
    # load_align=1: loads stop exactly at the diagonal.
    device = kernel_device(backend)
    x = randn((2, 7, 30), torch.float16, device, gen)
    x[~visible(7, 30).to(device).expand(x.shape)] = float("nan")
    out = poison(torch.empty_like(x))
    plan = CausalSoftmaxPlan(TensorSpec.of(x), TensorSpec.of(out), backend=backend, load_align=1)
    check(plan(x, out), x, torch.float16)


def test_empty(backend, device):
    assert causal_softmax(torch.empty(0, 3, 5, device=device), backend=backend).shape == (0, 3, 5)


def test_bad_arguments(backend, device):
    x = torch.randn(2, 3, 5, device=device)
    with pytest.raises(ValueError, match=r"x: must be \[S, T\] or \[B, S, T\]"):
        causal_softmax(torch.randn(5, device=device), backend=backend)
    with pytest.raises(ValueError, match=r"x: must be \[S, T\] or \[B, S, T\]"):
        causal_softmax(torch.randn(2, 2, 3, 5, device=device), backend=backend)
    with pytest.raises(ValueError, match=r"T >= S"):
        causal_softmax(torch.randn(2, 5, 3, device=device), backend=backend)
    with pytest.raises(TypeError, match="x: dtype"):
        causal_softmax(torch.ones(3, 5, dtype=torch.int64, device=device), backend=backend)
    with pytest.raises(TypeError, match="x: must be a torch.Tensor"):
        causal_softmax(x.tolist(), backend=backend)
    with pytest.raises(ValueError, match="out: shape"):
        causal_softmax(x, out=torch.empty(2, 3, 6, device=device), backend=backend)
    with pytest.raises(ValueError, match="out: dtype"):
        causal_softmax(x, out=torch.empty(2, 3, 5, dtype=torch.float16, device=device), backend=backend)
    with pytest.raises(ValueError, match="out: must be on"):
        CausalSoftmaxPlan(TensorSpec.of(x), TensorSpec(x.shape, x.stride(), x.dtype, torch.device("meta")),
                          backend=backend)
    with pytest.raises(ValueError, match="out: must be x itself"):
        causal_softmax(x.view(6, 5)[:3], out=x.view(6, 5)[1:4], backend=backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        causal_softmax(x, backend="gpu")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,shape", [(torch.float16, (32, 2048, 2048)), (torch.bfloat16, (512, 4, 4096)),
                                         (torch.float32, (4, 16, 40000))])
def test_full_size_cuda(dtype, shape, gen):
    x = randn(shape, dtype, "cuda", gen)
    y = causal_softmax(x)
    # The float64 reference, batched: masked_fill then softmax.
    s, t = shape[-2:]
    seen = visible(s, t).cuda()
    want = torch.softmax(x.double().masked_fill(~seen, float("-inf")), -1).masked_fill(~seen, 0)
    assert_close(y, want, dtype)
    assert (y[..., ~seen] == 0).all()
    x.copy_(torch.where(seen, x, torch.full_like(x, float("nan"))))
    assert_close(causal_softmax(x, out=x), want, dtype, what="in place, NaN in masked cells")
