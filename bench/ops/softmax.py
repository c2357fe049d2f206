"""softmax cases: logitserve's kernel, torch eager and torch.compile at the target shapes.

Bytes counted (Triton tutorial 02's floor, as in docs and BASELINES.md):

    y = softmax(x, dim=-1)   # reads M*N elements of x once, writes M*N elements of y once

so ``bytes_moved = 2 * M * N * element_size`` whatever an implementation actually moves (a
two-pass softmax reads x twice and scores lower for it).
"""

from __future__ import annotations

import torch

from logitserve.kernels import softmax

from ..harness import Case, maybe_compile

SHAPES = ((256, 128256), (8192, 4096), (32768, 512))
DTYPES = (torch.float32, torch.bfloat16)


def _torch_softmax(t: torch.Tensor) -> torch.Tensor:
    return torch.softmax(t, dim=-1)


def cases(device: torch.device):
    compiled = maybe_compile(_torch_softmax)
    for m, n in SHAPES:
        for dtype in DTYPES:
            x = torch.randn(m, n, device=device, dtype=dtype)
            out = torch.empty_like(x)
            nbytes = 2 * x.numel() * x.element_size()
            name = str(dtype).removeprefix("torch.")
            shape = f"{m}x{n}"
            yield Case("softmax", shape, name, "logitserve", lambda x=x, out=out: softmax(x, out=out), nbytes)
            yield Case("softmax", shape, name, "torch eager", lambda x=x: _torch_softmax(x), nbytes)
            if compiled is not None:
                yield Case("softmax", shape, name, "torch.compile", lambda x=x: compiled(x), nbytes)
