"""Every selection variant of RouteExpertsPlan (kernels.route_experts.VARIANTS) against the float64
reference: the model configurations of test_route_experts, exact ties, near-ties the packed keys
cannot tell apart (so the exact redo runs), NaN and -inf rows, odd E, one row, and programs of
several rows where one row needs the redo. The default variant is also what test_route_experts
checks through route_experts().
"""

from __future__ import annotations

import pytest
import torch

from logitserve.kernels import RouteExpertsPlan, TensorSpec
from logitserve.kernels.route_experts import VARIANTS
from test_route_experts import CONFIGS, DEEPSEEK_V3, check, logits_and_bias

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]

BACKENDS = ["interpret", pytest.param("triton", marks=pytest.mark.cuda)]
DEVICES = {"interpret": "cpu", "triton": "cuda"}
# Configurations that reach the router kernel (softmax with no bias, groups or scale runs topk_softmax).
KERNEL_CONFIGS = [name for name in CONFIGS if name != "qwen3-moe"]


def route(x, k, bias, variant, backend, **options):
    plan = RouteExpertsPlan(TensorSpec.of(x), k, correction_bias=None if bias is None else TensorSpec.of(bias),
                            backend=backend, variant=variant, **options)
    assert plan.kernel is not None
    return plan(x, bias)


def cases(names, with_float32):
    # bfloat16 everywhere; float32 too where the keys are the logits (no bias), whose packed
    # keys then lose bits and need the check.
    for name in names:
        yield name, torch.bfloat16
        if with_float32 and not CONFIGS[name][3]:
            yield name, torch.float32


# Interpreted only: on CUDA, test_variant_full_size_on_cuda runs these configurations.
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name,dtype", list(cases(KERNEL_CONFIGS, True)), ids=str)
def test_variant_configs_match_reference(gen, variant, name, dtype, backend="interpret"):
    e, k, options, with_bias = CONFIGS[name]
    x, bias = logits_and_bias(7, e, with_bias, gen)
    device = DEVICES[backend]
    x = x.to(dtype).to(device)
    bias = None if bias is None else bias.to(device)
    weights, indices = route(x, k, bias, variant, backend, **options)
    check(x, k, bias, options, weights, indices)


def near_ties(n: int, e: int, gen: torch.Generator):
    # Equal logits in each row, biases 2**-20 apart (exact in float32 next to scores below 1):
    # distinct keys that agree in every bit the packed keys keep, so only the redo orders them.
    x = torch.randint(-128, 128, (n, 1), generator=gen).to(torch.float32).expand(n, e).contiguous() / 32
    bias = 0.25 + torch.randperm(e, generator=gen).to(torch.float32) * 2 ** -20
    return x, bias


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_near_ties_in_the_dropped_bits(backend, gen, variant):
    x, bias = near_ties(5, 256, gen)
    x[3] = torch.randint(-128, 128, (256,), generator=gen).to(torch.float32) / 32  # a row the fast path takes
    device = DEVICES[backend]
    x, bias = x.to(device), bias.to(device)
    for options in (DEEPSEEK_V3, dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.0)):
        weights, indices = route(x, 8, bias, variant, backend, **options)
        check(x, 8, bias, options, weights, indices)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_redo_chooses_groups_again(backend, variant):
    # Logits 0 (scores 0.5). Groups 0, 3 and 4 score 2.0; group 2 scores 1.5 + 2**-23 and group
    # 1 scores 1.5, equal in every bit a packed group key keeps, so the packed rounds keep group
    # 1 (the lower) and the exact ones group 2. Equal expert keys send the row to the redo,
    # which must rank all groups again: experts 64 and 65 of group 2 are the 7th and 8th.
    bias = torch.zeros(256)
    bias[[3, 17, 100, 101, 130, 150]] = 0.5
    bias[[32, 33, 65]] = 0.25
    bias[64] = 0.25 + 2 ** -23
    x = torch.zeros(1, 256)
    device = DEVICES[backend]
    x, bias = x.to(device), bias.to(device)
    weights, indices = route(x, 8, bias, variant, backend, **DEEPSEEK_V3)
    assert indices[0].tolist() == [3, 17, 100, 101, 130, 150, 64, 65]
    check(x, 8, bias, DEEPSEEK_V3, weights, indices)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_exact_ties_nan_and_inf_rows(backend, gen, variant):
    x, bias = logits_and_bias(8, 64, True, gen)
    x[1, 7] = float("nan")
    x[2, 30] = float("inf")       # sigmoid: an ordinary expert of score 1; softmax: a NaN row
    x[3] = float("-inf")          # sigmoid: every score 0; softmax: a NaN row
    x[4] = 0.5                    # every expert ties: the biases alone order them
    x[5, :32] = x[5, 32:]         # both halves equal
    x[6, 40] = -float("inf")
    device = DEVICES[backend]
    x, bias = x.to(device), bias.to(device)
    for options in (DEEPSEEK_V3 | dict(n_group=4), dict(scoring="softmax", n_group=4, topk_group=2),
                    dict(scoring="sigmoid", routed_scaling_factor=1.5)):
        for b in (bias, None):
            weights, indices = route(x, 6, b, variant, backend, **options)
            nan_rows = (1,) if options["scoring"] == "sigmoid" else (1, 2, 3)
            for row in nan_rows:
                assert indices[row].tolist() == list(range(6)), (options, row)
                assert torch.isnan(weights[row]).all(), (options, row)
            ok = [r for r in range(8) if r not in nan_rows and r != 3]  # sigmoid row 3 renormalizes 0 / 0
            check(x[ok], 6, b, options, weights[ok], indices[ok])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("n,e,k,options", [
    (1, 256, 8, DEEPSEEK_V3),                                                     # one row
    (3, 7, 3, dict(scoring="sigmoid")),                                           # odd E, no groups
    (5, 60, 6, dict(n_group=3, topk_group=2, renormalize=True, routed_scaling_factor=2.0)),  # 3 groups of 20
    (9, 40, 4, dict(scoring="sigmoid", n_group=5, topk_group=2, group_score="max")),
    (2, 1, 1, dict(scoring="sigmoid", routed_scaling_factor=3.0)),                # one expert
], ids=str)
def test_odd_shapes(backend, gen, variant, n, e, k, options):
    x, bias = logits_and_bias(n, e, True, gen)
    device = DEVICES[backend]
    x, bias = x.to(device), bias.to(device)
    weights, indices = route(x, k, bias, variant, backend, **options)
    check(x, k, bias, options, weights, indices)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2 grouped", "kimi-k2", "llama4 16", "llama4 128"])
def test_variant_full_size_on_cuda(gen, variant, name):
    # Many programs, of which a few redo a row (ties among the multiples of 1/32 and 1/256).
    e, k, options, with_bias = CONFIGS[name]
    x, bias = logits_and_bias(16384, e, with_bias, gen)
    x[::97] = near_ties(len(x[::97]), e, gen)[0] if with_bias else x[::97]
    x = x.to(torch.bfloat16).cuda()
    bias = None if bias is None else bias.cuda()
    weights, indices = route(x, k, bias, variant, "triton", **options)
    check(x, k, bias, options, weights, indices)
