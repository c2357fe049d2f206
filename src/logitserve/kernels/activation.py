"""SiLU and SwiGLU: one elementwise, bandwidth-bound launch each.

The output's shape is the broadcast of the inputs. Every operand's strides are expanded to
that shape (stride 0 on broadcast dims), the dims are put in the order of the output's strides
(so a transposed output walks memory in order), size-1 dims are dropped, and neighbours merge
wherever every operand allows. What is left picks the kernel:

- at most one dim with unit strides everywhere: the flat kernel (1-D blocks, vector loads);
- at most ``MAX_RANK`` (4) dims: the strided kernel, tiles of (outer dims merged into rows) x
  (the innermost dim), each operand with its own strides;
- more: ``ValueError`` (no transpose or broadcast of real tensors gets there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import launchable, resolve_backend
from ._plan import FLOAT_DTYPES, TensorSpec, check_dtype, check_out_aliasing, check_same_device, check_tensor, plan_cache
from .reference import activation as reference

MAX_RANK = 4


@triton.jit
def _silu_times_up(x, up, HAS_UP: tl.constexpr, F64: tl.constexpr):
    if F64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    # silu(x) = x * sigmoid(x) = x / (1 + exp(-x)) (Elfwing et al., arXiv:1702.03118), in the
    # division form of torch's kernel so that silu(-inf) = -inf / inf = nan, as torch gives.
    y = x / (1.0 + tl.exp(-x))
    if HAS_UP:
        # swiglu(gate, up) = silu(gate) * up (Shazeer, arXiv:2002.05202)
        y = y * up.to(y.dtype)
    return y


@launchable
@triton.jit
def _activation_flat_kernel(
    out_ptr, x_ptr, up_ptr,
    n_elements,
    HAS_UP: tl.constexpr, F64: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_UP:
        up = tl.load(up_ptr + offs, mask=mask, other=0.0)
    else:
        up = x
    y = _silu_times_up(x, up, HAS_UP, F64)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@launchable
@triton.jit
def _activation_strided_kernel(
    out_ptr, x_ptr, up_ptr,
    size1, size2, n_rows, n_cols,
    out_s0, out_s1, out_s2, out_s3,
    x_s0, x_s1, x_s2, x_s3,
    up_s0, up_s1, up_s2, up_s3,
    HAS_UP: tl.constexpr, F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Shape [size0, size1, size2, n_cols]: rows are (i0, i1, i2) flattened, columns dim 3.
    pid = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(n_cols, BLOCK_C)
    rows = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    i2 = rows % size2
    i1 = (rows // size2) % size1
    i0 = rows // size2 // size1
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x_offs = (i0 * x_s0 + i1 * x_s1 + i2 * x_s2)[:, None] + cols[None, :] * x_s3
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_UP:
        up_offs = (i0 * up_s0 + i1 * up_s1 + i2 * up_s2)[:, None] + cols[None, :] * up_s3
        up = tl.load(up_ptr + up_offs, mask=mask, other=0.0)
    else:
        up = x
    y = _silu_times_up(x, up, HAS_UP, F64)
    out_offs = (i0 * out_s0 + i1 * out_s1 + i2 * out_s2)[:, None] + cols[None, :] * out_s3
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def flat_block_settings() -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` of the flat kernel: 2048 elements over 8 warps.

    8 elements a thread: one 16-byte load per operand in 16-bit dtypes. On the H100 every block
    from 1024 to 8192 runs within 2% of the others, at about the device's copy bandwidth.
    """
    return 2048, 8


def strided_block_settings(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)`` of the strided kernel: tiles of 2048 elements, 4 warps.

    As wide as the innermost dim allows (up to 2048 columns, coalesced when its stride is 1),
    the rest of the 2048 in rows: the fastest tile of an H100 sweep over widths, tile sizes and
    warps (larger tiles ran slower).
    """
    block_c = min(triton.next_power_of_2(n_cols), 2048)
    block_r = min(max(1, 2048 // block_c), triton.next_power_of_2(n_rows))
    return block_r, block_c, 4


def _expanded_strides(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``spec``'s strides broadcast to ``shape``: 0 on dims it lacks or has at size 1."""
    lead = len(shape) - spec.ndim
    return tuple(0 if d < lead or spec.shape[d - lead] == 1 else spec.strides[d - lead] for d in range(len(shape)))


def _dense_strides_like(shape: tuple[int, ...], strides: tuple[int, ...] | None) -> tuple[int, ...]:
    """Dense strides for ``shape``, dims laid out in the order of ``strides`` (as empty_like) or C order."""
    order = sorted(range(len(shape)), key=lambda d: -strides[d]) if strides else range(len(shape))
    out = [0] * len(shape)
    step = 1
    for d in reversed(order):
        out[d] = step
        step *= max(shape[d], 1)
    return tuple(out)


