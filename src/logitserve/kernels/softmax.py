"""Softmax along any axis of any tensor: the plan (layout to launch) and the function.

The plan collapses the tensor's dims into the kernel's ``[outer..., position, reduce]`` view
(``softmax_kernel.py`` holds the kernel, its tiles and modes); layouts with more than three outer
dims after merging loop over the extra ones on the host.
"""

from __future__ import annotations

import torch

from ._backend import resolve_backend
from ._plan import (FLOAT_DTYPES, TensorSpec, check_dtype, check_out_aliasing, check_out_like_x, check_tensor,
                    plan_cache)
from .reference import softmax as reference
from .softmax_kernel import SoftmaxLaunch


def _collapse(dims: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge neighbouring ``(size, x_stride, out_stride)`` dims that address memory as one dim would."""
    merged: list[tuple[int, int, int]] = []
    for size, xs, os in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == xs * size and merged[-1][2] == os * size:
            prev = merged.pop()
            merged.append((prev[0] * size, xs, os))
        else:
            merged.append((size, xs, os))
    return merged


class SoftmaxPlan:
    """Softmax along ``dim`` of a tensor of any rank and strides: ``exp(x - max) / sum(exp(x - max))``.

    Parameters
    ----------
    x : TensorSpec
        Input layout: any shape (0-d included) and strides; float16, bfloat16, float32 or float64.
    out : TensorSpec, optional
        Output layout: same shape, dtype and device as ``x``, any strides that do not overlap
        themselves (``x`` itself for in place). ``None`` means the same layout as ``x``.
    dim : int
        The axis to normalise, negative counting from the end.
    backend : str
        ``"auto"``, ``"triton"``, ``"interpret"`` or ``"torch"``.
    max_block : int, optional
        Cap on the reduce-axis elements one program holds (default: whole rows up to
        ``WHOLE_ROW_MAX``, then ``SPLIT_BLOCK`` chunks; ``softmax_kernel.py``); wider axes are
        split across programs. For tests (small shapes on the split path) and tuning.
    cooperative : bool
        Whether split axes may use the single cooperative launch (True, the fast path) or must
        use the stats-then-apply pair of launches. For tests and benchmarks.

    Computes in float32 (float64 for float64 input). A row whose entries are all ``-inf``, or
    that holds a NaN or ``+inf``, comes out NaN, as ``torch.softmax`` gives.

    Example
    -------
    >>> x = torch.randn(4, 128256, device="cuda", dtype=torch.bfloat16)
    >>> plan = SoftmaxPlan(TensorSpec.of(x), dim=-1)
    >>> out = torch.empty_like(x)
    >>> plan(x, out)
    """

    def __init__(self, x: TensorSpec, out: TensorSpec | None = None, *, dim: int = -1, backend: str = "auto",
                 max_block: int | None = None, cooperative: bool = True):
        check_dtype("x", x.dtype, FLOAT_DTYPES)
        out = x if out is None else out
        check_out_like_x(out, x)
        rank = max(x.ndim, 1)
        if not -rank <= dim < rank:
            raise ValueError(f"dim: must be in [{-rank}, {rank - 1}] for a {x.ndim}-d x, got {dim}")
        if max_block is not None and (max_block < 1 or max_block & (max_block - 1)):
            raise ValueError(f"max_block: must be a power of two >= 1, got {max_block}")
        self.x, self.out, self.dim = x, out, dim % rank
        self.backend = resolve_backend(backend, x.device)
        self.workspace_size = 0
        self.launch = None
        self.lead: list[tuple[int, int, int]] = []
        if self.backend == "torch" or x.numel() == 0:
            return
        shape, xs, os = (x.shape, x.strides, out.strides) if x.ndim else ((1,), (1,), (1,))
        d = self.dim
        batch = _collapse([(shape[i], xs[i], os[i]) for i in range(len(shape)) if i != d])
        if batch:
            # The position dim is the one with the smallest input stride: the contiguous one.
            p = min(range(len(batch)), key=lambda i: (abs(batch[i][1]), -i))
            pos = batch.pop(p)
        else:
            pos = (1, 0, 0)
        # The kernel indexes three outer dims; rarer layouts loop over the rest here.
        self.lead, outer = batch[:-3], batch[-3:]
        self.launch = SoftmaxLaunch(outer, pos, (shape[d], xs[d], os[d]), x.dtype, x.device, self.backend,
                                    max_block=max_block, cooperative=cooperative)
        self.workspace_size = self.launch.workspace_size

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return reference.softmax(x, self.dim, out=out)
        if self.launch is None:
            return out
        if not self.lead:
            self.launch(x, out)
            return out
        for index in _lead_indices(self.lead):
            x_off = sum(i * st for i, (_, st, _) in zip(index, self.lead))
            out_off = sum(i * st for i, (_, _, st) in zip(index, self.lead))
            self.launch(x.as_strided((1,), (1,), x.storage_offset() + x_off),
                        out.as_strided((1,), (1,), out.storage_offset() + out_off))
        return out


def _lead_indices(dims: list[tuple[int, int, int]]):
    if not dims:
        yield ()
        return
    for i in range(dims[0][0]):
        for rest in _lead_indices(dims[1:]):
            yield (i, *rest)


_cached_plan = plan_cache(SoftmaxPlan)


def prepare_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The functions' ``out``: a new tensor laid out like ``x``, or the caller's, checked."""
    check_tensor("x", x)
    if out is None:
        return torch.empty_like(x)
    check_tensor("out", out)
    check_out_aliasing(out, "x", x)
    return out


def softmax(x: torch.Tensor, dim: int = -1, *, out: torch.Tensor | None = None,
            backend: str = "auto") -> torch.Tensor:
    """Softmax of ``x`` along ``dim``, computed in float32 (float64 for float64 input).

    Parameters
    ----------
    x : torch.Tensor
        Any shape and strides; float16, bfloat16, float32 or float64.
    dim : int
        The axis to normalise (negative counts from the end).
    out : torch.Tensor, optional
        Where to write, shaped and typed as ``x``; may be ``x`` itself (in place).
    backend : str
        ``"auto"`` (triton on CUDA, torch on CPU), ``"triton"``, ``"interpret"`` or ``"torch"``.

    Returns
    -------
    torch.Tensor
        ``out``, or a new tensor laid out like ``x``.

    Example
    -------
    >>> probs = softmax(torch.randn(2, 32000, device="cuda"))
    """
    out = prepare_out(x, out)
    plan = _cached_plan(TensorSpec.of(x), TensorSpec.of(out), dim=dim, backend=backend)
    return plan(x, out)
