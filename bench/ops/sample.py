"""sample cases: logitserve's kernels against torch eager, torch.compile and FlashInfer.

Bytes counted (the floor; BASELINES.md counts the same way):

    tokens = sample(logits, ...)   # reads B*V logits once, writes B int64 ids

so ``bytes_moved = B * V * element_size + 8 * B``. One read of 256x128256 float32 (131 MB) at
the measured 3.0 TB/s copy bandwidth is about 44 us.

The logits are ``torch.randn`` (a flat distribution: the top-p nucleus then holds a large part
of the vocabulary, the hard case for a filter). The torch baseline is the sort-based path vLLM
falls back to (vllm/v1/sample/ops/topk_topp_sampler.py: ``apply_top_k_top_p`` then
``random_sample``'s exponential race); greedy is ``argmax``.

    python -m bench.ops.sample [--only SUBSTRING] [--check] [--graphs]

runs the cases alone (``--only`` filters on "shape impl"), ``--check`` first compares the
Triton backend with the torch reference at full size, ``--graphs`` also times
logitserve replayed from a CUDA graph (launch overhead removed; FlashInfer's calls create a
generator, which graph capture refuses).
"""

from __future__ import annotations

import argparse
import sys

import torch

from logitserve.kernels import sample

from ..harness import Case, flashinfer_sampling, maybe_compile, median_us, print_case_header, print_case_row

TEMPERATURE, TOP_K, TOP_P, MIN_P = 0.8, 50, 0.9, 0.05
BATCHES = (1, 16, 64, 256)
VOCABS = (128256, 151936)


def _vllm_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    logits = logits / temperature[:, None]
    if top_k is not None or top_p is not None:
        logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
        if top_k is not None:
            kth = logits_sort.gather(1, (logits_sort.size(1) - top_k).unsqueeze(1))
            logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
        if top_p is not None:
            probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
            top_p_mask = probs_sum <= 1 - top_p.unsqueeze(1)
            top_p_mask[:, -1] = False
            logits_sort.masked_fill_(top_p_mask, float("-inf"))
        logits = logits_sort.scatter(-1, logits_idx, logits_sort)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def _frontend_inputs(batch: int, vocab: int, device: torch.device, gen: torch.Generator) -> dict:
    """Issue 26's target: three penalties over 1,024-token output histories (and 256-token
    prompts), a 64-entry logit bias, a grammar bitmask allowing about half the vocabulary."""
    def ragged(n):
        ids = torch.randint(0, vocab, (batch * n,), device=device, generator=gen)
        return ids, torch.arange(0, batch * n + 1, n, device=device)

    kw = dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)
    kw["prompt_token_ids"], kw["prompt_offsets"] = ragged(256)
    kw["output_token_ids"], kw["output_offsets"] = ragged(1024)
    kw["logit_bias_ids"], kw["logit_bias_offsets"] = ragged(64)
    kw["logit_bias_values"] = torch.randn(batch * 64, device=device, generator=gen)
    words = (vocab + 31) // 32
    kw["grammar_bitmask"] = torch.randint(-2**31, 2**31 - 1, (batch, words), device=device, generator=gen,
                                          dtype=torch.int32)
    return kw


