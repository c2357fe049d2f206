"""topk_softmax (MoE routing) cases: logitserve's kernel, torch eager and torch.compile.

Bytes counted, as BASELINES.md counts them:

    w, i = topk_softmax(x, k)   # reads N*E logits once; writes N*k float32 weights + N*k int32 indices

so ``bytes_moved = N*E*element_size + N*k*(4 + 4)``. At 16384x256 bfloat16, k=8, that is 9.4 MB:
3.1 us at 3.0 TB/s; the op is bound by the top-k selection and, at 64 rows, by launch latency.
"""

from __future__ import annotations

import torch

from logitserve.kernels import topk_softmax

from ..harness import Case, maybe_compile

# (tokens, experts, k): the targets 16384x256 and 64x256 k=8, then the expert counts of
# common MoE models (64 experts top-6: DeepSeek-V2-Lite; 128 and 256 top-8: Qwen3, DeepSeek-V3).
SHAPES = ((16384, 256, 8), (64, 256, 8), (16384, 64, 6), (16384, 128, 8), (16384, 512, 8), (16384, 1024, 8))
DTYPES = (torch.bfloat16, torch.float32)


def _torch_topk_softmax(x: torch.Tensor, k: int):
    # vLLM's eager fallback: float32 softmax, then torch.topk.
    weights, indices = torch.topk(torch.softmax(x, dim=-1, dtype=torch.float32), k, dim=-1)
    return weights, indices.to(torch.int32)


def cases(device: torch.device):
    compiled = maybe_compile(_torch_topk_softmax)
    for dtype in DTYPES:
        for n, e, k in SHAPES:
            x = torch.randn(n, e, device=device, dtype=dtype)
            nbytes = n * e * x.element_size() + n * k * (4 + 4)
            name = str(dtype).removeprefix("torch.")
            shape = f"{n}x{e} k{k}"
            yield Case("topk_softmax", shape, name, "logitserve", lambda x=x, k=k: topk_softmax(x, k), nbytes)
            yield Case("topk_softmax", shape, name, "torch eager", lambda x=x, k=k: _torch_topk_softmax(x, k), nbytes)
            if compiled is not None:
                yield Case("topk_softmax", shape, name, "torch.compile", lambda x=x, k=k: compiled(x, k), nbytes)
