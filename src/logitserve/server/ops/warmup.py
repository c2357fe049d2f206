"""Warm-up: one small call per operator and dtype, through the same launch path as requests."""

from __future__ import annotations

import torch

from ..tensors import HostTensor
from .route_experts import ROUTE_DTYPES, RouteExpertsCall, Router
from .sample import SampleCall
from .tensor_ops import CausalSoftmaxCall, SiluCall, SoftmaxCall
from .verify_draft import VerifyDraftCall

# Draft tokens per row the verifier warms up at (the length is a runtime argument of its kernels).
WARMUP_DRAFT = 4

# Batch sizes warm-up runs at: one of each class Triton specialises an integer on (== 1,
# divisible by 16, neither).
WARMUP_BATCH_ROWS = (1, 2, 16)


def warmup_calls(dtype: torch.dtype, widths: tuple[int, ...]) -> list[tuple[str, object]]:
    """``(label, call)`` pairs that compile every operator for ``dtype`` at row ``widths``.

    Sampling compiles one variant per filter order and one for random_val (the server passes
    every parameter per row, see SampleCall.run_batch). Every op runs at batch sizes 1, 2 and
    16: Triton specialises integer arguments on being 1 and on divisibility by 16, so these
    three cover every batch the batcher can form. Without them a new kernel variant compiled
    mid-traffic (seconds per call).
    """
    gen = torch.Generator().manual_seed(0)
    cases: list[tuple[str, object]] = []
    for w in widths:
        for b in WARMUP_BATCH_ROWS:
            logits = HostTensor.of(torch.randn(b, w, generator=gen).to(dtype))
            seeds = list(range(1, b + 1))
            cases += [
                (f"sample {b}x{w}", SampleCall(logits, 0.8, 50, 0.9, 0.0, seeds, 0, "top_k_first", None)),
                (f"sample joint {b}x{w}", SampleCall(logits, 0.8, 50, 0.9, 0.0, seeds, 0, "joint", None)),
                (f"sample random_val {b}x{w}", SampleCall(logits, 0.8, 50, 0.9, 0.0, seeds, 0, "top_k_first", 0.5)),
                (f"softmax {b}x{w}", SoftmaxCall(logits, 1)),
            ]
            ids = HostTensor.of(torch.randint(0, w, (b, WARMUP_DRAFT), generator=gen))
            target = HostTensor.of(torch.randn(b, WARMUP_DRAFT + 1, w, generator=gen).to(dtype))
            draft = HostTensor.of(torch.randn(b, WARMUP_DRAFT, w, generator=gen).to(dtype))
            values = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.0, draft_temperature=1.0, seed=seeds, step=0)
            # Filtered calls, in each filter order; then calls without filters (their own launch).
            unfiltered = dict(values, top_k=0, top_p=1.0)
            for order, label, v in (("top_k_first", "verify_draft", values), ("joint", "verify_draft joint", values),
                                    ("top_k_first", "verify_draft unfiltered", unfiltered)):
                for from_logits in (False, True):  # a draft's probabilities, or its logits
                    cases.append((f"{label} {'logits' if from_logits else 'probs'} {b}x{w}",
                                  VerifyDraftCall(ids, draft, from_logits, target, v, order)))
    x = HostTensor.of(torch.randn(2, 4, 8, generator=gen).to(dtype))
    cases += [
        ("causal_softmax", CausalSoftmaxCall(x)),
        ("silu", SiluCall(x, None)),
        ("swiglu", SiluCall(x, x)),
    ]
    if dtype in ROUTE_DTYPES:
        for experts, k in ((8, 2), (64, 6), (128, 8), (256, 8)):
            for b in WARMUP_BATCH_ROWS:
                g = HostTensor.of(torch.randn(b, experts, generator=gen).to(dtype))
                cases.append((f"route_experts {b}x{experts} k={k}", RouteExpertsCall(g, k, True)))
        # DeepSeek-V3's router (sigmoid, correction bias, 8 groups keep 4): its own kernel.
        deepseek = Router("sigmoid", bytes(256 * 4), 8, 4, "top2_sum", 2.5)
        for b in WARMUP_BATCH_ROWS:
            g = HostTensor.of(torch.randn(b, 256, generator=gen).to(dtype))
            cases.append((f"route_experts grouped {b}x256 k=8", RouteExpertsCall(g, 8, True, router=deepseek)))
    return cases