def _torch_frontend(logits, kw, temperature, top_k, top_p, n_logprobs=5):
    """The same steps with torch operations (scatter-add counts, masked fills, log_softmax, topk),
    then the sort-based sampler: what a frontend does without logitserve."""
    batch, vocab = logits.shape
    x = logits.clone()
    rows_o = torch.arange(batch, device=x.device).repeat_interleave(torch.diff(kw["output_offsets"]))
    rows_p = torch.arange(batch, device=x.device).repeat_interleave(torch.diff(kw["prompt_offsets"]))
    counts = torch.zeros_like(x).index_put_((rows_o, kw["output_token_ids"]), torch.ones_like(rows_o, dtype=x.dtype),
                                            accumulate=True)
    seen = counts > 0
    seen[rows_p, kw["prompt_token_ids"]] = True
    rep = kw["repetition_penalty"]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - kw["frequency_penalty"] * counts - kw["presence_penalty"] * (counts > 0)
    rows_b = torch.arange(batch, device=x.device).repeat_interleave(torch.diff(kw["logit_bias_offsets"]))
    x = x.index_put_((rows_b, kw["logit_bias_ids"]), kw["logit_bias_values"], accumulate=True)
    bits = (kw["grammar_bitmask"][:, :, None] >> torch.arange(32, device=x.device, dtype=torch.int32)) & 1
    x = x.masked_fill(bits.reshape(batch, -1)[:, :vocab] == 0, float("-inf"))
    tokens = _vllm_sample(x, temperature, top_k, top_p, None)
    lp = torch.log_softmax(logits, dim=-1)
    return tokens, lp.gather(1, tokens[:, None]), lp.topk(n_logprobs, dim=-1)


class _Graphed:
    """A call captured in a CUDA graph on its first use (after one eager call that compiles the
    kernels), then replayed: device time only, the host's argument checks and launches left out.
    A call that synchronises with the host fails its capture, and its row says so."""

    def __init__(self, fn):
        self.fn, self.graph = fn, None

    def __call__(self):
        if self.graph is None:
            self.fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.fn()
            self.graph = graph
        self.graph.replay()


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _configs():
    """(label, batch, vocab, sample kwargs) for every case."""
    for vocab in VOCABS:
        for batch in BATCHES:
            yield f"T{TEMPERATURE} k{TOP_K} p{TOP_P}", batch, vocab, dict(temperature=TEMPERATURE, top_k=TOP_K,
                                                                          top_p=TOP_P)
    yield "greedy", 256, 128256, dict(temperature=0.0)
    yield f"T{TEMPERATURE} p{TOP_P}", 256, 128256, dict(temperature=TEMPERATURE, top_p=TOP_P)
    yield f"T{TEMPERATURE} min_p{MIN_P}", 256, 128256, dict(temperature=TEMPERATURE, min_p=MIN_P)


