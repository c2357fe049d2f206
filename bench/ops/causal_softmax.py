"""causal_softmax cases: logitserve's kernel, torch eager (mask, then softmax) and torch.compile.

Bytes counted: the whole input read once and the whole output written once,

    y = causal_softmax(x)    # counted: B*S*T elements read + B*S*T elements written

as BASELINES.md counts, so the columns compare. The kernel itself never loads the masked cells
(about half of a square ``[B, S, S]``), so its true floor is lower: B*S*T writes plus the
visible cells' reads, ``B * (S*T - S*(S-1)/2)`` elements (for 32x2048x2048 float16: 403 MB,
134 us at 3.0 TB/s, against the 537 MB counted here).
"""

from __future__ import annotations

import torch

from logitserve.kernels import causal_softmax

from ..harness import Case, maybe_compile

SHAPES = ((32, 2048, 2048), (512, 4, 4096))
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _torch_causal_softmax(t: torch.Tensor) -> torch.Tensor:
    s, n = t.shape[-2:]
    rows = torch.arange(s, device=t.device)[:, None]
    cols = torch.arange(n, device=t.device)[None, :]
    hidden = cols > n - s + rows
    return torch.softmax(t.masked_fill(hidden, float("-inf")), dim=-1)


def cases(device: torch.device):
    compiled = maybe_compile(_torch_causal_softmax)
    for b, s, t in SHAPES:
        for dtype in DTYPES:
            x = torch.randn(b, s, t, device=device, dtype=dtype)
            out = torch.empty_like(x)
            nbytes = 2 * x.numel() * x.element_size()
            name = str(dtype).removeprefix("torch.")
            shape = f"{b}x{s}x{t}"
            yield Case("causal_softmax", shape, name, "logitserve",
                       lambda x=x, out=out: causal_softmax(x, out=out), nbytes)
            yield Case("causal_softmax", shape, name, "torch eager mask+sm", lambda x=x: _torch_causal_softmax(x), nbytes)
            if compiled is not None:
                yield Case("causal_softmax", shape, name, "torch.compile", lambda x=x: compiled(x), nbytes)
