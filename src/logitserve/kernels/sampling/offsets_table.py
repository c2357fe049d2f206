"""A list table computed on the device from ragged offsets, for a caller whose lists stay where
they are (issue 45): each row's ``(address, length)`` of a list is ``(ids' address + lo * 8,
hi - lo)``, its span ``[lo, hi)`` read from the offsets by one kernel launch.

The ragged lists' kernel launch (``processors.py``) takes each list's ids length as an argument,
so a CUDA graph captured over it holds the lengths of the call it was captured for. A
:class:`~.processors.ListTable` holds each row's list by address and length, read by the
kernels from device memory: built here on the device, from offsets on the device and the lists'
``places`` (each list's ids address and length, a small int64 tensor the caller fills per call,
staged like any input), the launches read nothing whose size changes from call to call, and a
graph of them serves every call whatever its lists' lengths.

The same launch checks the lists by ``ragged_error``'s rules, in bulk on the device: a row's
flag is set where its offsets break one (the first at 0, none decreasing, the last at the ids'
length) or its span holds an id outside ``[0, V)`` or a logit bias value that is not finite.
With valid offsets the rows' spans cover every id once, so the flags say exactly what
``ragged_broken`` says; the caller reads them back with the tokens (no synchronisation of its
own) and makes the message with ``ragged_error``. Whatever the offsets hold, each span is
clamped into ``[0, length]`` before it becomes an address, so the kernels never read outside a
list's ids; ids outside ``[0, V)`` are skipped by the list kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import launchable, resolve_backend
from .process_kernels import COL_BANNED, COL_BIAS, COL_BIAS_VALUES, COL_MIN_TOKENS, COL_OUTPUT, \
    COL_OUTPUT_CAPACITY, COL_PROMPT, COL_STOP, TABLE_COLUMNS
from .processors import TABLE_LISTS, ListTable

# ``places``: per list of TABLE_LISTS, in that order, its int64 ids' address and their count
# (0, 0 for a list given as offsets alone); then the logit bias values' address (float32).
PLACES = 2 * len(TABLE_LISTS) + 1
BIAS_VALUES_PLACE = tl.constexpr(PLACES - 1)
SCAN = 256  # ids a step of a row's scan


@triton.jit
def _held(tab_row, COL: tl.constexpr, off_ptr, places_ptr, SLOT: tl.constexpr, row, n_rows, n_cols,
          VALUES: tl.constexpr, SCAN: tl.constexpr):
    """Row ``row`` of a ragged list into its table columns (address, length); whether its
    offsets break a rule or its span holds an id outside ``[0, n_cols)`` (with ``VALUES``: or a
    non-finite logit bias value), as an int32 0 or 1."""
    base = tl.load(places_ptr + SLOT)
    n = tl.load(places_ptr + SLOT + 1)
    start = tl.load(off_ptr + row).to(tl.int64)
    end = tl.load(off_ptr + row + 1).to(tl.int64)
    # Clamped before anything is read: the offsets may be anything (a client's device memory,
    # checked by this same launch).
    lo = tl.minimum(tl.maximum(start, 0), n)
    hi = tl.minimum(tl.maximum(end, lo), n)
    tl.store(tab_row + COL, base + lo * 8)
    tl.store(tab_row + COL + 1, hi - lo)
    broken = ((end < start) | ((row == 0) & (start != 0)) | ((row == n_rows - 1) & (end != n))).to(tl.int32)
    ids = (base + lo * 8).to(tl.pointer_type(tl.int64))
    if VALUES:
        values_base = tl.load(places_ptr + BIAS_VALUES_PLACE)
        tl.store(tab_row + COL_BIAS_VALUES, values_base + lo * 4)
        values = (values_base + lo * 4).to(tl.pointer_type(tl.float32))
    for s in range(0, hi - lo, SCAN):
        j = s + tl.arange(0, SCAN)
        live = j < hi - lo
        t = tl.load(ids + j, mask=live, other=0)
        bad = live & ((t < 0) | (t >= n_cols))
        if VALUES:
            v = tl.load(values + j, mask=live, other=0.0)
            bad = bad | (live & ((v != v) | (tl.abs(v) == float("inf"))))
        broken = tl.maximum(broken, tl.max(bad.to(tl.int32), axis=0))
    return broken


@triton.jit
def _unheld(tab_row, COL: tl.constexpr):
    tl.store(tab_row + COL, 0)
    tl.store(tab_row + COL + 1, 0)


@launchable
@triton.jit(do_not_specialize=["n_rows", "n_cols"])
def _table_of_offsets(tab_ptr, broken_ptr, places_ptr, n_rows, n_cols, p_off, o_off, b_off, n_off, s_off, mt_ptr,
                      HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_BANNED: tl.constexpr, HAS_STOP: tl.constexpr, HAS_MIN_TOKENS: tl.constexpr,
                      SCAN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tab_row = tab_ptr + row * TABLE_COLUMNS
    broken = tl.full([], 0, tl.int32)
    # Every column written, those of lists not given too (0, 0: empty), so the table holds no
    # leftover of an earlier launch.
    if HAS_PROMPT:
        broken = broken | _held(tab_row, COL_PROMPT, p_off, places_ptr, 0, row, n_rows, n_cols, False, SCAN)
    else:
        _unheld(tab_row, COL_PROMPT)
    if HAS_OUTPUT:
        broken = broken | _held(tab_row, COL_OUTPUT, o_off, places_ptr, 2, row, n_rows, n_cols, False, SCAN)
        tl.store(tab_row + COL_OUTPUT_CAPACITY, tl.load(tab_row + COL_OUTPUT + 1))
    else:
        _unheld(tab_row, COL_OUTPUT)
        tl.store(tab_row + COL_OUTPUT_CAPACITY, 0)
    if HAS_BIAS:
        broken = broken | _held(tab_row, COL_BIAS, b_off, places_ptr, 4, row, n_rows, n_cols, True, SCAN)
    else:
        _unheld(tab_row, COL_BIAS)
        tl.store(tab_row + COL_BIAS_VALUES, 0)
    if HAS_BANNED:
        broken = broken | _held(tab_row, COL_BANNED, n_off, places_ptr, 6, row, n_rows, n_cols, False, SCAN)
    else:
        _unheld(tab_row, COL_BANNED)
    if HAS_STOP:
        broken = broken | _held(tab_row, COL_STOP, s_off, places_ptr, 8, row, n_rows, n_cols, False, SCAN)
    else:
        _unheld(tab_row, COL_STOP)
    if HAS_MIN_TOKENS:
        tl.store(tab_row + COL_MIN_TOKENS, tl.load(mt_ptr + row).to(tl.int64))
    else:
        tl.store(tab_row + COL_MIN_TOKENS, 0)
    tl.store(broken_ptr + row, broken)


def table_of_offsets(offsets: dict[str, torch.Tensor], places: torch.Tensor, n_cols: int,
                     min_tokens: torch.Tensor | None = None, backend: str = "auto") -> tuple[ListTable, torch.Tensor]:
    """The list table of ragged lists whose ids stay where they are, and each row's flag.

    ``offsets``: by name of :data:`~.processors.TABLE_LISTS`, each given list's offsets
    ``[B + 1]`` (int32 or int64, on the device); ``places``: int64 ``[PLACES]`` on the device
    (module docstring), each list's ids int64 and its bias values float32, all of them kept
    valid until the launches reading the table are done; ``min_tokens``: ``[B]`` integers,
    with a stop list (None: 0). Returns the table (its ``lists``: those given, the stop list only
    with ``min_tokens``) and int32 ``[B]``, 1 where a row's lists break a rule (module
    docstring). Triton kernels only (the ``triton`` and ``interpret`` backends)."""
    if not offsets:
        raise ValueError("table_of_offsets: no lists given")
    unknown = set(offsets) - set(TABLE_LISTS)
    if unknown:
        raise ValueError(f"table_of_offsets: lists of {TABLE_LISTS} only, got {sorted(unknown)}")
    first = next(iter(offsets.values()))
    n_rows, device = first.shape[0] - 1, first.device
    backend = resolve_backend(backend, device)
    if backend == "torch":
        raise ValueError("a list table is read by the Triton kernels only (backend 'triton' or 'interpret')")
    if places.dtype != torch.int64 or tuple(places.shape) != (PLACES,) or places.device != device:
        raise ValueError(f"places: must be int64 [{PLACES}] on {device}")
    for name, off in offsets.items():
        if off.shape != (n_rows + 1,) or off.device != device or off.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} offsets: must be int32 or int64 [{n_rows + 1}] on {device}")
    with_min_tokens = min_tokens is not None and "stop" in offsets
    rows = torch.empty((n_rows, TABLE_COLUMNS.value), dtype=torch.int64, device=device)
    broken = torch.empty(n_rows, dtype=torch.int32, device=device)
    if n_rows:
        dummy = places  # any tensor: an absent list's offsets are not read
        _table_of_offsets.for_backend(backend)[(n_rows,)](
            rows, broken, places, n_rows, n_cols, *(offsets.get(name, dummy) for name in TABLE_LISTS),
            min_tokens if with_min_tokens else dummy, HAS_PROMPT="prompt" in offsets, HAS_OUTPUT="output" in offsets,
            HAS_BIAS="logit_bias" in offsets, HAS_BANNED="banned" in offsets, HAS_STOP="stop" in offsets,
            HAS_MIN_TOKENS=with_min_tokens, SCAN=SCAN)
    lists = frozenset(offsets) if with_min_tokens else frozenset(offsets) - {"stop"}
    return ListTable(rows, lists), broken


__all__ = ["PLACES", "table_of_offsets"]