def cases(device: torch.device, with_compile: bool = True):
    fs = flashinfer_sampling()
    compiled = maybe_compile(_vllm_sample) if with_compile else None
    compiled_greedy = maybe_compile(_greedy) if with_compile else None
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    # Issue 26: processors and top-5 logprobs beside plain sampling of the same logits, and torch.
    batch, vocab = 256, 128256
    logits = torch.randn(batch, vocab, device=device, generator=gen)
    front = _frontend_inputs(batch, vocab, device, gen)
    shape = f"{batch}x{vocab} T{TEMPERATURE} k{TOP_K} p{TOP_P}"
    nbytes = logits.numel() * logits.element_size() + 8 * batch
    plain = dict(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=1234, step=7)
    full = shape + " +penalties/bias/grammar/top-5 logprobs"
    yield Case("sample", shape + " (plain)", "float32", "logitserve", lambda: sample(logits, **plain), nbytes)
    yield Case("sample", full, "float32", "logitserve", lambda: sample(logits, **plain, **front, logprobs=5), nbytes)
    # The same two calls replayed from CUDA graphs: the full call makes no host synchronisation.
    yield Case("sample", shape + " (plain)", "float32", "logitserve (CUDA graph)",
               _Graphed(lambda: sample(logits, **plain)), nbytes)
    yield Case("sample", full, "float32", "logitserve (CUDA graph)",
               _Graphed(lambda: sample(logits, **plain, **front, logprobs=5)), nbytes)
    t = torch.full((batch,), TEMPERATURE, device=device)
    k = torch.full((batch,), TOP_K, device=device, dtype=torch.long)
    p = torch.full((batch,), TOP_P, device=device)
    yield Case("sample", full, "float32", "torch ops",
               lambda: _torch_frontend(logits, front, t, k, p), nbytes)
    for label, batch, vocab, kw in _configs():
        logits = torch.randn(batch, vocab, device=device, generator=gen)
        nbytes = logits.numel() * logits.element_size() + 8 * batch
        shape = f"{batch}x{vocab} {label}"

        def case(impl, fn):
            return Case("sample", shape, "float32", impl, fn, nbytes)

        yield case("logitserve", lambda x=logits, kw=kw: sample(x, seed=1234, step=7, **kw))
        if kw["temperature"] == 0:
            yield case("torch argmax", lambda x=logits: _greedy(x))
            if compiled_greedy is not None:
                yield case("torch.compile argmax", lambda x=logits: compiled_greedy(x))
            continue
        t = torch.full((batch,), kw["temperature"], device=device)
        k = torch.full((batch,), kw["top_k"], device=device, dtype=torch.long) if "top_k" in kw else None
        p = torch.full((batch,), kw["top_p"], device=device) if "top_p" in kw else None
        mp = torch.full((batch,), kw["min_p"], device=device) if "min_p" in kw else None
        if batch == 256 and "top_k" in kw:
            per_row = dict(temperature=t, top_k=k, top_p=p, seed=torch.arange(batch, device=device), step=7)
            yield case("logitserve per-row tensors", lambda x=logits, kw=per_row: sample(x, **kw))
        yield case("torch sort (vLLM fallback)", lambda x=logits, a=(t, k, p, mp): _vllm_sample(x, *a))
        if compiled is not None:
            yield case("torch.compile", lambda x=logits, a=(t, k, p, mp): compiled(x, *a))
        if fs is None:
            continue
        if "top_k" in kw:
            yield case("flashinfer", lambda x=logits, t=t: fs.top_k_top_p_sampling_from_logits(
                x / t[:, None], TOP_K, TOP_P))
        elif "top_p" in kw:
            yield case("flashinfer (softmax + from_probs)", lambda x=logits, t=t: fs.top_p_sampling_from_probs(
                torch.softmax(x / t[:, None], dim=-1), TOP_P))
        else:
            yield case("flashinfer (softmax + from_probs)", lambda x=logits, t=t: fs.min_p_sampling_from_probs(
                torch.softmax(x / t[:, None], dim=-1), MIN_P))


def check(device: torch.device) -> int:
    """Triton backend against the torch reference at full sizes: token mismatches per config."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    failures = 0
    configs = [dict(temperature=0.8, top_k=50, top_p=0.9), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9),
               dict(temperature=0.8, min_p=0.05), dict(temperature=1.0), dict(temperature=0.7, top_k=500, top_p=0.8),
               dict(temperature=0.8, top_k=50, top_p=0.9, filter_order="joint"),
               dict(temperature=0.8, top_k=20, random_val=0.3)]
    for vocab in (32000, 128256, 151936):
        for scale in (1.0, 6.0):
            logits = torch.randn(64, vocab, device=device, generator=gen) * scale
            for kw in configs:
                steps = torch.arange(64, device=device)
                a = sample(logits, seed=5, step=steps, backend="triton", **kw)
                b = sample(logits, seed=5, step=steps, backend="torch", **kw)
                bad = int((a != b).sum())
                failures += bad > 1
                print(f"check V={vocab} scale={scale} {kw}: {bad} of 64 rows differ", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose 'shape impl' contains this")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    failures = check(device) if args.check else 0
    copy_gbs = print_case_header(device)
    for c in cases(device, with_compile=not args.no_compile):
        if args.only not in f"{c.shape} {c.impl}":
            continue
        if not print_case_row(c, copy_gbs):
            continue
        # (FlashInfer draws a generator: not capturable; a "(CUDA graph)" case replays one already.)
        if args.graphs and "logitserve" in c.impl and not isinstance(c.fn, _Graphed):
            c.fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                c.fn()
            print(f"| {c.shape} | {c.impl} (CUDA graph) | {median_us(graph.replay):.1f} | | |", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
