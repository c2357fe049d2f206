"""Causal softmax: each row's softmax over the columns it may see, zeros over the rest.

``x`` is ``[S, T]`` or ``[B, S, T]`` with ``T >= S``; row ``i`` sees the columns
``j <= T - S + i``, the mask aligned to the bottom right as in InfiniCore's kernel condition
``width + row >= col + height`` (the last query row sees every key, as in decoding with a KV
cache). The kernel is the softmax kernel (``kernels/softmax.py``) with its ``CAUSAL`` switch:
masked cells are written as 0 but never loaded, so a ``[32, 2048, 2048]`` call reads about half
the tensor and writes all of it. Loads stop at the 8-element vector holding the diagonal
(``LOAD_ALIGN``): those few extra cells lie in the same 32-byte sectors as visible ones, so no
extra memory traffic, and they keep the loads vectorised.
"""

from __future__ import annotations

import torch

from ._backend import resolve_backend
from ._plan import FLOAT_DTYPES, TensorSpec, check_dtype, check_out_like_x, plan_cache
from .reference import causal_softmax as reference
from .softmax import prepare_out
from .softmax_kernel import SoftmaxLaunch

# Elements per vector load on the causal boundary: 8 (16 bytes of float16/bfloat16). 1 would
# read exactly the visible cells, but with unvectorised loads, which ran slower on the H100.
LOAD_ALIGN = 8


class CausalSoftmaxPlan:
    """Softmax over each row's visible columns ``j <= T - S + i``; masked outputs exactly 0.

    Parameters
    ----------
    x : TensorSpec
        Input layout ``(seq_len, total_len)`` or ``(batch_size, seq_len, total_len)``, any
        strides, ``total_len >= seq_len``; float16, bfloat16, float32 or float64.
    out : TensorSpec, optional
        Output layout, same shape, dtype and device as ``x`` (``x`` itself for in place);
        ``None`` means the same layout as ``x``.
    backend : str
        ``"auto"``, ``"triton"``, ``"interpret"`` or ``"torch"``.
    max_block, cooperative :
        As for :class:`~logitserve.kernels.softmax.SoftmaxPlan` (tests and tuning).
    load_align : int
        Loads stop at the ``load_align``-element vector holding each row's diagonal (default
        ``LOAD_ALIGN``); 1 loads exactly the visible cells, unvectorised (tests and tuning).

    Example
    -------
    >>> scores = torch.randn(32, 2048, 2048, device="cuda", dtype=torch.float16)
    >>> plan = CausalSoftmaxPlan(TensorSpec.of(scores))
    >>> plan(scores, scores)  # in place
    """

    def __init__(self, x: TensorSpec, out: TensorSpec | None = None, *, backend: str = "auto",
                 max_block: int | None = None, cooperative: bool = True, load_align: int = LOAD_ALIGN):
        check_dtype("x", x.dtype, FLOAT_DTYPES)
        if x.ndim not in (2, 3):
            raise ValueError(f"x: must be [S, T] or [B, S, T], got {x.ndim}-d shape {x.shape}")
        s, t = x.shape[-2:]
        if t < s:
            raise ValueError(f"x: the last dim T must be >= the dim before it S (T >= S), got S={s}, T={t}")
        out = x if out is None else out
        check_out_like_x(out, x)
        if max_block is not None and (max_block < 1 or max_block & (max_block - 1)):
            raise ValueError(f"max_block: must be a power of two >= 1, got {max_block}")
        self.x, self.out = x, out
        self.backend = resolve_backend(backend, x.device)
        self.workspace_size = 0
        self.launch = None
        if self.backend == "torch" or x.numel() == 0:
            return
        dims = list(zip(x.shape, x.strides, out.strides))
        self.launch = SoftmaxLaunch(dims[:-2], dims[-2], dims[-1], x.dtype, x.device, self.backend,
                                    causal=True, max_block=max_block, cooperative=cooperative,
                                    load_align=load_align)
        self.workspace_size = self.launch.workspace_size

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            return reference.causal_softmax(x, out=out)
        if self.launch is not None:
            self.launch(x, out)
        return out


_cached_plan = plan_cache(CausalSoftmaxPlan)


def causal_softmax(x: torch.Tensor, *, out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Causal softmax of ``x`` ``(seq_len, total_len)`` or ``(batch_size, seq_len, total_len)``.

    Row ``i`` is normalised over its columns ``j <= total_len - seq_len + i`` (computed in
    float32, float64 for float64 input); every other cell of ``out`` is exactly 0.

    Parameters
    ----------
    x : torch.Tensor
        Scores, ``total_len >= seq_len``, any strides; float16, bfloat16, float32 or float64.
    out : torch.Tensor, optional
        Where to write, shaped and typed as ``x``; may be ``x`` itself (in place).
    backend : str
        ``"auto"`` (triton on CUDA, torch on CPU), ``"triton"``, ``"interpret"`` or ``"torch"``.

    Example
    -------
    >>> probs = causal_softmax(torch.randn(8, 4, 4096, device="cuda", dtype=torch.bfloat16))
    """
    out = prepare_out(x, out)
    plan = _cached_plan(TensorSpec.of(x), TensorSpec.of(out), backend=backend)
    return plan(x, out)
