"""verify cases (chain speculative sampling): logitserve against torch and FlashInfer.

Bytes counted (the floor for logits in, which every case but "probs given" takes):

    verify(ids, target_logits, draft_probs=q)   # reads B (n + 1) V target logits, the draft's
                                                # position a (B V), writes B (n + 1) int64

so ``bytes_moved = B (n + 1) V e + B V e_q + 8 B (n + 1)``: at B = 128, n = 8, V = 128256 float32
about 722 MB, 240 us at the H100's 3.0 TB/s copy bandwidth.

Inputs: target logits ``randn * 2``; draft logits ``0.8 * target + 0.6 * randn`` (a draft that
mostly agrees, so rows accept a few tokens each), ``q = softmax(draft logits)`` and the draft's
tokens drawn from it, all made outside the timed region. The cases, all temperature 1 with no
filter (FlashInfer has none):

- ``logitserve``: ``verify`` on the target logits and ``q``;
- ``logitserve (draft logits)``: the draft as logits instead of ``q`` (its softmax inside);
- ``torch``: the same semantics in torch operations (softmax of the target, gathers, the
  residual's exponential race);
- ``flashinfer + softmax``: ``flashinfer.sampling.chain_speculative_sampling`` with the target's
  softmax counted (what a frontend holding logits pays);
- ``flashinfer (probs given)``: the same with the target probabilities made outside the timed
  region: its kernel alone, on inputs logitserve never needs.

A last case times logitserve with the target's filters (T 0.8, top-k 50, top-p 0.9).

    python -m bench.ops.verify [--only SUBSTRING] [--check]

``--check`` first compares the Triton backend with the torch reference at full size.
"""

from __future__ import annotations

import argparse
import sys

import torch

from logitserve.kernels import verify

from ..harness import Case, flashinfer_sampling, print_case_header, print_case_row

BATCHES = (32, 128)
DRAFTS = (4, 8)
VOCAB = 128256


def _inputs(batch: int, n: int, vocab: int, device: torch.device, gen: torch.Generator):
    target = torch.randn(batch, n + 1, vocab, device=device, generator=gen) * 2
    draft_logits = 0.8 * target[:, :n] + 0.6 * torch.randn(batch, n, vocab, device=device, generator=gen)
    q = torch.softmax(draft_logits, -1)
    ids = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, n)
    return ids, target, draft_logits, q


def _torch_verify(ids: torch.Tensor, target: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Chain speculative sampling in torch operations, temperature 1, no filter: token ids [B, n + 1]."""
    batch, n = ids.shape
    p = torch.softmax(target, -1)
    p_d = p[:, :n].gather(-1, ids[:, :, None])[:, :, 0]
    q_d = q.gather(-1, ids[:, :, None])[:, :, 0]
    accept = torch.rand_like(q_d) * q_d < p_d
    a = torch.cumprod(accept.to(torch.int64), 1).sum(1)
    rows = torch.arange(batch, device=ids.device)
    p_a = p[rows, a]
    q_a = torch.where((a < n)[:, None], q[rows, a.clamp(max=n - 1)], 0.0)
    residual = (p_a - q_a).clamp(min=0)
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_a)
    emitted = (residual / torch.empty_like(residual).exponential_()).argmax(1)
    positions = torch.arange(n + 1, device=ids.device)[None, :]
    padded = torch.cat([ids, ids[:, :1]], 1)
    tokens = torch.where(positions < a[:, None], padded, -1)
    return torch.where(positions == a[:, None], emitted[:, None], tokens)


def cases(device: torch.device):
    fs = flashinfer_sampling()
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    for batch in BATCHES:
        for n in DRAFTS:
            ids, target, draft_logits, q = _inputs(batch, n, VOCAB, device, gen)
            nbytes = (batch * (n + 1) * VOCAB + batch * VOCAB) * 4 + 8 * batch * (n + 1)
            shape = f"B{batch} n{n} V{VOCAB}"

            def case(impl, fn, shape=shape, nbytes=nbytes):
                return Case("verify", shape, "float32", impl, fn, nbytes)

            steps = torch.arange(batch, device=device)
            yield case("logitserve", lambda a=(ids, target, q), s=steps: verify(a[0], a[1], draft_probs=a[2], seed=7,
                                                                                   step=s))
            yield case("logitserve (draft logits)",
                       lambda a=(ids, target, draft_logits), s=steps: verify(a[0], a[1], draft_logits=a[2], seed=7,
                                                                             step=s))
            yield case("torch", lambda a=(ids, target, q): _torch_verify(*a))
            if fs is not None:
                ids32 = ids.to(torch.int32)
                probs = torch.softmax(target, -1)
                yield case("flashinfer + softmax", lambda a=(q, ids32, target): fs.chain_speculative_sampling(
                    a[0], a[1], torch.softmax(a[2], -1)))
                yield case("flashinfer (probs given)", lambda a=(q, ids32, probs): fs.chain_speculative_sampling(*a))
    ids, target, _, q = _inputs(128, 4, VOCAB, device, gen)
    nbytes = (128 * 5 * VOCAB + 128 * VOCAB) * 4 + 8 * 128 * 5
    yield Case("verify", f"B128 n4 V{VOCAB} T0.8 k50 p0.9", "float32", "logitserve",
               lambda: verify(ids, target, draft_probs=q, temperature=0.8, top_k=50, top_p=0.9, seed=7), nbytes)


def check(device: torch.device) -> int:
    """Triton backend against the torch reference at full size: rows that differ per config."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    failures = 0
    ids, target, draft_logits, q = _inputs(32, 4, VOCAB, device, gen)
    steps = torch.arange(32, device=device)
    for kw in (dict(), dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.9), dict(top_p=0.9),
               dict(min_p=0.05), dict(top_k=400, filter_order="joint")):
        got = verify(ids, target, draft_probs=q, seed=3, step=steps, backend="triton", **kw)
        want = verify(ids.cpu(), target.cpu(), draft_probs=q.cpu(), seed=3, step=steps.cpu(), backend="torch", **kw)
        bad = int((got.token_ids.cpu() != want.token_ids).any(1).sum())
        failures += bad > 1
        print(f"check {kw}: {bad} of 32 rows differ; accepted {got.num_accepted.float().mean():.2f} a row",
              flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose 'shape impl' contains this")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    failures = check(device) if args.check else 0
    copy_gbs = print_case_header(device)
    for c in cases(device):
        if args.only not in f"{c.shape} {c.impl}":
            continue
        print_case_row(c, copy_gbs)
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
