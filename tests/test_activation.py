"""silu and swiglu against float64 references: dtypes, shapes, broadcasting, layouts, out= and in
place, the extremes torch defines (silu(-inf) = nan), bad arguments."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close, poison, strided
from logitserve.kernels import FLOAT_DTYPES, SiluPlan, SwigluPlan, TensorSpec, silu, swiglu
from logitserve.kernels.reference import activation as reference

activation_module = sys.modules["logitserve.kernels.activation"]
# The interpreter evaluates exp(-x) in numpy, which warns on overflow (the inf is meant) and on
# the nan of -inf / inf (also meant: torch gives it).
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

SHAPES = [(1,), (7,), (33, 65), (3, 5, 7), (2, 3, 4, 5), (100_003,)]


def want_silu(x: torch.Tensor) -> torch.Tensor:
    return reference.silu(x.cpu().to(torch.float64))


def want_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return reference.swiglu(gate.cpu().to(torch.float64), up.cpu().to(torch.float64))


def randn(shape, dtype, device, gen, scale=4.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_silu_matches_reference(backend, device, gen, dtype, shape):
    x = randn(shape, dtype, device, gen)
    y = silu(x, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, want_silu(x), dtype)


@pytest.mark.parametrize("shape", SHAPES[:5], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_swiglu_matches_reference(backend, device, gen, dtype, shape):
    gate, up = randn(shape, dtype, device, gen), randn(shape, dtype, device, gen, 1.0)
    assert_close(swiglu(gate, up, backend=backend), want_swiglu(gate, up), dtype)


BROADCASTS = [
    ((37, 1), (37, 129)),           # one gate value per row
    ((129,), (37, 129)),            # one gate row for every row
    ((37, 129), (129,)),
    ((1,), (5, 33)),
    ((4, 1, 65), (1, 9, 65)),       # both broadcast
    ((3, 1, 1, 6), (3, 4, 5, 1)),
]


@pytest.mark.parametrize("gate_shape,up_shape", BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_broadcasts_as_torch(backend, device, gen, dtype, gate_shape, up_shape):
    gate, up = randn(gate_shape, dtype, device, gen), randn(up_shape, dtype, device, gen, 1.0)
    y = swiglu(gate, up, backend=backend)
    assert y.shape == torch.broadcast_shapes(gate_shape, up_shape)
    assert_close(y, want_swiglu(gate, up), dtype)


def layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the values of 2-D ``t`` in other memory layouts."""
    return {
        "transposed": t.t().contiguous().t(),
        "padded rows": strided(t, pad=3),
        "column stride 2": torch.stack([t, t], dim=-1).flatten(1)[:, ::2],
        "transposed and padded": strided(t.t().contiguous(), pad=2).t(),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_layouts(backend, device, gen, dtype):
    x, up = randn((19, 70), dtype, device, gen), randn((19, 70), dtype, device, gen, 1.0)
    for name, view in layouts(x).items():
        assert_close(silu(view, backend=backend), want_silu(x), dtype, what=f"silu {name}")
        for up_name, up_view in layouts(up).items():
            assert_close(swiglu(view, up_view, backend=backend), want_swiglu(x, up), dtype,
                         what=f"swiglu {name} x {up_name}")


def test_output_keeps_the_input_layout(backend, device, gen):
    x = randn((8, 12), torch.float32, device, gen).t()
    assert silu(x, backend=backend).stride() == x.stride()
    assert swiglu(x, x, backend=backend).stride() == x.stride()
    assert swiglu(x[:1], x, backend=backend).stride() == x.stride()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_out_and_in_place(backend, device, gen, dtype):
    x, up = randn((21, 45), dtype, device, gen), randn((21, 45), dtype, device, gen, 1.0)
    want_s, want_g = want_silu(x), want_swiglu(x, up)
    for out in (torch.empty_like(x), strided(torch.empty_like(x), pad=2), torch.empty_like(x.t()).t()):
        poison(out)
        assert silu(x, out=out, backend=backend) is out
        assert_close(out, want_s, dtype, what="silu out")
        poison(out)
        assert swiglu(x, up, out=out, backend=backend) is out
        assert_close(out, want_g, dtype, what="swiglu out")
    x2 = x.clone()
    assert silu(x2, out=x2, backend=backend) is x2
    assert_close(x2, want_s, dtype, what="silu in place")
    g, u = x.clone(), up.clone()
    swiglu(g, u, out=g, backend=backend)
    assert_close(g, want_g, dtype, what="swiglu out=gate")
    g, u = x.clone(), up.clone()
    swiglu(g, u, out=u, backend=backend)
    assert_close(u, want_g, dtype, what="swiglu out=up")
    g, u = x[:, :1].clone(), up.clone()
    swiglu(g, u, out=u, backend=backend)
    assert_close(u, want_swiglu(x[:, :1], up), dtype, what="swiglu broadcast gate, out=up")


def test_nothing_written_past_the_output(backend, device, gen):
    x = randn((10, 30), torch.float32, device, gen)
    buf = poison(torch.empty(10, 33, device=device))
    silu(x, out=buf[:, :30], backend=backend)
    assert torch.isnan(buf[:, 30:]).all()
    assert_close(buf[:, :30], want_silu(x), torch.float32)
    flat = poison(torch.empty(5000, device=device))
    silu(x.flatten(), out=flat[:300], backend=backend)
    assert torch.isnan(flat[300:]).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_extremes_match_torch(backend, device, dtype):
    # torch computes x / (1 + exp(-x)): silu(-inf) = -inf / inf = nan, silu(+inf) = inf, and
    # -0.0 once exp(-x) overflows; the kernels do the same.
    values = [float("inf"), float("-inf"), float("nan"), -1e4, -200.0, -88.0, -20.0, -1e-30, 0.0, -0.0,
              1e-30, 20.0, 88.0, 200.0, 1e4]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    y = silu(x.to(device), backend=backend).cpu()
    torch_y = F.silu(x)
    assert torch.isnan(y[1]) and torch.isnan(torch_y[1]), "silu(-inf) is nan, as torch"
    assert torch.equal(torch.isnan(y), torch.isnan(torch_y))
    assert torch.equal(torch.isinf(y), torch.isinf(torch_y))
    assert_close(y, torch_y, dtype)
    assert_close(y, want_silu(x), dtype)
    g = torch.tensor([float("-inf"), float("inf"), 0.0, 3.0]).to(dtype)
    u = torch.tensor([1.0, 2.0, float("inf"), float("nan")]).to(dtype)
    got = swiglu(g.to(device), u.to(device), backend=backend).cpu()
    assert_close(got, (F.silu(g.to(torch.float64)) * u.to(torch.float64)), dtype)


def test_empty(backend, device):
    x = torch.empty(0, 7, device=device)
    assert silu(x, backend=backend).shape == (0, 7)
    assert swiglu(x, torch.empty(7, device=device), backend=backend).shape == (0, 7)


def test_plans_are_cached_and_expose_their_layout():
    x = torch.zeros(4, 8)
    plan = activation_module._cached_swiglu(TensorSpec.of(x), TensorSpec.of(x[:1]), None, backend="torch")
    assert activation_module._cached_swiglu(TensorSpec.of(x), TensorSpec.of(x[:1]), None, backend="torch") is plan
    assert plan.shape == (4, 8) and plan.workspace_size == 0
    assert isinstance(SiluPlan(TensorSpec.of(x)), SiluPlan) and isinstance(plan, SwigluPlan)


def test_layout_beyond_the_rank_limit_is_refused():
    x = torch.zeros(3, 5, 5, 7, 7)[:, ::2, :, ::2, ::2]      # 5 dims that cannot merge
    for backend in ("torch", "interpret"):                    # one contract on every backend
        with pytest.raises(ValueError, match="at most 4"):
            silu(x, backend=backend)
    x = torch.randn(3, 5, 7, 7)[:, ::2, :, ::2]                # 4 dims: the strided kernel
    assert_close(silu(x, backend="interpret"), want_silu(x), torch.float32)


@pytest.mark.parametrize("call,error,words", [
    (lambda: silu(torch.zeros(3, dtype=torch.int32)), TypeError, ["x", "dtype", "int32"]),
    (lambda: silu([1.0]), TypeError, ["x", "torch.Tensor"]),
    (lambda: swiglu(torch.zeros(3), torch.zeros(3, dtype=torch.float16)), TypeError, ["up", "dtype", "gate"]),
    (lambda: swiglu(torch.zeros(3, 4), torch.zeros(5, 4)), ValueError, ["gate", "up", "(3, 4)", "(5, 4)"]),
    (lambda: swiglu(torch.zeros(4), torch.zeros(3)), ValueError, ["(4,)", "(3,)", "broadcast"]),
    (lambda: silu(torch.zeros(3), out=torch.zeros(4)), ValueError, ["out", "shape", "(3,)"]),
    (lambda: swiglu(torch.zeros(3, 1), torch.zeros(3, 4), out=torch.zeros(3, 1)), ValueError, ["out", "(3, 4)"]),
    (lambda: silu(torch.zeros(3), out=torch.zeros(3, dtype=torch.float64)), TypeError, ["out", "dtype", "float32"]),
    (lambda: silu(torch.zeros(2, 3), out=torch.zeros(1, 3).expand(2, 3)), ValueError, ["out", "overlap"]),
    (lambda: (lambda b: silu(b[1:], out=b[:-1]))(torch.zeros(6)), ValueError, ["out", "overlaps x"]),
    (lambda: silu(torch.zeros(3), backend="gpu"), ValueError, ["backend"]),
])
def test_bad_arguments(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_full_size_on_gpu(dtype):
    gen = torch.Generator().manual_seed(0)
    shape = (16384, 14336) if dtype != torch.float32 else (4096, 14336)
    gate = (torch.randn(shape, generator=gen) * 4).to(dtype).cuda()
    up = torch.randn(shape, generator=gen).to(dtype).cuda()
    want = reference.swiglu(gate.double(), up.double())
    assert_close(swiglu(gate, up), want, dtype)
    del want
    assert_close(silu(gate), reference.silu(gate.double()), dtype)
    out = gate[:, :4096]
    want = reference.swiglu(out.double(), up[:, :1].double())
    swiglu(out, up[:, :1], out=out)                  # strided, broadcast, in place
    assert_close(out, want, dtype)


@pytest.mark.cuda
def test_float64_and_odd_layouts_on_gpu():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 3001, generator=gen, dtype=torch.float64).cuda()
    assert_close(silu(x), reference.silu(x), torch.float64)
    assert_close(silu(x.t()), reference.silu(x.t()), torch.float64)
    assert_close(swiglu(x[:, :1], x[0]), reference.swiglu(x[:, :1], x[0]), torch.float64)
