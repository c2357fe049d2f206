"""softmax: every backend against a float64 torch.softmax, over dtypes, shapes, axes, layouts and edge values."""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import HAS_CUDA
from helpers import assert_close, poison, strided, wide_row_rtol
from logitserve.kernels import SoftmaxPlan, TensorSpec, softmax

# The package's ``softmax`` attribute is the function; the module holds the plan cache.
softmax_module = importlib.import_module("logitserve.kernels.softmax")
# The interpreter evaluates -inf - -inf (an all -inf row, as torch.softmax: NaN) through numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Kernels only: the torch backend is the reference itself and ignores launch options.
KERNEL_BACKENDS = ("interpret", "triton") if HAS_CUDA else ("interpret",)


def expected(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The float64 softmax of the values ``x`` holds."""
    return torch.softmax(x.cpu().to(torch.float64), dim=dim)


def randn(shape, dtype, device, gen, scale=3.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def run_plan(x: torch.Tensor, backend: str, out: torch.Tensor | None = None, **options) -> torch.Tensor:
    out = poison(torch.empty_like(x)) if out is None else out
    plan = SoftmaxPlan(TensorSpec.of(x), TensorSpec.of(out), backend=backend, **options)
    return plan(x, out)


def kernel_device(backend: str) -> str:
    return "cuda" if backend == "triton" else "cpu"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 50), (5, 257), (2, 1000), (33, 64)])
def test_rows(backend, device, dtype, shape, gen):
    x = randn(shape, dtype, device, gen)
    y = softmax(x, backend=backend)
    assert y.dtype == dtype and y.device == x.device
    assert_close(y, expected(x), dtype)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("shape", [(1, 32000), (2, 128256), (1, 151936)])
def test_vocab_widths(backend, device, dtype, shape, gen):
    x = randn(shape, dtype, device, gen)
    assert_close(softmax(x, backend=backend), expected(x), dtype, rtol=wide_row_rtol(dtype, shape[-1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_dim_and_scalar(backend, device, dtype, gen):
    x = randn((13,), dtype, device, gen)
    assert_close(softmax(x, 0, backend=backend), expected(x, 0), dtype)
    assert_close(softmax(x, -1, backend=backend), expected(x, -1), dtype)
    s = randn((), dtype, device, gen)
    assert_close(softmax(s, 0, backend=backend), expected(s, 0), dtype)


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32, torch.float64))
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 3, 4, 5), (4, 1, 6)])
def test_every_axis(backend, device, dtype, shape, gen):
    x = randn(shape, dtype, device, gen)
    for dim in range(-len(shape), len(shape)):
        assert_close(softmax(x, dim, backend=backend), expected(x, dim), dtype, what=f"dim={dim}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_views(backend, device, dtype, gen):
    t = randn((6, 37), dtype, device, gen)
    padded = strided(t, pad=5)
    assert_close(softmax(padded, backend=backend), expected(t), dtype, what="padded rows")
    transposed = randn((37, 6), dtype, device, gen).t()
    assert_close(softmax(transposed, backend=backend), expected(transposed), dtype, what="transposed, last axis")
    assert_close(softmax(transposed, 0, backend=backend), expected(transposed, 0), dtype, what="transposed, axis 0")
    permuted = randn((4, 5, 6, 3), dtype, device, gen).permute(2, 0, 3, 1)
    for dim in range(4):
        assert_close(softmax(permuted, dim, backend=backend), expected(permuted, dim), dtype,
                     what=f"permuted, dim={dim}")
    sliced = randn((9, 40), dtype, device, gen)[::2, 3:30:3]
    assert_close(softmax(sliced, 0, backend=backend), expected(sliced, 0), dtype, what="sliced, axis 0")
    assert_close(softmax(sliced, 1, backend=backend), expected(sliced, 1), dtype, what="sliced, axis 1")


def test_more_dims_than_the_kernel_indexes(backend, device, gen):
    # Five batch dims that cannot merge: the plan loops over the ones the kernel does not index.
    x = randn((4, 4, 4, 4, 4, 12), torch.float32, device, gen)[::2, ::2, ::2, ::2, ::2, ::2]
    for dim in (-1, 2):
        if backend != "torch":
            assert SoftmaxPlan(TensorSpec.of(x), dim=dim, backend=backend).lead, "the loop over lead dims must run"
        assert_close(softmax(x, dim, backend=backend), expected(x, dim), torch.float32, what=f"dim={dim}")


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32))
def test_out_and_in_place(backend, device, dtype, gen):
    x = randn((5, 300), dtype, device, gen)
    want = expected(x)
    out = poison(torch.empty_like(x))
    assert softmax(x, out=out, backend=backend) is out
    assert_close(out, want, dtype)
    out_t = poison(torch.empty(300, 5, dtype=dtype, device=device)).t()
    assert_close(softmax(x, out=out_t, backend=backend), want, dtype, what="transposed out")
    y = x.clone()
    assert softmax(y, out=y, backend=backend) is y
    assert_close(y, want, dtype, what="in place")
    y = x.clone()
    assert_close(softmax(y, 0, out=y, backend=backend), expected(x, 0), dtype, what="in place, axis 0")


def test_edge_values(backend, device, gen):
    x = randn((6, 40), torch.float32, device, gen)
    x[0, 3] = float("-inf")
    x[1, :] = float("-inf")          # all -inf: NaN, as torch.softmax
    x[2, 5] = float("nan")           # NaN propagates to the whole row
    x[3, :20] = float("-inf")        # half the row masked
    x[4, 7] = float("inf")           # +inf: NaN row, as torch.softmax
    x[5, :] = 1e4                    # large equal values: uniform
    y = softmax(x, backend=backend)
    assert_close(y, expected(x))
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and torch.isnan(y[4]).all()
    assert (y[0, 3] == 0) and (y[3, :20] == 0).all()
    assert_close(softmax(x, 0, backend=backend), expected(x, 0), what="axis 0")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cooperative", (True, False))
def test_split_rows(backend, dtype, cooperative, gen):
    # max_block=16 cuts these rows into up to 13 chunks: the cooperative launch on CUDA, the
    # stats and apply passes otherwise; widths that are not a multiple of the chunk.
    device = kernel_device(backend)
    for shape in [(3, 50), (2, 17), (4, 200), (1, 33)]:
        x = randn(shape, dtype, device, gen)
        x[0, 1] = float("-inf")
        plan = SoftmaxPlan(TensorSpec.of(x), backend=backend, max_block=16, cooperative=cooperative)
        assert plan.launch.split > 1
        assert_close(run_plan(x, backend, max_block=16, cooperative=cooperative), expected(x), dtype, what=str(shape))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("cooperative", (True, False))
def test_split_edge_values(backend, cooperative, gen):
    device = kernel_device(backend)
    x = randn((5, 70), torch.float32, device, gen)
    x[0, :] = float("-inf")              # every chunk empty
    x[1, :40] = float("-inf")            # leading chunks empty
    x[2, 60] = float("nan")
    x[3, 2] = float("inf")
    x[4, :] = -300.0                     # chunk max far below zero
    x[4, 65] = -250.0
    y = run_plan(x, backend, max_block=16, cooperative=cooperative)
    assert_close(y, expected(x))
    assert torch.isnan(y[0]).all() and torch.isnan(y[2]).all() and torch.isnan(y[3]).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_split_columns_and_in_place(backend, gen):
    device = kernel_device(backend)
    x = randn((3, 90, 5), torch.float64, device, gen)
    for dim in (0, 1):
        assert_close(run_plan(x, backend, dim=dim, max_block=8), expected(x, dim), what=f"dim={dim}")
    y = x.clone()
    assert_close(run_plan(y, backend, out=y, dim=1, max_block=8), expected(x, 1), what="in place")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_repeated_launches_reuse_the_workspace(backend, gen):
    # The cooperative counters must be back at zero after every launch.
    device = kernel_device(backend)
    x = randn((7, 100), torch.float32, device, gen)
    plan = SoftmaxPlan(TensorSpec.of(x), backend=backend, max_block=16)
    assert plan.workspace_size > 0
    for _ in range(3):
        x = randn((7, 100), torch.float32, device, gen)
        assert_close(plan(x, poison(torch.empty_like(x))), expected(x))
    assert not plan.launch.sync.any()


def test_empty(backend, device):
    x = torch.empty(0, 5, device=device)
    assert softmax(x, backend=backend).shape == (0, 5)
    assert softmax(torch.empty(3, 0, device=device), 0, backend=backend).shape == (3, 0)


def test_plans_are_cached(backend, device):
    x = torch.randn(4, 64, device=device)
    assert softmax_module._cached_plan(TensorSpec.of(x), TensorSpec.of(x), dim=-1, backend=backend) \
        is softmax_module._cached_plan(TensorSpec.of(x), TensorSpec.of(x), dim=-1, backend=backend)


def test_bad_arguments(backend, device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match="x: dtype"):
        softmax(torch.ones(4, 8, dtype=torch.int32, device=device), backend=backend)
    with pytest.raises(TypeError, match="x: must be a torch.Tensor"):
        softmax([[1.0, 2.0]], backend=backend)
    with pytest.raises(ValueError, match="dim: must be in"):
        softmax(x, 2, backend=backend)
    with pytest.raises(ValueError, match="dim: must be in"):
        softmax(x, -3, backend=backend)
    with pytest.raises(ValueError, match="out: shape"):
        softmax(x, out=torch.empty(4, 9, device=device), backend=backend)
    with pytest.raises(ValueError, match="out: dtype"):
        softmax(x, out=torch.empty(4, 8, dtype=torch.float64, device=device), backend=backend)
    with pytest.raises(ValueError, match="out: must be on"):
        SoftmaxPlan(TensorSpec.of(x), TensorSpec(x.shape, x.stride(), x.dtype, torch.device("meta")), backend=backend)
    with pytest.raises(ValueError, match="out: must be x itself"):
        softmax(x[:, :4], out=x[:, 2:6], backend=backend)
    with pytest.raises(ValueError, match="out: must not overlap itself"):
        softmax(x, out=torch.empty(1, 8, device=device).expand(4, 8), backend=backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        softmax(x, backend="cuda")
    with pytest.raises(ValueError, match="max_block: must be a power of two"):
        SoftmaxPlan(TensorSpec.of(x), backend=backend, max_block=12)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("shape", [(256, 128256), (8192, 4096), (32768, 512), (3, 151936)])
def test_full_size_cuda(dtype, shape, gen):
    x = randn(shape, dtype, "cuda", gen)
    y = softmax(x)
    assert_close(y, expected(x), dtype)
    assert_close(softmax(x), y, atol=0.0, rtol=0.0, what="second launch (deterministic, counters reset)")


@pytest.mark.cuda
def test_full_size_cuda_other_axes(gen):
    x = randn((64, 4096, 8), torch.bfloat16, "cuda", gen)
    for dim in (0, 1):
        assert_close(softmax(x, dim), expected(x, dim), torch.bfloat16, what=f"dim={dim}")
