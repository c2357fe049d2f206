"""sample's logits processors and logprobs (issue 26), against float64 references of the semantics.

The processed logits of the Triton kernel (interpreted here) equal ``reference/processors.py``'s;
draws fit the processed distribution (G-test, as in test_sample_statistics.py); masked tokens are
never drawn; logprobs equal ``reference/logprobs.py``'s; batch invariance with every feature on;
bad inputs; plain calls take the old path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import HAS_CUDA
from logitserve.kernels import sample
from logitserve.kernels.reference.logprobs import logprobs as reference_logprobs
from logitserve.kernels.reference.processors import process as reference_process
from logitserve.kernels.sampling import api
from logitserve.kernels.sampling.logprobs import logprobs
from logitserve.kernels.sampling.processors import PROCESSOR_KEYWORDS, Processors, process_logits
from test_sample_expected import kept_probabilities
from test_sample_statistics import P_MIN, g_test

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


def ragged(lists, dtype=torch.int64):
    ids = [t for row in lists for t in row]
    offsets = np.cumsum([0] + [len(r) for r in lists]).tolist()
    return torch.tensor(ids, dtype=dtype), torch.tensor(offsets, dtype=dtype)


def bitmask(allowed_rows, n_cols):
    words = (n_cols + 31) // 32
    g = np.zeros((len(allowed_rows), words), dtype=np.uint32)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            g[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(g.view(np.int32).copy())


def features(n_rows, n_cols, gen, *, allowed=False):
    """Every processor on, with random lists (duplicates included)."""
    def lists(lo, hi):
        return [torch.randint(0, n_cols, (int(torch.randint(lo, hi, (), generator=gen)),), generator=gen).tolist()
                for _ in range(n_rows)]
    kw = {}
    kw["prompt_token_ids"], kw["prompt_offsets"] = ragged(lists(0, 12))
    kw["output_token_ids"], kw["output_offsets"] = ragged(lists(0, 20))
    kw["logit_bias_ids"], kw["logit_bias_offsets"] = ragged(lists(0, 6))
    kw["logit_bias_values"] = torch.randn(kw["logit_bias_ids"].shape, generator=gen) * 3
    kw["banned_token_ids"], kw["banned_offsets"] = ragged(lists(0, 4), torch.int32)
    kw["stop_token_ids"], kw["stop_offsets"] = ragged(lists(1, 3))
    if allowed:
        kw["allowed_token_ids"], kw["allowed_offsets"] = ragged(lists(20, 40))
    grammar = [[t for t in range(n_cols) if torch.rand((), generator=gen) < 0.7] for _ in range(n_rows)]
    kw["grammar_bitmask"] = bitmask(grammar, n_cols)
    kw.update(repetition_penalty=torch.rand(n_rows, generator=gen) * 1.5 + 0.5,
              frequency_penalty=torch.rand(n_rows, generator=gen) * 4 - 2,
              presence_penalty=torch.rand(n_rows, generator=gen) * 4 - 2,
              min_tokens=torch.randint(0, 30, (n_rows,), generator=gen))
    return kw


def procs_of(x, **kw):
    full = {k: None for k in PROCESSOR_KEYWORDS}
    full.update(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, min_tokens=0)
    full.update(kw)
    return Processors.of(x.shape[0], x.shape[1], x.device, **full)


@pytest.mark.parametrize("allowed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_processed_logits_equal_reference(allowed, dtype, gen):
    x = (torch.randn(6, 300, generator=gen) * 3).to(dtype)
    procs = procs_of(x, **features(6, 300, gen, allowed=allowed))
    got = process_logits(x, procs, backend="interpret").double()
    want = reference_process(x, procs)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-5)


def test_each_processor_alone(gen):
    x = torch.randn(2, 70, generator=gen)
    ids, off = ragged([[3, 3, 5], [69]])
    cases = [dict(repetition_penalty=2.0, output_token_ids=ids, output_offsets=off),
             dict(repetition_penalty=0.5, prompt_token_ids=ids, prompt_offsets=off),
             dict(frequency_penalty=1.5, output_token_ids=ids, output_offsets=off),
             dict(presence_penalty=-2.0, output_token_ids=ids, output_offsets=off),
             dict(logit_bias_ids=ids, logit_bias_offsets=off, logit_bias_values=torch.tensor([1.0, 2.0, -4.0, 9.0])),
             dict(allowed_token_ids=ids, allowed_offsets=off), dict(banned_token_ids=ids, banned_offsets=off),
             dict(min_tokens=torch.tensor([4, 1]), stop_token_ids=ids, stop_offsets=off, output_token_ids=ids,
                  output_offsets=off),
             dict(grammar_bitmask=bitmask([[0, 1, 40], []], 70))]
    for kw in cases:
        procs = procs_of(x, **kw)
        assert procs.any
        got = process_logits(x, procs, backend="interpret").double()
        want = reference_process(x, procs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Semantics spot checks, by hand: repetition divides positives and multiplies negatives.
    x = torch.tensor([[2.0, -2.0, 1.0]])
    ids, off = ragged([[0, 1]])
    got = process_logits(x, procs_of(x, repetition_penalty=2.0, prompt_token_ids=ids, prompt_offsets=off),
                         backend="interpret")
    assert got.tolist() == [[1.0, -4.0, 1.0]]
    got = process_logits(x, procs_of(x, frequency_penalty=0.5, presence_penalty=0.25, output_token_ids=torch.tensor(
        [0, 0, 2]), output_offsets=torch.tensor([0, 3])), backend="interpret")
    assert got.tolist() == [[2.0 - 1.0 - 0.25, -2.0, 1.0 - 0.5 - 0.25]]


def test_masked_and_banned_never_drawn(gen):
    n, v = 64, 40
    x = torch.randn(1, v, generator=gen).expand(n, -1)
    allowed = [list(range(0, 20))] * n
    banned = [[1, 2, 3]] * n
    a_ids, a_off = ragged(allowed)
    b_ids, b_off = ragged(banned)
    g = bitmask([[t for t in range(v) if t % 3 != 0]] * n, v)
    for backend in ("torch", "interpret"):
        tokens = sample(x, seed=5, step=torch.arange(n), allowed_token_ids=a_ids, allowed_offsets=a_off,
                        banned_token_ids=b_ids, banned_offsets=b_off, grammar_bitmask=g, backend=backend)
        ok = {t for t in range(20) if t % 3 != 0 and t not in (1, 2, 3)}
        assert set(tokens.tolist()) <= ok


def test_grammar_allowing_nothing_answers_minus_one(gen):
    x = torch.randn(3, 50, generator=gen)
    g = bitmask([[], [7], list(range(50))], 50)
    for backend in ("torch", "interpret"):
        tokens = sample(x, seed=1, top_p=0.9, grammar_bitmask=g, backend=backend)
        assert tokens[0] == -1 and tokens[1] == 7 and tokens[2] >= 0


@pytest.mark.parametrize("backend", ["torch", pytest.param("interpret", marks=pytest.mark.slow)])
def test_draws_fit_processed_distribution(backend, gen):
    """G-test of the draws of one row (n copies, steps 0..n-1) against the reference's
    processed distribution under penalties, bias and masks."""
    v = 24
    n = 3000 if backend == "torch" else 400
    x = torch.randn(1, v, generator=torch.Generator().manual_seed(11)) * 1.5
    one = dict(prompt=[1, 2, 2, 9], output=[2, 5, 5, 5, 7], bias=[(4, 1.5), (6, -1.0), (4, 0.5)], banned=[0],
               grammar=[t for t in range(v) if t != 3])
    p_ids, p_off = ragged([one["prompt"]] * n)
    o_ids, o_off = ragged([one["output"]] * n)
    b_ids, b_off = ragged([[t for t, _ in one["bias"]]] * n)
    b_vals = torch.tensor([b for _, b in one["bias"]] * n)
    n_ids, n_off = ragged([one["banned"]] * n)
    g = bitmask([one["grammar"]] * n, v)
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, prompt_token_ids=p_ids,
              prompt_offsets=p_off, output_token_ids=o_ids, output_offsets=o_off, logit_bias_ids=b_ids,
              logit_bias_offsets=b_off, logit_bias_values=b_vals, banned_token_ids=n_ids, banned_offsets=n_off,
              grammar_bitmask=g)
    processed = reference_process(x.expand(n, -1), procs_of(x.expand(n, -1), **kw))[0].numpy()
    for filters in (dict(temperature=0.8), dict(temperature=1.0, top_k=8, top_p=0.9)):
        tokens = sample(x.expand(n, -1), seed=77, step=torch.arange(n), backend=backend, **filters, **kw).numpy()
        expected = kept_probabilities(np.where(np.isinf(processed), -1e30, processed), **filters)
        assert not np.isin(tokens, [0, 3]).any()
        assert g_test(tokens, expected) > P_MIN


def test_batch_invariance_with_every_feature(gen):
    n, v = 5, 96
    x = torch.randn(n, v, generator=gen) * 2
    kw = features(n, v, gen, allowed=True)
    batch = sample(x, seed=torch.arange(n) + 3, step=4, top_k=20, top_p=0.9, logprobs=3, backend="interpret", **kw)
    for r in range(n):
        row = {}
        for name, value in kw.items():
            if name.endswith("_offsets"):
                continue
            if name.endswith(("_ids", "_values")):
                prefix = "logit_bias" if name.startswith("logit_bias") else name[:-len("_token_ids")]
                off = kw[f"{prefix}_offsets"]
                row[name] = value[off[r]:off[r + 1]]
                row[f"{prefix}_offsets"] = torch.tensor([0, int(off[r + 1] - off[r])], dtype=off.dtype)
            else:
                row[name] = value[r:r + 1]
        one = sample(x[r:r + 1], seed=torch.tensor([r + 3]), step=4, top_k=20, top_p=0.9, logprobs=3,
                     backend="interpret", **row)
        assert one[0].item() == batch[0][r].item()
        assert torch.equal(one[1].top_token_ids[0], batch[1].top_token_ids[r])
        assert one[1].token_logprobs[0].item() == batch[1].token_logprobs[r].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logprobs_equal_reference(dtype, gen):
    x = (torch.randn(4, 150, generator=gen) * 3).to(dtype)
    x[2, 5] = float("nan")
    tokens = torch.tensor([0, 149, -1, 77])
    got = logprobs(x, tokens, 6, backend="interpret")
    lp, rank, top_i, top_lp = reference_logprobs(x, tokens, 6)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.token_logprobs.double(), lp, equal_nan=True, **tol)
    assert torch.equal(got.token_ranks, rank)
    assert torch.equal(got.top_token_ids, top_i)
    torch.testing.assert_close(got.top_logprobs.double(), top_lp, **tol)


def test_logprobs_ties_to_lower_id():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 2.0, 0.0, 0.0]])
    for backend in ("torch", "interpret"):
        got = logprobs(x, torch.tensor([4]), 5, backend=backend)
        assert got.top_token_ids.tolist() == [[1, 3, 4, 2, 5]]
        assert got.token_ranks.tolist() == [1]


def test_sample_with_logprobs_returns_the_chosen_tokens_logprob(gen):
    x = torch.randn(3, 64, generator=gen)
    for backend in ("torch", "interpret"):
        tokens, lp = sample(x, seed=3, top_k=10, logprobs=2, backend=backend)
        assert torch.equal(tokens, sample(x, seed=3, top_k=10, backend=backend))
        want = torch.log_softmax(x.double(), 1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(lp.token_logprobs.double(), want, rtol=1e-6, atol=1e-6)


def test_plain_calls_take_the_old_path(monkeypatch, gen):
    x = torch.randn(3, 64, generator=gen)
    want = sample(x, seed=9, top_p=0.8, backend="interpret")

    def fail(*args, **kwargs):
        raise AssertionError("processors launched on a plain call")

    monkeypatch.setattr(api, "process_logits", fail)
    assert torch.equal(sample(x, seed=9, top_p=0.8, backend="interpret"), want)
    # Penalties without any history change nothing either.
    assert torch.equal(sample(x, seed=9, top_p=0.8, repetition_penalty=1.5, backend="interpret"), want)


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
    (dict(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=torch.tensor([0.0, -3.0])), r"presence_penalty must be in \[-2, 2\].*row 1"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(banned_token_ids=torch.tensor([1, 10]), banned_offsets=torch.tensor([0, 1, 2])),
     r"banned_token_ids: must be in \[0, 10\).*got 10 in row 1"),
    (dict(banned_token_ids=torch.tensor([1, 2]), banned_offsets=torch.tensor([0, 2, 1])),
     "banned_offsets: must not decrease"),
    (dict(banned_token_ids=torch.tensor([1, 2]), banned_offsets=torch.tensor([0, 1, 3])),
     "banned_offsets: must end at the ids' length 2"),
    (dict(banned_token_ids=torch.tensor([1, 2]), banned_offsets=torch.tensor([0, 2])),
     "banned_offsets must have batch_size \\+ 1 = 3 entries"),
    (dict(banned_token_ids=torch.tensor([1])), "must be given together"),
    (dict(grammar_bitmask=torch.zeros(2, 2, dtype=torch.int32)),
     r"grammar_bitmask must be an int32 tensor of shape \[2, 1\]"),
    (dict(min_tokens=3, stop_token_ids=torch.tensor([1]), stop_offsets=torch.tensor([0, 1, 1])),
     "min_tokens needs output_token_ids"),
    (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
    (dict(logprobs=2, logprobs_mode="nope"), "logprobs_mode must be one of"),
])
def test_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        sample(torch.zeros(2, 10), seed=1, **kw)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_matches_reference_full_size():
    gen = torch.Generator().manual_seed(0)
    n, v = 8, 128256
    x = torch.randn(n, v, generator=gen) * 3
    kw = features(n, v, gen, allowed=False)
    procs = procs_of(x, **kw)
    want = reference_process(x, procs)
    got = process_logits(x.cuda(), procs_of(x.cuda(), **{k: (t.cuda() if isinstance(t, torch.Tensor) else t)
                                                          for k, t in kw.items()}), backend="triton").cpu().double()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-5)
    tokens = torch.randint(0, v, (n,), generator=gen)
    lp = logprobs(x.cuda(), tokens.cuda(), 5, backend="triton")
    ref = reference_logprobs(x, tokens, 5)
    torch.testing.assert_close(lp.token_logprobs.cpu().double(), ref[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(lp.top_token_ids.cpu(), ref[2])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_graph_captures_the_call_with_every_feature():
    """Every processor and raw logprobs on CUDA tensors: no host synchronisation (torch's sync
    debug mode raises on one), so the whole call captures in a CUDA graph, whose replay equals
    the eager call."""
    gen = torch.Generator().manual_seed(3)
    n, v = 16, 3000
    x = (torch.randn(n, v, generator=gen) * 3).cuda()
    kw = {k: t.cuda() if isinstance(t, torch.Tensor) else t for k, t in features(n, v, gen, allowed=True).items()}
    seeds = torch.arange(n, device="cuda")

    def call():
        return sample(x, temperature=0.8, top_k=40, top_p=0.9, seed=seeds, step=3, logprobs=5, **kw)

    eager = call()  # compiles the kernels: capture must not
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0])
    for name in ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs"):
        assert torch.equal(getattr(captured[1], name), getattr(eager[1], name)), name


@pytest.mark.parametrize("case", ["flat", "few_finite", "peaked"])
def test_logprobs_top_n_across_chunks(case, gen):
    """Top-n from the chunks' top-n: many ties (flat), fewer than n finite logits, near-ties."""
    v = 1500
    if case == "flat":
        x = torch.zeros(2, v)
        x[1, 700] = 1.0
    elif case == "few_finite":
        x = torch.full((2, v), float("-inf"))
        x[:, [3, 900, 1400]] = torch.tensor([1.0, 2.0, 1.0])
    else:
        x = torch.randn(2, v, generator=gen).round(decimals=1)
    tokens = torch.tensor([5, 1400])
    got = logprobs(x, tokens, 6, backend="interpret")
    lp, rank, top_i, top_lp = reference_logprobs(x, tokens, 6)
    assert torch.equal(got.top_token_ids, top_i)
    assert torch.equal(got.token_ranks, rank)
    torch.testing.assert_close(got.top_logprobs.double(), top_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("filters", [dict(temperature=0.7, top_k=6), dict(temperature=1.3, top_p=0.8, min_p=0.05),
                                     dict(temperature=0.0)])
def test_processed_logprobs_and_kept_set(filters, gen):
    """processed mode: log of kept_probabilities (test_sample_expected, float64) of the processed
    logits; the kept bitmask is that distribution's support; the chosen token is in it."""
    n, v = 3, 70
    x = torch.randn(n, v, generator=gen) * 2
    kw = features(n, v, gen)
    for backend in ("torch", "interpret"):
        tokens, lp = sample(x, seed=4, logprobs=4, logprobs_mode="processed", return_kept=True, backend=backend,
                            **filters, **kw)
        processed = reference_process(x, procs_of(x, **kw)).numpy()
        for r in range(n):
            row = processed[r]
            if filters["temperature"] == 0:
                probs = (np.arange(v) == np.argmax(row)).astype(float)
            else:
                probs = kept_probabilities(np.where(np.isinf(row), -1e30, row), **filters)
            bits = (lp.kept_bitmask[r].numpy().view(np.uint32)[:, None] >> np.arange(32)) & 1
            np.testing.assert_array_equal(bits.reshape(-1)[:v].astype(bool), probs > 0)
            with np.errstate(divide="ignore"):
                want = np.log(probs)
            assert probs[tokens[r]] > 0
            np.testing.assert_allclose(lp.token_logprobs[r].item(), want[tokens[r]], rtol=1e-5, atol=1e-5)
            order = sorted(range(v), key=lambda t: (-want[t], t))[:4]
            assert lp.top_token_ids[r].tolist() == order


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The processors and logprobs kernels compile to an sm_90 cubin (Triton's own ptxas), no GPU
    needed: the interpreter alone would not catch what only the compiler refuses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from logitserve.kernels.sampling.logprobs import _lp_chunks, _lp_merge
    from logitserve.kernels.sampling.process_kernels import _append, _dense, _lists

    def build(kernel, types, constexprs, num_warps=8):
        fn = kernel._jit_fn
        sig = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
        triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})

    dtypes = dict(y_ptr="*fp32", x_ptr="*bf16", x_rs="i32", x_cs="i32", n_cols="i32", g_ptr="*i32", g_words="i32",
                  flags_ptr="*i32")
    for allowed, grammar in ((False, True), (True, True), (False, False)):
        build(_dense, dtypes, dict(HAS_ALLOWED=allowed, HAS_GRAMMAR=grammar, HAS_FLAGS=not allowed, WORDS=128))
    ptypes = dict(dtypes, rep_ptr="*fp32", freq_ptr="*fp32", pres_ptr="*fp32", p_ids="*i64", p_off="*i64",
                  o_ids="*i64", o_off="*i64", b_ids="*i64", b_vals="*fp32", b_off="*i64", a_ids="*i32",
                  a_off="*i32", n_ids="*i32", n_off="*i32", s_ids="*i64", s_off="*i64", mt_ptr="*i64",
                  tab_ptr="*i64", **{f"{x}_n": "i32" for x in "pobans"})
    flags = ("HAS_PROMPT", "HAS_OUTPUT", "HAS_BIAS", "HAS_ALLOWED", "HAS_BANNED", "HAS_MIN_TOKENS", "HAS_GRAMMAR")
    for on in (set(flags), {"HAS_ALLOWED", "HAS_GRAMMAR"}, {"HAS_PROMPT"}, {"HAS_BIAS"},
               set(flags) - {"HAS_ALLOWED"} | {"TABLE"}):  # the list table: every list it holds, by address
        build(_lists, ptypes, {**{f: f in on for f in (*flags, "TABLE")}, "TB": 1024, "BT": 64}, num_warps=4)
    build(_append, dict(tab_ptr="*i64", tokens_ptr="*i64", n_rows="i32"), dict(BLOCK=256), num_warps=4)
    ctypes = dict(part_ptr="*fp32", above_ptr="*i32", gv_ptr="*fp32", gi_ptr="*i32", tok_ptr="*i64",
                  x_ptr="*fp32", x_rs="i32", x_cs="i32", n_cols="i32", n_chunks="i32")
    mtypes = dict(ctypes, lp_ptr="*fp32", rank_ptr="*i64", top_i_ptr="*i64", top_lp_ptr="*fp32")
    for n, f64 in ((5, False), (20, True), (0, False)):
        fp = "*fp64" if f64 else "*fp32"
        build(_lp_chunks, dict(ctypes, x_ptr=fp, part_ptr=fp, gv_ptr=fp),
              dict(WITH_TOP=n > 0, CH=4096, NG=32, IS_F64=f64))
        build(_lp_merge, dict(mtypes, x_ptr=fp, part_ptr=fp, gv_ptr=fp),
              dict(N=n, NP=triton.next_power_of_2(max(n, 1)), CB=32, GB=1024, CH=4096, NG=32, IS_F64=f64), 4)
