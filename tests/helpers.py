"""Assertions and input makers shared by the tests."""

from __future__ import annotations

import torch

# (atol, rtol) per input dtype against a float64 reference. Output in the input dtype, so the
# bound is the dtype's rounding (bf16: 8 bits of mantissa, half an ulp is 2**-9 relative).
TOLERANCES = {
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (4e-3, 1.6e-2),
    torch.float32: (1e-6, 1e-5),
    torch.float64: (1e-12, 1e-10),
}


def seeded_logits(rows: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Logits ``[rows, vocab]`` of standard deviation 3 from ``seed``: the same on every call."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 3).to(dtype)


def wide_row_rtol(dtype: torch.dtype, width: int) -> float | None:
    """The rtol for a softmax over rows of ``width``: a float32 sum over ~100K terms carries more
    rounding than float32's default 1e-5 allows (the torch backend gave 1.4e-5 relative on a
    151936-wide row, 1.8e-5 on a 128256-wide one); None keeps the dtype's default."""
    return 4e-5 if dtype == torch.float32 and width > 65536 else None


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
                 atol: float | None = None, rtol: float | None = None, what: str = "output") -> None:
    """Compare elementwise; on failure report how many elements miss and the first few."""
    dtype = dtype or actual.dtype
    d_atol, d_rtol = TOLERANCES.get(dtype, (0.0, 0.0))
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (a == e)
    ok = both_nan | same_inf | ((a - e).abs() <= atol + rtol * e.abs())
    if not bool(ok.all()):
        bad = (~ok).nonzero()
        first = ", ".join(
            f"{tuple(i.tolist())}: got {a[tuple(i)].item():.6g} want {e[tuple(i)].item():.6g}" for i in bad[:5])
        raise AssertionError(f"{what}: {bad.shape[0]} of {a.numel()} elements differ "
                             f"(atol={atol}, rtol={rtol}); first: {first}")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN (or -7 for integers) so an element the kernel skips shows up."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-7)


def strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as ``t`` in a view whose last dim has ``pad`` unused columns per row."""
    big = torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)
    poison(big)
    view = big[..., : t.shape[-1]]
    view.copy_(t)
    return view
