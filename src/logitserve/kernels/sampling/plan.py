"""The launch plan of ``sample``: which launches a call takes, and why (``SamplePlan``).

A plan is made once per logits layout and static options (which parameters are per-row tensors,
``random_val`` mode, filter order, backend); it fixes the chunking (:func:`chunk_settings`),
the per-row passes (:func:`finish_settings`) and the workspace size. Each call then picks its
launches from the scalar parameters (a per-row tensor may hold anything, so it enables every
launch its parameter could need):

1. ``_stats_merge`` (``stats.py``), always: chunk statistics and the per-row merge; greedy
   (``temperature == 0`` or ``top_k == 1``) ends here.
2. ``_random_val`` (``random_val.py``), in ``random_val`` mode, instead of the rest.
3. ``_gather`` (``gather.py``), unless pure temperature sampling (no filter: the race runs over
   the row) or a scalar ``top_k`` above ``GATHER_TOP_K_MAX`` (the list could not hold it). It
   also runs the walk's first pass where no top_k is in reach (``WITH_PASS1``); with per-row
   ``top_k`` the first pass takes a launch of its own.
4. ``_check`` (``top_p.py``), without a top_k in reach and with top_p: the walk's first check.
5. ``_finish`` (``draw.py``): the filters and the draw, a program per row.

The torch backend runs the reference (``reference/sample.py``) a few rows at a time instead.
"""

from __future__ import annotations

import threading

import torch
import triton

from .._backend import resolve_backend
from .._plan import FLOAT_DTYPES, TensorSpec, check_dtype, check_same_device, plan_cache
from ..reference import sample as reference
from .draw import _finish
from .gather import _gather
from .launcher import FastLauncher
from .noise import split_u64
from .params import FILTER_ORDERS, SAMPLING_PARAMS
from .random_val import _random_val
from .stats import K_GATHER_MAX, _stats_merge
from .top_p import _check
from .workspace import workspace_size

OUT_DTYPES = (torch.int32, torch.int64)
INT_DTYPES = (torch.int32, torch.int64)
# The dtypes a per-row tensor of each parameter may have, by its kind in params.py.
PARAM_DTYPES = {p.name: FLOAT_DTYPES if p.kind is float else INT_DTYPES for p in SAMPLING_PARAMS.values()}
# The torch backend runs the reference over at most this many logits at a time (whole rows).
REFERENCE_CHUNK_ELEMENTS = 1 << 17
# A top_k above this skips the candidate gather.
GATHER_TOP_K_MAX = K_GATHER_MAX.value
# Group maxima per row, at most: the merge selects among them by passes over a block of 256,
# and 512 groups keep collisions among the top 128 logits to about 16 (k^2 / (2 * groups));
# 512 ran faster than 1024 on the H100.
MAX_GROUPS = 512
# The gather launch's tile holds 32 values a thread at 4 warps and 128 registers (ptxas), which
# caps it at 4 programs an SM; 8 warps halve the per-thread tile (80 registers).
GATHER_WARPS = 8
# The check launch sums a chunk at a time: 4096 values, 32 a thread at 4 warps; with as many
# chunks a program as keep its grid within CHECK_PROGRAMS (a 256-row batch of 32 chunks a row:
# 4 a program), since in a batch with top_k most programs only read their row's state and leave.
CHECK_WARPS = 4
CHECK_PROGRAMS = 2048


