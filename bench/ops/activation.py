"""silu and swiglu cases: logitserve's kernels, torch eager and torch.compile at 16384x14336.

Bytes counted, each input read once and the output written once:

    y = silu(x)          # M*N elements read + M*N written:      2 * M*N * element_size
    y = swiglu(g, u)     # 2 * M*N elements read + M*N written:  3 * M*N * element_size

At 16384x14336 bfloat16 swiglu moves 1.41 GB: 470 us at 3.0 TB/s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from logitserve.kernels import silu, swiglu

from ..harness import Case, maybe_compile

SHAPE = (16384, 14336)  # tokens x the FFN width of Llama-3-8B
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def cases(device: torch.device):
    compiled_swiglu = maybe_compile(_torch_swiglu)
    compiled_silu = maybe_compile(F.silu)
    m, n = SHAPE
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        shape = f"{m}x{n}"
        gate = torch.randn(m, n, device=device, dtype=dtype)
        up = torch.randn(m, n, device=device, dtype=dtype)
        out = torch.empty_like(gate)
        elem = gate.element_size()
        silu_bytes, swiglu_bytes = 2 * m * n * elem, 3 * m * n * elem
        yield Case("silu", shape, name, "logitserve", lambda g=gate, o=out: silu(g, out=o), silu_bytes)
        yield Case("silu", shape, name, "torch eager", lambda g=gate: F.silu(g), silu_bytes)
        if compiled_silu is not None:
            yield Case("silu", shape, name, "torch.compile", lambda g=gate: compiled_silu(g), silu_bytes)
        yield Case("swiglu", shape, name, "logitserve", lambda g=gate, u=up, o=out: swiglu(g, u, out=o), swiglu_bytes)
        yield Case("swiglu", shape, name, "torch eager", lambda g=gate, u=up: _torch_swiglu(g, u), swiglu_bytes)
        if compiled_swiglu is not None:
            yield Case("swiglu", shape, name, "torch.compile", lambda g=gate, u=up: compiled_swiglu(g, u), swiglu_bytes)
