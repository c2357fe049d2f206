"""route_experts (the MoE routers of current models) against a float64 reference of the semantics:
the configurations of DeepSeek-V3 / Kimi-K2, DeepSeek-V2, Qwen3-MoE and Llama 4; exact ties in
scores and in group scores (lower expert, lower group); NaN rows; the defaults equal to
topk_softmax; bad options.

Logits are multiples of 1/32 in [-4, 4) and biases multiples of 1/256: exact in every input
dtype, with many exact ties, and otherwise far enough apart that float32 and float64 agree on
the order, so indices compare exactly.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import assert_close
from logitserve.kernels import RouteExpertsPlan, TensorSpec, TopkSoftmaxPlan, route_experts, topk_softmax
from logitserve.kernels.reference.route_experts import route_experts as reference, within_float32_ties

# The interpreter runs NaN rows through numpy reductions, which warn; the kernel handles them.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

W_ATOL, W_RTOL = 1e-6, 1e-5
DEEPSEEK_V3 = dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)
# name: (E, k, options, with a correction bias)
CONFIGS = {
    "deepseek-v3": (256, 8, DEEPSEEK_V3, True),
    "kimi-k2 grouped": (384, 8, DEEPSEEK_V3, True),          # 48 experts a group: padded to 64
    "kimi-k2": (384, 8, dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.827), True),
    "deepseek-v2": (160, 6, dict(n_group=8, topk_group=3, group_score="max", routed_scaling_factor=16.0), False),
    "qwen3-moe": (128, 8, dict(renormalize=True), False),
    "llama4 16": (16, 1, dict(scoring="sigmoid"), False),
    "llama4 128": (128, 1, dict(scoring="sigmoid"), False),
    "sorted k=20": (64, 20, dict(scoring="sigmoid", n_group=4, topk_group=2, group_score="max"), True),
    "3 groups": (60, 6, dict(n_group=3, topk_group=2, renormalize=True), True),
}


def logits_and_bias(n: int, e: int, with_bias: bool, gen: torch.Generator):
    x = torch.randint(-128, 128, (n, e), generator=gen).to(torch.float32) / 32
    bias = torch.randint(-64, 64, (e,), generator=gen).to(torch.float32) / 256 if with_bias else None
    return x, bias


def check(x, k, bias, options, weights, indices) -> None:
    want_w, want_i = reference(x.cpu().to(torch.float64), k, correction_bias=None if bias is None else
                               bias.cpu().to(torch.float64), **options)
    assert weights.dtype == torch.float32 and indices.dtype == torch.int32
    got_i = indices.cpu()
    other = (got_i != want_i).any(-1)
    for row in other.nonzero()[:, 0].tolist():
        # The kernels' float32 may break a float64 tie otherwise (reference.within_float32_ties).
        if not within_float32_ties(x[row].cpu(), got_i[row].tolist(), correction_bias=bias, **options):
            raise AssertionError(f"indices: {int(other.sum())} rows differ; first at row {row}: got "
                                 f"{got_i[row].tolist()} want {want_i[row].tolist()}")
    assert_close(weights[~other.to(weights.device)], want_w[~other], torch.float32, atol=W_ATOL, rtol=W_RTOL,
                 what="weights")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_configs_match_reference(backend, device, gen, name, dtype):
    e, k, options, with_bias = CONFIGS[name]
    x, bias = logits_and_bias(7, e, with_bias, gen)
    x = x.to(dtype).to(device)
    bias = None if bias is None else bias.to(device)
    weights, indices = route_experts(x, k, correction_bias=bias, backend=backend, **options)
    check(x, k, bias, options, weights, indices)
    if options.get("renormalize"):
        scale = options.get("routed_scaling_factor", 1.0)
        assert_close(weights.sum(-1), torch.full((7,), scale), torch.float32, atol=1e-5, rtol=1e-6, what="sums")


def test_bias_selects_but_does_not_weigh(backend, device):
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=device)
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0], device=device)
    weights, indices = route_experts(x, 2, scoring="sigmoid", correction_bias=bias, backend=backend)
    assert indices.tolist() == [[3, 0]]    # sigmoid(-1) + 1 = 1.27 > sigmoid(2) = 0.88
    assert_close(weights, torch.sigmoid(x[0, [3, 0]].double())[None], torch.float32, atol=W_ATOL, rtol=W_RTOL)


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
def test_ties_go_to_the_lower_expert_and_group(backend, device, group_score):
    # 4 groups of 8. Row 0: every group the same multiset (permuted): groups 0 and 1 win, then
    # equal scores by index. Row 1: groups 1 and 3 tie for best, group 2 beats group 0 by a hair
    # of bias (the third group, were topk_group 3). Row 2: all equal but that bias.
    e, base = 32, torch.tensor([0.5, 1.0, -1.0, 1.0, 0.0, 0.25, -2.0, 0.5])
    x = torch.zeros(3, e)
    for g in range(4):
        x[0, 8 * g:8 * g + 8] = base.roll(g)
    x[1] = -3.0
    x[1, [9, 10, 27, 30]] = 2.0
    x[1, 16], x[1, 2] = 1.0, 1.0
    bias = torch.zeros(e)
    bias[16] = 2 ** -10
    x, bias = x.to(device), bias.to(device)
    options = dict(scoring="sigmoid", n_group=4, topk_group=2, group_score=group_score)
    weights, indices = route_experts(x, 5, correction_bias=bias, backend=backend, **options)
    # Row 0, groups 0 and 1: 1.0 at 1, 3 (group 0) and 10, 12 (group 1), then 0.5 at 0.
    assert indices[0].tolist() == [1, 3, 10, 12, 0]
    assert indices[1].tolist() == [9, 10, 27, 30, 8]
    assert indices[2].tolist() == [16, 0, 1, 2, 3]   # the bias alone picks group 2 and expert 16
    check(x, 5, bias, options, weights, indices)
    # Without the bias: the same groups (1 and 3 are strictly best).
    weights, indices = route_experts(x, 5, backend=backend, **options)
    check(x, 5, None, options, weights, indices)


def test_group_ranks_by_two_best_or_by_best(backend, device):
    # Group 0: one 3.0 and the rest -3; group 1: two 2.0. top2_sum prefers group 1, max group 0.
    x = torch.full((1, 8), -3.0)
    x[0, 0] = 3.0
    x[0, [4, 5]] = 2.0
    x = x.to(device)
    for group_score, want in (("top2_sum", [4, 5]), ("max", [0, 1])):
        options = dict(scoring="sigmoid", n_group=2, topk_group=1, group_score=group_score)
        weights, indices = route_experts(x, 2, backend=backend, **options)
        assert indices[0].tolist() == want, group_score
        check(x, 2, None, options, weights, indices)


def test_llama4_is_sigmoid_top1_of_the_logits(backend, device, gen):
    x, _ = logits_and_bias(9, 128, False, gen)
    x[3] = 1.0                               # all equal: expert 0
    x[4, [5, 70]] = 9.0                      # equal maxima: the lower
    x = x.to(device)
    weights, indices = route_experts(x, 1, scoring="sigmoid", backend=backend)
    want = torch.argmax(x.cpu(), dim=-1)     # the first maximal index
    assert indices[:, 0].cpu().tolist() == want.tolist()
    assert_close(weights[:, 0], torch.sigmoid(x.cpu().double().gather(1, want[:, None])[:, 0]), torch.float32,
                 atol=W_ATOL, rtol=W_RTOL)


@pytest.mark.parametrize("e,k", [(8, 2), (128, 8), (257, 20)])
def test_defaults_are_topk_softmax(backend, device, gen, e, k):
    x, _ = logits_and_bias(5, e, False, gen)
    x = x.to(torch.bfloat16).to(device)
    for renormalize in (False, True):
        got = route_experts(x, k, renormalize=renormalize, backend=backend)
        want = topk_softmax(x, k, renormalize=renormalize, backend=backend)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Keeping every group is no grouping: also topk_softmax's plan.
    plan = RouteExpertsPlan(TensorSpec.of(x), k, n_group=1 if e % 2 else 2, topk_group=1 if e % 2 else 2,
                            backend=backend)
    assert isinstance(plan.inner, TopkSoftmaxPlan)


def test_nan_rows(backend, device, gen):
    x, bias = logits_and_bias(6, 64, True, gen)
    x[1, 7] = float("nan")
    x[2, 30] = float("inf")       # sigmoid: an ordinary expert of score 1; softmax: a NaN row
    x[3] = float("-inf")          # sigmoid: every score 0; softmax: a NaN row
    x = x.to(device)
    bias = bias.to(device)
    for options in (DEEPSEEK_V3 | dict(n_group=4), dict(scoring="softmax", n_group=4, topk_group=2)):
        weights, indices = route_experts(x, 6, correction_bias=bias, backend=backend, **options)
        nan_rows = (1,) if options["scoring"] == "sigmoid" else (1, 2, 3)
        for row in nan_rows:
            assert indices[row].tolist() == list(range(6)), (options, row)
            assert torch.isnan(weights[row]).all(), (options, row)
        ok = [r for r in range(6) if r not in nan_rows and r != 3]  # sigmoid row 3 renormalizes 0 / 0
        check(x[ok], 6, bias, options, weights[ok], indices[ok])
    weights, indices = route_experts(x, 2, scoring="sigmoid", backend=backend)
    assert indices[2, 0].item() == 30 and weights[2, 0].item() == 1.0


def test_layouts_and_odd_rows(backend, device, gen):
    x, bias = logits_and_bias(11, 96, True, gen)
    strided = torch.stack([x, x], dim=-1).flatten(1)[:, ::2].to(device)
    transposed = x.t().contiguous().t().to(device)
    bias2 = torch.stack([bias, bias], -1).flatten()[::2].to(device)
    for view, b in ((strided, bias2), (transposed, bias.to(device))):
        weights, indices = route_experts(view, 8, correction_bias=b, backend=backend, **DEEPSEEK_V3)
        check(view, 8, b, DEEPSEEK_V3, weights, indices)


BAD = [
    (dict(n_group=3), ValueError, "n_group: must be >= 1 and divide E = 16"),
    (dict(n_group=0), ValueError, "n_group: must be >= 1"),
    (dict(n_group=4, topk_group=5), ValueError, "topk_group: must satisfy 1 <= topk_group <= n_group (4)"),
    (dict(n_group=4, topk_group=0), ValueError, "topk_group: must satisfy"),
    (dict(n_group=4, topk_group=1), ValueError, "k: must satisfy 1 <= k <= topk_group * E / n_group = 4"),
    (dict(n_group=16, topk_group=8, k=2), ValueError, "group_score: 'top2_sum' needs >= 2 experts a group"),
    (dict(scoring="relu"), ValueError, "scoring: must be one of"),
    (dict(group_score="mean"), ValueError, "group_score: must be one of"),
    (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor: must be finite and > 0"),
    (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor: must be finite"),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor: must be a float"),
    (dict(n_group=2.0), TypeError, "n_group: must be an int"),
    (dict(correction_bias=torch.zeros(15)), ValueError, "correction_bias: shape must be (E,) = (16,)"),
    (dict(correction_bias=torch.zeros(1, 16)), ValueError, "correction_bias: shape must be"),
    (dict(correction_bias=torch.zeros(16, dtype=torch.float64)), ValueError,
     "correction_bias: dtype must be float32"),
    (dict(correction_bias=[0.0] * 16), TypeError, "correction_bias: must be a torch.Tensor"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD, ids=lambda v: str(v)[:40])
def test_bad_options(kwargs, error, match):
    kwargs = dict(kwargs)
    k = kwargs.pop("k", 8 if "n_group" in kwargs and kwargs.get("topk_group") == 1 else 2)
    with pytest.raises(error, match=re.escape(match)):
        route_experts(torch.zeros(3, 16), k, backend="interpret", **kwargs)


def test_group_with_one_expert_is_fine_for_max():
    w, i = route_experts(torch.arange(16.0)[None], 2, n_group=16, topk_group=8, group_score="max",
                         backend="interpret")
    assert i.tolist() == [[15, 14]]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2 grouped", "kimi-k2", "qwen3-moe", "llama4 128",
                                  "sorted k=20"])
def test_full_size_on_cuda(gen, name):
    e, k, options, with_bias = CONFIGS[name]
    x, bias = logits_and_bias(16384, e, with_bias, gen)
    x = x.to(torch.bfloat16).cuda()
    bias = None if bias is None else bias.cuda()
    weights, indices = route_experts(x, k, correction_bias=bias, backend="triton", **options)
    check(x, k, bias, options, weights, indices)
    torch_w, torch_i = route_experts(x.cpu(), k, correction_bias=None if bias is None else bias.cpu(),
                                     backend="torch", **options)
    assert torch.equal(indices.cpu(), torch_i)
