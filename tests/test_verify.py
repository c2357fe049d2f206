"""verify (chain speculative sampling): the kernels against the float64 reference, edge cases, errors.

The Triton kernels (interpreted here, compiled on CUDA) draw the same tokens as
``kernels/reference/verify.py`` but for floating-point near-ties, which random inputs do not
produce; the reference's filtered distributions are held to ``test_sample_expected``'s
independent statement of ``sample``'s filters. The statistics are in test_verify_statistics.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import BACKEND_DEVICES, HAS_CUDA
from helpers import poison
from logitserve.kernels import VerifyPlan, VerifyResult, verify
from logitserve.kernels._plan import TensorSpec
from logitserve.kernels.reference import verify as reference
from test_sample_expected import kept_probabilities

KERNEL_BACKENDS = [b for b in sorted(BACKEND_DEVICES) if b != "torch"]
CONFIGS = [dict(), dict(temperature=0.7), dict(top_k=4), dict(top_p=0.6), dict(min_p=0.2),
           dict(top_k=5, top_p=0.8, min_p=0.05), dict(top_k=5, top_p=0.7, filter_order="joint"),
           dict(temperature=0.0), dict(top_k=1)]


def config_id(kw) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "plain"


def make_inputs(gen, rows: int, n: int, vocab: int, scale: float = 2.0, closeness: float = 0.0):
    """Target logits ``[rows, n + 1, V]``, draft logits ``[rows, n, V]`` (the target's plus noise
    weighted ``1 - closeness``) and draft ids drawn from ``softmax(draft logits)``."""
    target = torch.randn(rows, n + 1, vocab, generator=gen) * scale
    noise = torch.randn(rows, n, vocab, generator=gen) * scale
    draft_logits = closeness * target[:, :n] + (1 - closeness) * noise
    q = torch.softmax(draft_logits.double(), -1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(rows, n)
    return ids, target, draft_logits, q.float()


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def assert_same(a: VerifyResult, b: VerifyResult, what: str = "") -> None:
    """Equal results; on failure the rows that differ, both ways."""
    rows = ((a.token_ids.cpu() != b.token_ids.cpu()).any(1) | (a.num_accepted.cpu() != b.num_accepted.cpu())
            | (a.valid.cpu() != b.valid.cpu())).nonzero()[:, 0].tolist()
    assert not rows, (f"{what}: {len(rows)} rows differ; first {rows[0]}: {a.token_ids[rows[0]].tolist()} "
                      f"vs {b.token_ids[rows[0]].tolist()}")


@pytest.mark.parametrize("kw", CONFIGS, ids=config_id)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_match_reference(backend, kw):
    device = BACKEND_DEVICES[backend]
    gen = torch.Generator().manual_seed(11)
    ids, target, draft_logits, q = on(device, *make_inputs(gen, 6, 3, 37, closeness=0.7))
    steps = torch.arange(6, device=device)
    got = verify(ids, target, draft_probs=q, seed=5, step=steps, backend=backend, **kw)
    want = verify(ids.cpu(), target.cpu(), draft_probs=q.cpu(), seed=5, step=steps.cpu(), backend="torch", **kw)
    assert_same(got, want, config_id(kw))
    got = verify(ids, target, draft_logits=draft_logits, draft_temperature=0.9, seed=5, step=steps, backend=backend,
                 **kw)
    want = verify(ids.cpu(), target.cpu(), draft_logits=draft_logits.cpu(), draft_temperature=0.9, seed=5,
                  step=steps.cpu(), backend="torch", **kw)
    assert_same(got, want, f"draft logits, {config_id(kw)}")
    assert got.valid.all() and ((got.token_ids >= 0).sum(1) == got.num_accepted + 1).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_match_reference_where_the_row_decides_the_kept_set(backend):
    # Flat rows wider than the candidate list: top_p whose nucleus the 128 candidates do not
    # reach, and a top_k beyond the list, find their thresholds over the whole row.
    device = BACKEND_DEVICES[backend]
    gen = torch.Generator().manual_seed(3)
    ids, target, _, q = on(device, *make_inputs(gen, 3, 2, 1500, scale=0.3))
    for kw in (dict(top_p=0.5), dict(top_k=150, top_p=0.9), dict(top_p=0.7, min_p=0.6, filter_order="joint")):
        got = verify(ids, target, draft_probs=q, seed=2, step=7, backend=backend, **kw)
        want = verify(ids.cpu(), target.cpu(), draft_probs=q.cpu(), seed=2, step=7, backend="torch", **kw)
        assert_same(got, want, config_id(kw))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_match_reference_on_rows_spanning_chunks(backend):
    # 9000 tokens are three chunks of 4096: every chunk races its part of the row, and the row's
    # last program merges their winners (the ticket); rows that reject and rows that take the bonus.
    device = BACKEND_DEVICES[backend]
    ids, target, _, q = on(device, *make_inputs(torch.Generator().manual_seed(13), 3, 2, 9000, scale=1.5,
                                                 closeness=0.5))
    for kw in (dict(), dict(top_p=0.5)):
        got = verify(ids, target, draft_probs=q, seed=6, step=torch.arange(3, device=device), backend=backend, **kw)
        want = verify(ids.cpu(), target.cpu(), draft_probs=q.cpu(), seed=6, step=torch.arange(3), backend="torch",
                      **kw)
        assert_same(got, want, config_id(kw))


def test_reference_distributions_follow_the_specification():
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(2, 3, 12, generator=gen, dtype=torch.float64) * 2
    for kw in CONFIGS[1:7]:
        full = {**dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, filter_order="top_k_first"), **kw}
        rows = [torch.full((2,), full[name]) for name in ("temperature", "top_k", "top_p", "min_p")]
        p = reference.target_probs(target, rows[0], rows[1].long(), *rows[2:], full["filter_order"])
        for b in range(2):
            for i in range(3):
                expected = kept_probabilities(target[b, i].numpy(), full["temperature"], full["top_k"], full["top_p"],
                                              full["min_p"], full["filter_order"])
                # The temperature is read in float32 (0.7 is 0.69999999 there): relative 1e-7.
                np.testing.assert_allclose(p[b, i].numpy(), expected, rtol=1e-6, atol=1e-12, err_msg=config_id(kw))


@pytest.mark.parametrize("backend", sorted(BACKEND_DEVICES))
def test_greedy_accepts_while_the_draft_is_the_arg_max(backend):
    device = BACKEND_DEVICES[backend]
    gen = torch.Generator().manual_seed(4)
    target = torch.randint(0, 4, (5, 4, 9), generator=gen).float()  # many ties: the lowest id wins
    argmax = [[int(np.argmax(target[b, i].numpy())) for i in range(4)] for b in range(5)]
    ids = torch.tensor([argmax[0][:3], [argmax[1][0], 8 if argmax[1][1] != 8 else 7, argmax[1][2]],
                        [(argmax[2][0] + 1) % 9, argmax[2][1], argmax[2][2]], argmax[3][:3], argmax[4][:3]])
    result = verify(*on(device, ids, target), draft_probs=torch.full((5, 3, 9), 1 / 9, device=device),
                    temperature=0.0, backend=backend)
    for b in range(5):
        a = 0
        while a < 3 and ids[b, a] == argmax[b][a]:
            a += 1
        want = ids[b, :a].tolist() + [argmax[b][a]] + [-1] * (3 - a)
        assert result.token_ids[b].tolist() == want and result.num_accepted[b].item() == a


@pytest.mark.parametrize("backend", sorted(BACKEND_DEVICES))
def test_nan_and_infinite_rows(backend):
    device = BACKEND_DEVICES[backend]
    gen = torch.Generator().manual_seed(8)
    ids, target, _, q = make_inputs(gen, 4, 2, 16)
    target[1, 2, 5] = float("nan")  # the bonus position: invalid whatever the walk
    target[2, 0] = float("-inf")  # no finite logit
    target[3, 0, ids[3, 0]] = float("-inf")  # the draft's token has p = 0: rejected for sure
    target[3, 0, :3] = float("-inf")
    ids, target, q = on(device, ids, target, q)
    result = verify(ids, target, draft_probs=q, seed=1, backend=backend, top_k=6)
    assert result.valid.tolist() == [True, False, False, True]
    assert (result.token_ids[1:3] == -1).all() and result.num_accepted[1:3].tolist() == [0, 0]
    assert result.num_accepted[3].item() == 0 and result.token_ids[3, 0].item() >= 3


@pytest.mark.parametrize("backend", sorted(BACKEND_DEVICES))
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 5), (2, 1, 33), (3, 4, 7)], ids=str)
def test_small_shapes_one_row_and_n_one(backend, shape):
    rows, n, vocab = shape
    device = BACKEND_DEVICES[backend]
    ids, target, draft_logits, q = on(device, *make_inputs(torch.Generator().manual_seed(9), rows, n, vocab))
    result = verify(ids, target, draft_probs=q, seed=4, backend=backend, top_p=0.9)
    want = verify(*on("cpu", ids, target), draft_probs=q.cpu(), seed=4, backend="torch", top_p=0.9)
    assert_same(result, want)
    assert result.token_ids.shape == (rows, n + 1) and result.num_accepted.dtype == torch.int64
    if vocab == 1:
        assert result.token_ids.tolist() == [[0, 0]]  # p = q = 1: accepted, and the bonus is the only token


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_batch_invariance_and_per_row_parameters(backend):
    # Each row alone (a plan of one row) answers as in the batch, whatever its neighbours' parameters.
    device = BACKEND_DEVICES[backend]
    ids, target, draft_logits, _ = on(device, *make_inputs(torch.Generator().manual_seed(5), 4, 2, 20,
                                                            closeness=0.8))
    params = dict(temperature=torch.tensor([0.8, 0.0, 1.2, 1.0]), top_k=torch.tensor([0, 3, 6, 2]),
                  top_p=torch.tensor([0.9, 1.0, 0.8, 1.0]), min_p=torch.tensor([0.0, 0.0, 0.1, 0.0]),
                  seed=torch.tensor([1, 2, 3, 2**62]), step=torch.tensor([0, 5, 9, 2]),
                  draft_temperature=torch.tensor([1.0, 0.5, 0.0, 2.0]))
    params = {k: v.to(device) for k, v in params.items()}
    batch = verify(ids, target, draft_logits=draft_logits, backend=backend, **params)
    for b in range(4):
        alone = verify(ids[b:b + 1], target[b:b + 1], draft_logits=draft_logits[b:b + 1], backend=backend,
                       **{k: v[b:b + 1] for k, v in params.items()})
        assert_same(alone, VerifyResult(*(t[b:b + 1] for t in batch)), f"row {b}")
    want = verify(*on("cpu", ids, target, draft_logits)[:2], draft_logits=draft_logits.cpu(), backend="torch",
                  **{k: v.cpu() for k, v in params.items()})
    assert_same(batch, want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_every_output_element_is_written_and_scratch_is_reused(backend):
    device = BACKEND_DEVICES[backend]
    ids, target, _, q = on(device, *make_inputs(torch.Generator().manual_seed(6), 3, 2, 24))
    plan = VerifyPlan(TensorSpec.of(ids), TensorSpec.of(target), TensorSpec.of(q), backend=backend)
    results = []
    for _ in range(2):  # the plan's second call finds its scratch (tickets) as the first left it
        out = VerifyResult(torch.empty(3, 3, dtype=torch.int64, device=device),
                           torch.empty(3, dtype=torch.int64, device=device), torch.ones(3, dtype=torch.bool,
                                                                                        device=device))
        poison(out.token_ids), poison(out.num_accepted)
        out.valid.view(torch.int8).fill_(7)
        results.append(plan(ids, target, q, top_k=5, seed=3, step=1, out=out))
        assert (out.token_ids != -7).all() and (out.num_accepted != -7).all()
        assert set(out.valid.view(torch.int8).tolist()) <= {0, 1}
    assert_same(*results)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_draft_ids_outside_the_vocabulary_make_the_row_invalid_in_the_kernel(backend):
    # verify() refuses them on the CPU before any launch; the kernels (which CUDA tensors reach
    # unchecked) answer the row invalid.
    device = BACKEND_DEVICES[backend]
    ids, target, _, q = on(device, *make_inputs(torch.Generator().manual_seed(7), 3, 2, 10))
    ids[1, 1] = 10
    ids[2, 0] = -1
    plan = VerifyPlan(TensorSpec.of(ids), TensorSpec.of(target), TensorSpec.of(q), backend=backend)
    result = plan(ids, target, q, seed=1)
    assert result.valid.tolist() == [True, False, False] and (result.token_ids[1:] == -1).all()


def test_dtypes_and_strided_inputs():
    gen = torch.Generator().manual_seed(10)
    ids, target, _, q = make_inputs(gen, 2, 2, 17)
    want = verify(ids, target, draft_probs=q, seed=8, backend="torch", top_k=6)
    # Positions first in memory (the target's rows are not one stride apart: the plan copies them).
    transposed = target.transpose(0, 1).contiguous().transpose(0, 1)
    assert_same(verify(ids.int(), transposed, draft_probs=q, seed=8, backend="interpret", top_k=6), want)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = target.to(dtype)
        got = verify(ids, x, draft_probs=q.to(dtype), seed=8, backend="interpret", top_k=6)
        assert_same(got, verify(ids, x, draft_probs=q.to(dtype), seed=8, backend="torch", top_k=6), str(dtype))


def test_argument_errors_name_the_argument_and_the_rule():
    ids, target, logits, q = make_inputs(torch.Generator().manual_seed(12), 2, 3, 8)
    cases = [
        (dict(draft_token_ids=ids[:, :2]), ValueError, r"target_logits: shape must be \[B, n \+ 1, V\] = \[2, 3, V\]"),
        (dict(target_logits=target[:1]), ValueError, r"target_logits: shape must be \[B, n \+ 1, V\] = \[2, 4, V\]"),
        (dict(draft_probs=q[:, :, :7]), ValueError, r"draft_probs: shape must be \[B, n, V\] = \[2, 3, 8\]"),
        (dict(draft_token_ids=ids.float()), TypeError, "draft_token_ids: dtype must be one of int32, int64"),
        (dict(target_logits=target.int()), TypeError, "target_logits: dtype must be one of"),
        (dict(draft_token_ids=ids[:, :0]), ValueError, "draft_token_ids: must be 2-D .* with n >= 1"),
        (dict(draft_logits=logits), ValueError, "draft_probs / draft_logits: give exactly one"),
        (dict(draft_temperature=0.5), ValueError, "draft_temperature: applies only with draft_logits"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(temperature=torch.tensor([1.0, -1.0])), ValueError, "temperature must be .* in row 1"),
        (dict(draft_token_ids=torch.tensor([[0, 1, 2], [3, 8, 0]])), ValueError,
         r"draft_token_ids\[1, 1\]: must be in \[0, V\) with V = 8"),
        (dict(filter_order="both"), ValueError, "filter_order must be one of"),
    ]
    for change, error, message in cases:
        kw = {**dict(draft_token_ids=ids, target_logits=target, draft_probs=q), **change}
        args = (kw.pop("draft_token_ids"), kw.pop("target_logits"))
        with pytest.raises(error, match=message):
            verify(*args, **kw)
    with pytest.raises(ValueError, match="draft_temperature must be finite and >= 0"):
        verify(ids, target, draft_logits=logits, draft_temperature=float("nan"))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.9),
                                dict(top_p=0.9), dict(min_p=0.05), dict(top_k=400)], ids=config_id)
def test_full_size_cuda_matches_reference(dtype, kw):
    gen = torch.Generator().manual_seed(128256)
    ids, target, draft_logits, q = make_inputs(gen, 32, 4, 128256, closeness=0.9)
    got = verify(*on("cuda", ids, target.to(dtype)), draft_probs=q.cuda(), seed=9, step=torch.arange(32).cuda(),
                 backend="triton", **kw)
    want = verify(ids, target.to(dtype), draft_probs=q, seed=9, step=torch.arange(32), backend="torch", **kw)
    # A near-tie (two scores within rounding) may flip a draw; more than one row is a bug.
    differ = ((got.token_ids.cpu() != want.token_ids) .any(1)).sum().item()
    assert differ <= (0 if kw.get("temperature") == 0.0 else 1), f"{differ} of 32 rows differ"
    assert got.valid.all()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_per_row_values_breaking_their_rule_make_the_row_invalid():
    ids, target, draft_logits, q = on("cuda", *make_inputs(torch.Generator().manual_seed(2), 4, 2, 1000))
    ids[3, 0] = 1000
    t = torch.tensor([1.0, -1.0, 1.0, 1.0], device="cuda")
    p = torch.tensor([0.9, 0.9, 0.0, 0.9], device="cuda")
    result = verify(ids, target, draft_probs=q, temperature=t, top_p=p, seed=1)
    assert result.valid.tolist() == [True, False, False, False]
    again = verify(ids, target, draft_probs=q, temperature=t, top_p=p, seed=1)
    assert_same(result, again)