def chunk_settings(n_cols: int) -> tuple[int, int, int]:
    """``(CH, NG, num_warps)``: chunk width, strided groups per chunk, warps of the split passes.

    4096 columns (16 KB of float32) per program spreads a 128K-vocabulary row over 32 programs
    (the latency case, one row) and a batch of 256 rows over 8192 (the throughput case), 16
    values a thread at 8 warps (ptxas: 64-71 registers, against 96-126 at 4 warps for the
    [32, 128] tile). The widths depend on V alone, so a row's floating-point sums do not change
    with the batch (8192 and 2048 ran no faster on the H100). Groups (runs of 8 tokens): as
    many as keeps the row's total within MAX_GROUPS.
    """
    ch = min(4096, triton.next_power_of_2(max(n_cols, 16)))
    n_chunks = triton.cdiv(n_cols, ch)
    ng = min(ch // 8, max(1, 1 << (max(1, MAX_GROUPS // n_chunks).bit_length() - 1)))
    return ch, ng, 8


def finish_settings(n_cols: int) -> tuple[int, int, int]:
    """``(BLOCK, SELECT_BLOCK, num_warps)`` of the per-row passes over a whole row.

    A walk pass keeps a running sum and best per lane (no reduction per block): 2048 lanes, 8 a
    thread at 8 warps (the fastest top-p walk of 1024/4, 2048/8 and 4096/8 warps on the H100). A selection round compares each value with 16 digits, a [block, 16]
    tile: 256 rows of it keep the tile at 16 values a thread.
    """
    return min(2048, triton.next_power_of_2(max(n_cols, 16))), 256, 8


class SamplePlan:
    """Draws one token id per row of ``logits (batch_size, vocab_size)``; see :func:`sample`.

    Created from the logits layout and the static options: which parameters are per-row tensors
    (pass their :class:`TensorSpec`; ``None`` means a Python scalar), ``random_val_mode``,
    ``filter_order``, ``out_dtype`` and ``backend``. Calling it launches with no further checks::

        plan = SamplePlan(TensorSpec.of(logits), top_k=TensorSpec.of(ks))
        plan(logits, out, temperature=0.8, top_k=ks, top_p=0.9, seed=7, step=3)

    Scratch: a zero-filled buffer per (device, stream), reused across calls (the kernels leave
    its counters at zero), unless ``workspace`` is passed: a zero-filled uint8 tensor on the
    device of at least ``workspace_size`` bytes, reusable by later calls of this plan on the same
    stream.
    """

    def __init__(self, logits: TensorSpec, *, temperature: TensorSpec | None = None, top_k: TensorSpec | None = None,
                 top_p: TensorSpec | None = None, min_p: TensorSpec | None = None, seed: TensorSpec | None = None,
                 step: TensorSpec | None = None, random_val: TensorSpec | None = None, random_val_mode: bool = False,
                 filter_order: str = "top_k_first", out_dtype: torch.dtype = torch.int64, backend: str = "auto"):
        if logits.ndim != 2:
            raise ValueError(f"logits: must be 2-D (batch_size, vocab_size), got shape {list(logits.shape)}")
        check_dtype("logits", logits.dtype, FLOAT_DTYPES)
        if logits.shape[1] < 1:
            raise ValueError("logits: vocab_size must be >= 1, got 0")
        if filter_order not in FILTER_ORDERS:
            raise ValueError(f"filter_order must be one of {FILTER_ORDERS}, got {filter_order!r}")
        check_dtype("out_dtype", out_dtype, OUT_DTYPES)
        self.n_rows, self.n_cols = logits.shape
        specs = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
                 "step": step, "random_val": random_val}
        for name, spec in specs.items():
            if spec is None:
                continue
            check_dtype(name, spec.dtype, PARAM_DTYPES[name])
            if spec.shape != (self.n_rows,):
                raise ValueError(f"{name}: a per-row tensor must have shape [{self.n_rows}], got {list(spec.shape)}")
            check_same_device(name, spec, logits.device)
        self.per_row = {name: spec is not None for name, spec in specs.items()}
        self.random_val_mode = random_val_mode or random_val is not None
        self.filter_order, self.out_dtype = filter_order, out_dtype
        self.backend = resolve_backend(backend, logits.device)
        self.is_f64 = logits.dtype == torch.float64
        self.chunk, self.groups, self.warps = chunk_settings(self.n_cols)
        self.n_chunks = triton.cdiv(self.n_cols, self.chunk)
        self.chunk_block = triton.next_power_of_2(self.n_chunks)  # a row's chunks as one block (CB)
        self.block, self.select_block, self.finish_warps = finish_settings(self.n_cols)
        self.workspace_size = 0
        if self.backend != "torch":
            self.workspace_size = workspace_size(self.n_rows, self.n_chunks, self.groups, self.is_f64)
            self.kernels = [FastLauncher(k, self.backend)
                            for k in (_stats_merge, _gather, _check, _finish, _random_val)]
            self.device_index = logits.device.index or 0

    def __call__(self, logits: torch.Tensor, out: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                 seed=0, step=0, random_val=None, workspace: torch.Tensor | None = None) -> torch.Tensor:
        if self.n_rows == 0:
            return out
        if self.backend == "torch":
            return self._reference(logits, out, temperature, top_k, top_p, min_p, seed, step, random_val)
        stats_merge, gather_kernel, check, finish, random_val_kernel = self.kernels
        n_cols, per_row = self.n_cols, self.per_row
        if workspace is None:
            ws, n_rows = self._workspace(logits.device)
        else:
            ws, n_rows = workspace, self.n_rows
        grid_rows = self.n_rows
        t = _arg(temperature, float)
        k = _arg(top_k, lambda v: min(int(v), n_cols))
        p, mp = _arg(top_p, float), _arg(min_p, float)
        k_scalar = not per_row["top_k"]
        greedy = (not per_row["temperature"] and temperature == 0) or (k_scalar and top_k == 1)
        # Which launches this call needs, from the scalar parameters (per-row tensors may hold anything).
        k_off = not k_scalar or top_k == 0 or top_k >= n_cols
        pure_temperature = (k_scalar and k_off and not per_row["top_p"] and top_p >= 1 and not per_row["min_p"]
                            and min_p == 0)
        gather = not (greedy or self.random_val_mode or pure_temperature or (k_scalar and not k_off
                                                                              and top_k > GATHER_TOP_K_MAX))
        shape = dict(T_TENSOR=per_row["temperature"], K_TENSOR=per_row["top_k"], P_TENSOR=per_row["top_p"],
                     MP_TENSOR=per_row["min_p"], IS_F64=self.is_f64, CH=self.chunk, NG=self.groups)
        rs, cs = logits.stride()
        grid2 = (grid_rows, self.n_chunks)
        dev = self.device_index
        rv = _arg(0.0 if random_val is None else random_val, float)
        stats_merge(grid2, (out, ws, logits, rs, cs, *t, *k, *p, *mp, *rv, n_rows, n_cols),
                    dict(shape, RV_MODE=self.random_val_mode, RV_TENSOR=per_row["random_val"],
                         CB=self.chunk_block, SELECT_BLOCK=self.select_block,
                         WITH_SOFTMAX=not greedy, WITH_GROUPS=gather,
                         WITH_ARGMAX=greedy or per_row["temperature"] or per_row["top_k"]), self.warps, dev)
        if greedy:
            return out
        if self.random_val_mode:
            random_val_kernel((grid_rows,), (out, ws, logits, rs, cs, *t, *k, *p, *mp, *rv, n_rows, n_cols),
                              dict(shape, RV_TENSOR=per_row["random_val"], BLOCK=self.block,
                                   SELECT_BLOCK=self.select_block), self.finish_warps, dev)
            return out
        seeds = (*u64_arg(seed), *u64_arg(step))
        gather_args = (ws, logits, rs, cs, *t, *mp, *seeds, n_rows, n_cols)
        gather_flags = dict(T_TENSOR=per_row["temperature"], MP_TENSOR=per_row["min_p"], SEED_TENSOR=per_row["seed"],
                            STEP_TENSOR=per_row["step"], IS_F64=self.is_f64, CH=self.chunk, NG=self.groups)
        if per_row["top_k"] and gather:
            # Per-row top_k: mostly candidate rows. The first pass (marked rows only) gets its own
            # launch: in one kernel its registers slowed the gather (on the H100).
            gather_kernel(grid2, gather_args, dict(gather_flags, GATHER=True, WITH_PASS1=False), GATHER_WARPS, dev)
            gather_kernel(grid2, gather_args, dict(gather_flags, GATHER=False, WITH_PASS1=True), GATHER_WARPS, dev)
        elif gather or k_off:
            gather_kernel(grid2, gather_args, dict(gather_flags, GATHER=gather, WITH_PASS1=k_off), GATHER_WARPS, dev)
        # Rows can have run the first pass (ROW_STATE_PASS1) only without a top_k in reach; with
        # top_p, their walk's first check is summed by chunks (top_p.py).
        checked = k_off and (per_row["top_p"] or top_p < 1)
        cb = self.chunk_block
        if checked:
            # Chunks a program: a power of two that keeps the grid within CHECK_PROGRAMS.
            per = min(triton.next_power_of_2(triton.cdiv(grid_rows * self.n_chunks, CHECK_PROGRAMS)), cb)
            check((grid_rows, triton.cdiv(self.n_chunks, per)), (ws, logits, rs, cs, *t, *p, n_rows, n_cols, per),
                  dict(T_TENSOR=per_row["temperature"], P_TENSOR=per_row["top_p"], IS_F64=self.is_f64, CH=self.chunk,
                       NG=self.groups, CB=cb), CHECK_WARPS, dev)
        finish((grid_rows,), (out, ws, logits, rs, cs, *t, *k, *p, *mp, *seeds, n_rows, n_cols),
               dict(shape, SEED_TENSOR=per_row["seed"], STEP_TENSOR=per_row["step"],
                    TOP_K_FIRST=self.filter_order == "top_k_first", GATHER=gather, CHECKED=checked,
                    CB=cb, BLOCK=self.block, SELECT_BLOCK=self.select_block),
               self.finish_warps, dev)
        return out

    def _workspace(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """A zero-filled workspace and the row count its layout is computed for.

        On CUDA one buffer per (device, stream, host thread) serves every call (the kernels leave
        its counters at zero), which saves a fill launch per call. The thread is part of the key
        because a call is several launches: two threads sampling on one stream interleave their
        launches, and a shared buffer would mix their rows. Its layout is computed for its row
        capacity, so the merge tickets at its start never overlap another array whatever the
        batch. While a CUDA graph is captured, and on the CPU, each call gets its own.
        """
        if self.backend != "triton" or torch.cuda.is_current_stream_capturing():
            size = workspace_size(self.n_rows, self.n_chunks, self.groups, self.is_f64)
            return torch.zeros(size, dtype=torch.uint8, device=device), self.n_rows
        key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), threading.get_ident())
        entry = _WORKSPACES.get(key)
        rows = max(self.n_rows, entry[1] if entry else 0)
        size = workspace_size(rows, self.n_chunks, self.groups, self.is_f64)
        if entry is None or rows > entry[1] or entry[0].numel() < size:
            size = max(size, entry[0].numel() if entry else 0)
            entry = _WORKSPACES[key] = (torch.zeros(size, dtype=torch.uint8, device=device), rows)
        return entry

    def _reference(self, logits, out, temperature, top_k, top_p, min_p, seed, step, random_val):
        def full(value, dtype):
            if isinstance(value, torch.Tensor):
                return value
            return torch.full((self.n_rows,), value, dtype=dtype, device=logits.device)

        seed = seed if isinstance(seed, torch.Tensor) else as_int64(seed)
        step = step if isinstance(step, torch.Tensor) else as_int64(step)
        params = [full(temperature, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
                  full(min_p, torch.float32), full(seed, torch.int64), full(step, torch.int64),
                  full(random_val, torch.float32) if self.random_val_mode else None]
        # A few rows at a time: the reference keeps a dozen row-sized temporaries, which out of
        # cache cost more a row than a few rows at a time. Rows are independent, so the tokens
        # are the same.
        step_rows = max(1, REFERENCE_CHUNK_ELEMENTS // self.n_cols)
        for start in range(0, self.n_rows, step_rows):
            rows = slice(start, start + step_rows)
            *row_params, row_random_val = (None if p is None else p[rows] for p in params)
            out[rows] = reference.sample(logits[rows], *row_params, filter_order=self.filter_order,
                                         out_dtype=self.out_dtype, random_val=row_random_val)
        return out


def _arg(value, convert) -> tuple:
    """A per-row parameter as kernel arguments: (tensor, its stride) or (scalar, 0)."""
    if isinstance(value, torch.Tensor):
        return value, value.stride(0)
    return convert(value), 0


def u64_arg(value) -> tuple:
    """A seed or step as kernel arguments: (tensor, 0, stride) or its (lo, hi, 0) int32 halves."""
    if isinstance(value, torch.Tensor):
        return value, 0, value.stride(0)
    return (*split_u64(int(value)), 0)


def as_int64(value: int) -> int:
    """A Python int taken modulo 2**64, as the int64 with that bit pattern."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


_cached_plan = plan_cache(SamplePlan)
# (device index, stream, thread) -> (zero-filled workspace, the row capacity its layout is computed for)
_WORKSPACES: dict = {}