def _non_overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when no two indices of the layout address the same element."""
    extent = 1
    for size, stride in sorted(((sz, st) for sz, st in zip(shape, strides) if sz > 1), key=lambda p: p[1]):
        if stride < extent:
            return False
        extent = stride * size
    return True


def _merge_dims(shape, operand_strides):
    """Drop size-1 dims, order by the first operand's strides, merge neighbours every operand allows."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -operand_strides[0][d])
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in operand_strides]
    for d in dims:
        if sizes and all(m[-1] == s[d] * shape[d] for m, s in zip(merged, operand_strides)):
            sizes[-1] *= shape[d]
            for m, s in zip(merged, operand_strides):
                m[-1] = s[d]
        else:
            sizes.append(shape[d])
            for m, s in zip(merged, operand_strides):
                m.append(s[d])
    return sizes, merged


class _ActivationPlan:
    """What SiluPlan and SwigluPlan share: validation, layout merging, kernel choice, launch."""

    def __init__(self, inputs: tuple[tuple[str, TensorSpec], ...], out: TensorSpec | None, backend: str):
        (name0, first), rest = inputs[0], inputs[1:]
        check_dtype(name0, first.dtype, FLOAT_DTYPES)
        shape = first.shape
        for name, spec in rest:
            if spec.dtype != first.dtype:
                raise TypeError(f"{name}: dtype must match {name0} ({_dtype_name(first.dtype)}), "
                                f"got {_dtype_name(spec.dtype)}")
            check_same_device(name, spec, first.device)
            try:
                shape = tuple(torch.broadcast_shapes(shape, spec.shape))
            except RuntimeError:
                raise ValueError(f"{name0} and {name}: shapes {first.shape} and {spec.shape} do not broadcast") from None
        if out is None:
            full = next((spec for _, spec in inputs if spec.shape == shape), None)
            out_strides = _dense_strides_like(shape, full.strides if full else None)
        else:
            if out.dtype != first.dtype:
                raise TypeError(f"out: dtype must be {_dtype_name(first.dtype)} (the input dtype), "
                                f"got {_dtype_name(out.dtype)}")
            check_same_device("out", out, first.device)
            if out.shape != shape:
                raise ValueError(f"out: shape must be {shape} (the {'broadcast of the inputs' if rest else 'input shape'}), "
                                 f"got {out.shape}")
            if not _non_overlapping(out.shape, out.strides):
                raise ValueError(f"out: elements must not overlap in memory, got strides {out.strides} for shape {out.shape}")
            out_strides = out.strides
        sizes, strides = _merge_dims(shape, [out_strides] + [_expanded_strides(s, shape) for _, s in inputs])
        if len(sizes) > MAX_RANK:
            raise ValueError(f"{name0}: layout needs {len(sizes)} dims after merging contiguous ones "
                             f"(shape {shape}); the strided kernel supports at most {MAX_RANK}")
        self.shape = shape
        self.out_strides = out_strides
        self.dtype = first.dtype
        self.numel = TensorSpec(shape, out_strides, first.dtype, first.device).numel()
        self.backend = resolve_backend(backend, first.device)
        self.workspace_size = 0
        if self.backend == "torch" or self.numel == 0:
            self.kernel = None  # the torch reference, or nothing to launch
            return
        meta = dict(HAS_UP=bool(rest), F64=first.dtype == torch.float64)
        if len(sizes) <= 1 and all(s == [1] or s == [] for s in strides):
            block, self.num_warps = flat_block_settings()
            self.kernel = _activation_flat_kernel.for_backend(self.backend)
            self.grid = (triton.cdiv(self.numel, block),)
            self.args = (self.numel,)
            self.meta = dict(meta, BLOCK_SIZE=block)
            return
        pad = MAX_RANK - len(sizes)
        sizes = [1] * pad + sizes
        strides = [[0] * pad + s for s in strides]
        if not rest:
            strides.append(strides[1])  # up_ptr gets x: its strides, never read
        n_rows = sizes[0] * sizes[1] * sizes[2]
        block_r, block_c, self.num_warps = strided_block_settings(n_rows, sizes[3])
        self.kernel = _activation_strided_kernel.for_backend(self.backend)
        self.grid = (triton.cdiv(n_rows, block_r) * triton.cdiv(sizes[3], block_c),)
        self.args = (sizes[1], sizes[2], n_rows, sizes[3], *strides[0], *strides[1], *strides[2])
        self.meta = dict(meta, BLOCK_R=block_r, BLOCK_C=block_c)

    def _run(self, x: torch.Tensor, up: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            out = torch.empty_strided(self.shape, self.out_strides, dtype=self.dtype, device=x.device)
        if self.numel == 0:
            return out
        if self.kernel is None:
            out.copy_(reference.silu(x) if up is None else reference.swiglu(x, up))
            return out
        self.kernel[self.grid](out, x, x if up is None else up, *self.args, num_warps=self.num_warps, **self.meta)
        return out


class SiluPlan(_ActivationPlan):
    """``silu(x) = x * sigmoid(x)`` elementwise, for one layout of ``x`` (and of ``out``).

    Parameters
    ----------
    x : TensorSpec
        Any shape and strides; float16, bfloat16, float32 or float64.
    out : TensorSpec, optional
        Same shape and dtype as ``x``, non-overlapping; may be ``x`` itself (in place). Without
        it the call allocates an output laid out like ``x``.
    backend : str
        ``"auto"``, ``"triton"``, ``"interpret"`` or ``"torch"``.

    Math is float32 (float64 for float64). Extremes follow torch: ``silu(+inf) = inf``,
    ``silu(-inf) = nan`` (``-inf / inf``), ``silu(nan) = nan``.

    Example
    -------
    >>> x = torch.tensor([-1.0, 0.0, 2.0])
    >>> SiluPlan(TensorSpec.of(x))(x)
    tensor([-0.2689,  0.0000,  1.7616])
    """

    def __init__(self, x: TensorSpec, out: TensorSpec | None = None, *, backend: str = "auto"):
        super().__init__((("x", x),), out, backend)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(x, None, out)


class SwigluPlan(_ActivationPlan):
    """``swiglu(gate, up) = silu(gate) * up`` elementwise with torch broadcasting, for one layout.

    Parameters
    ----------
    gate, up : TensorSpec
        Shapes that broadcast (``(tokens, 1)`` with ``(tokens, hidden)``, ``(hidden,)`` with
        ``(tokens, hidden)``, ...), any strides, one dtype: float16, bfloat16, float32 or float64.
    out : TensorSpec, optional
        The broadcast shape, the inputs' dtype, non-overlapping; may be ``gate`` or ``up``
        itself. Without it the call allocates one (laid out like an input of the full shape).
    backend : str
        ``"auto"``, ``"triton"``, ``"interpret"`` or ``"torch"``.

    Example
    -------
    >>> gate, up = torch.tensor([[1.0], [-1.0]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    >>> SwigluPlan(TensorSpec.of(gate), TensorSpec.of(up))(gate, up)
    tensor([[ 0.7311,  1.4621],
            [-0.8068, -1.0758]])
    """

    def __init__(self, gate: TensorSpec, up: TensorSpec, out: TensorSpec | None = None, *, backend: str = "auto"):
        super().__init__((("gate", gate), ("up", up)), out, backend)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(gate, up, out)


_cached_silu = plan_cache(SiluPlan)
_cached_swiglu = plan_cache(SwigluPlan)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def silu(x: torch.Tensor, *, out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``x * sigmoid(x)`` elementwise; float16, bfloat16, float32 or float64, any shape and strides.

    ``out`` (same shape and dtype) may be ``x`` for in-place use. See :class:`SiluPlan`.

    Example
    -------
    >>> silu(torch.tensor([0.0, 1.0]))
    tensor([0.0000, 0.7311])
    """
    check_tensor("x", x)
    if out is not None:
        check_tensor("out", out)
        check_out_aliasing(out, "x", x)
    plan = _cached_silu(TensorSpec.of(x), None if out is None else TensorSpec.of(out), backend=backend)
    return plan(x, out)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` elementwise with torch broadcasting; ``gate`` and ``up`` share one float dtype.

    ``out`` (the broadcast shape) may be ``gate`` or ``up`` for in-place use. See :class:`SwigluPlan`.

    Example
    -------
    >>> swiglu(torch.tensor([1.0, -1.0]), torch.tensor([2.0, 2.0]))
    tensor([ 1.4621, -0.5379])
    """
    check_tensor("gate", gate)
    check_tensor("up", up)
    if out is not None:
        check_tensor("out", out)
        check_out_aliasing(out, "gate", gate)
        check_out_aliasing(out, "up", up)
    plan = _cached_swiglu(TensorSpec.of(gate), TensorSpec.of(up), None if out is None else TensorSpec.of(out),
                          backend=backend)
    return plan(gate, up, out)
