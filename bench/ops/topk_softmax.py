"""topk_softmax (MoE routing) cases: logitserve's kernel, torch eager and torch.compile.

Bytes counted, as BASELINES.md counts them:

    w, i = topk_softmax(x, k)   # reads N*E logits once; writes N*k float32 weights + N*k int32 indices

so ``bytes_moved = N*E*element_size + N*k*(4 + 4)``. At 16384x256 bfloat16, k=8, that is 9.4 MB:
3.1 us at 3.0 TB/s; the op is bound by the top-k selection and, at 64 rows, by launch latency.

``route_experts grouped``: DeepSeek-V3's router (sigmoid, correction bias, 8 groups keep 4 by
their two best biased scores, k=8, renormalize, scaling 2.5) at 16384x256 bfloat16 (target
<= 20 us on the H100), beside a torch implementation of the same semantics (vLLM's eager
``grouped_topk``, with the dropped experts at -inf) and, where its wheels are installed,
FlashInfer's DeepSeek-V3 routing kernel (``flashinfer.fused_moe.NoAuxTc``; it takes the bias in
the logits' dtype, so its bias is the float32 one rounded to bfloat16, and writes its weights in
that dtype too); the bias's 1 KB is not counted.
"""

from __future__ import annotations

import torch

from logitserve.kernels import route_experts, topk_softmax

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
    yield from grouped_cases(device)


# DeepSeek-V3's router: the issue 27 target 16384x256 bfloat16, k=8, n_group=8, topk_group=4.
GROUPED = dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)
GROUPED_SHAPES = ((16384, 256, 8), (64, 256, 8))


def _torch_grouped_topk(x: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 8, topk_group: int = 4,
                        scale: float = 2.5):
    # route_experts' semantics in torch ops: sigmoid scores, biased for selection, groups by the
    # sum of their two best biased scores, top-k among the kept groups, unbiased weights.
    scores = torch.sigmoid(x.float())
    biased = scores + bias
    n, e = x.shape
    groups = biased.view(n, n_group, -1).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros_like(groups).scatter_(1, groups.topk(topk_group, dim=-1, sorted=False).indices, 1.0)
    mask = kept.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    indices = biased.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1).indices
    weights = scores.gather(1, indices)
    weights = weights / weights.sum(-1, keepdim=True) * scale
    return weights, indices.to(torch.int32)


def _flashinfer_grouped(k: int):
    """FlashInfer's DeepSeek-V3 router writing into outputs made once, or None without FlashInfer."""
    try:
        from flashinfer.fused_moe import NoAuxTc
    except ImportError:
        return None

    def route(x, bias, out):
        NoAuxTc(x, bias, GROUPED["n_group"], GROUPED["topk_group"], k, GROUPED["routed_scaling_factor"], *out)
        return out

    return route


def grouped_cases(device: torch.device):
    compiled = maybe_compile(_torch_grouped_topk)
    for n, e, k in GROUPED_SHAPES:
        x = torch.randn(n, e, device=device, dtype=torch.bfloat16)
        bias = torch.randn(e, device=device, dtype=torch.float32) * 0.1
        nbytes = n * e * x.element_size() + n * k * (4 + 4)
        shape = f"{n}x{e} k{k} g8/4"
        yield Case("route_experts grouped", shape, "bfloat16", "logitserve",
                   lambda x=x, b=bias, k=k: route_experts(x, k, correction_bias=b, **GROUPED), nbytes)
        yield Case("route_experts grouped", shape, "bfloat16", "torch eager",
                   lambda x=x, b=bias, k=k: _torch_grouped_topk(x, b, k), nbytes)
        if compiled is not None:
            yield Case("route_experts grouped", shape, "bfloat16", "torch.compile",
                       lambda x=x, b=bias, k=k: compiled(x, b, k), nbytes)
        flashinfer = _flashinfer_grouped(k)
        if flashinfer is not None:
            # NoAuxTc writes its weights in the logits' dtype (it refuses float32 outputs for them).
            out = (torch.empty(n, k, device=device, dtype=x.dtype), torch.empty(n, k, device=device, dtype=torch.int32))
            yield Case("route_experts grouped", shape, "bfloat16", "FlashInfer NoAuxTc",
                       lambda x=x, b=bias.to(x.dtype), out=out: flashinfer(x, b, out), nbytes)
