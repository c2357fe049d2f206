"""Logits processors: penalties, logit bias, allowed / banned tokens, min_tokens and a grammar
bitmask, applied to ``logits [B, V]`` before temperature and the filters.

The order (docs/DESIGN.md): penalties -> bias -> allowed / banned / min_tokens / grammar mask.
For a token ``t`` of row ``r`` (``x`` its logit, ``count`` its occurrences in the output so far,
``seen`` whether it occurs in the prompt or the output)::

    x = x / rep if x > 0 else x * rep          where seen   (repetition_penalty; 1: off)
    x = x - freq * count - pres * (count > 0)               (frequency / presence; 0: off)
    x = x + sum of the row's biases for t                    (logit bias)
    x = -inf  unless t is allowed (allowed list, when given; grammar bit set, when given)
    x = -inf  where t is banned, or a stop token while len(output) < min_tokens

Two launches (``process_kernels.py``) write the processed row (float32) into a new tensor which
the sampling launches then read: ``_dense`` over rows x column blocks (the row, grammar-masked,
or -inf everywhere under an allowed list) and ``_lists``, a program per row, whose cost is the
lists' lengths, not the vocabulary (flags set with atomics find each token's first occurrence
and count the output; each listed token is written once, from its original logit).

Ragged lists: row ``r`` of a list is ``ids[offsets[r]:offsets[r + 1]]``. On the CPU the offsets
(from 0, not decreasing, ending at ``len(ids)``) and the ids (in ``[0, V)``) are checked in bulk
(:func:`ragged_error`: torch reductions, no loop over elements), with ``ValueError``. On CUDA
neither is read back (that would cost a synchronisation per list, and forbid capturing the call
in a CUDA graph): the kernel clamps a row's span into ``[0, len(ids)]`` (``lo = clamp(offsets[r],
0, n)``, ``hi = clamp(offsets[r + 1], lo, n)``) and skips ids outside ``[0, V)``, so broken
offsets give that row a wrong list, never a read out of bounds. The server checks every wire
input first, by these rules, where it lies (``server/ops/processor_checks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .._backend import resolve_backend
from .params import MIN_TOKENS, PENALTY_PARAMS, RAGGED_LISTS, SamplingParam
from .process_kernels import FLAG_WORDS_PER_GRAMMAR_WORD, TABLE_COLUMNS, _append, _dense, _lists

INDEX_DTYPES = (torch.int32, torch.int64)
LIST_TILE = 1024  # list tokens a step of _lists: lists of a few thousand take a few steps a phase
LIST_WARPS = 4  # 8 list tokens a thread of _lists a step
BIAS_TILE = 64  # bias tokens a step, each summed against the bias list BIAS_TILE at a time
DENSE_WORDS = 128  # grammar words (32 columns each) a _dense program: 4096 columns


# The lists a list table may hold, by Processors attribute (process_kernels.py's columns).
TABLE_LISTS = ("prompt", "output", "logit_bias", "banned", "stop")


@dataclass(frozen=True)
class ListTable:
    """Each row's lists held by address instead of ragged (ids, offsets): ``rows``, int64
    ``[B, TABLE_COLUMNS]`` on the logits' device, laid out as process_kernels.py's list table;
    ``lists``, the names of :data:`TABLE_LISTS` whose columns are set (the others are not
    read). The addresses must stay valid until the launches that read them finish. For a server
    that keeps each sequence's lists on the device (server/sequences/lists.py): no list is
    gathered per call, and a graph captures the launch whatever the lists' lengths. Compiled
    Triton kernels only (the ``triton`` and ``interpret`` backends)."""

    rows: torch.Tensor
    lists: frozenset

    def __post_init__(self):
        if self.rows.dtype != torch.int64 or self.rows.ndim != 2 or self.rows.shape[1] != TABLE_COLUMNS.value \
                or not self.rows.is_contiguous():
            raise ValueError(f"a list table must be a contiguous int64 [B, {TABLE_COLUMNS.value}] tensor")
        if not self.lists <= set(TABLE_LISTS):
            raise ValueError(f"a list table holds lists of {TABLE_LISTS}, got {sorted(self.lists)}")


@dataclass
class Processors:
    """The processors of one call, checked (``Processors.of``); every list is ``(ids, offsets)``,
    or held by address in ``table`` (then min_tokens is the table's, and ``allowed`` is ragged)."""

    repetition_penalty: object = 1.0
    frequency_penalty: object = 0.0
    presence_penalty: object = 0.0
    prompt: tuple | None = None
    output: tuple | None = None
    logit_bias: tuple | None = None  # (ids, offsets, values)
    allowed: tuple | None = None
    banned: tuple | None = None
    min_tokens: object = 0
    stop: tuple | None = None
    grammar_bitmask: torch.Tensor | None = None
    table: ListTable | None = None

    def has(self, name: str) -> bool:
        """Whether list ``name`` is given, ragged or in the table."""
        return getattr(self, name) is not None or (self.table is not None and name in self.table.lists)

    @property
    def penalties_on(self) -> bool:
        return any(isinstance(getattr(self, p.name), torch.Tensor) or getattr(self, p.name) != p.off
                   for p in PENALTY_PARAMS.values())

    @property
    def min_tokens_on(self) -> bool:
        if self.table is not None:
            return "stop" in self.table.lists
        return self.stop is not None and (isinstance(self.min_tokens, torch.Tensor) or self.min_tokens != 0)

    @property
    def any(self) -> bool:
        return (self.penalties_on and (self.has("prompt") or self.has("output"))) or self.has("logit_bias") or \
            self.allowed is not None or self.has("banned") or self.min_tokens_on or self.grammar_bitmask is not None

    @classmethod
    def of(cls, n_rows: int, n_cols: int, device, **kw) -> "Processors":
        """Check ``sample``'s processor keywords (``ValueError`` / ``TypeError`` naming the argument)."""
        procs = cls()
        for param in (*PENALTY_PARAMS.values(), MIN_TOKENS):
            value = kw.pop(param.name)
            _check_scalar_or_rows(param, value, n_rows, device)
            setattr(procs, param.name, value)
        for name, (ids_name, off_name, _) in RAGGED_LISTS.items():
            ids, offsets = kw.pop(ids_name), kw.pop(off_name)
            if (ids is None) != (offsets is None):
                raise ValueError(f"{ids_name} and {off_name} must be given together")
            if ids is None:
                continue
            _check_ragged(ids_name, off_name, ids, offsets, n_rows, n_cols, device)
            setattr(procs, name, (ids, offsets))
        values = kw.pop("logit_bias_values")
        if (values is None) != (procs.logit_bias is None):
            raise ValueError("logit_bias_values must be given with logit_bias_ids and logit_bias_offsets")
        if values is not None:
            ids = procs.logit_bias[0]
            if not isinstance(values, torch.Tensor) or values.shape != ids.shape or not values.is_floating_point():
                raise ValueError(f"logit_bias_values must be a float tensor of shape {list(ids.shape)}")
            if values.device.type == "cpu" and not bool(torch.isfinite(values).all()):
                raise ValueError("logit_bias_values must be finite")
            procs.logit_bias = (*procs.logit_bias, values)
        g = kw.pop("grammar_bitmask")
        if g is not None:
            words = (n_cols + 31) // 32
            if not isinstance(g, torch.Tensor) or g.dtype != torch.int32 or tuple(g.shape) != (n_rows, words):
                raise ValueError(f"grammar_bitmask must be an int32 tensor of shape [{n_rows}, {words}] "
                                 f"(ceil(vocab_size / 32) words a row), got "
                                 f"{getattr(g, 'dtype', type(g).__name__)} {list(getattr(g, 'shape', []))}")
            if g.device != device:
                raise ValueError(f"grammar_bitmask must be on {device}, got {g.device}")
            procs.grammar_bitmask = g.contiguous()
        table = kw.pop("list_table")
        if table is not None:
            _check_table(table, procs, n_rows, device)
            procs.table = table
        elif procs.min_tokens_on and procs.output is None:
            raise ValueError("min_tokens needs output_token_ids and output_offsets (the output's length)")
        assert not kw, kw
        return procs


PROCESSOR_KEYWORDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens",
                      "logit_bias_values", "grammar_bitmask", "list_table",
                      *(name for pair in RAGGED_LISTS.values() for name in pair[:2]))


def _check_scalar_or_rows(param: SamplingParam, value, n_rows: int, device) -> None:
    rule = f"{param.rule} ({param.note})" if param.note else param.rule
    if isinstance(value, torch.Tensor):
        if value.shape != (n_rows,) or value.device != device:
            raise ValueError(f"{param.name}: a per-row tensor must have shape [{n_rows}] on {device}")
        if value.device.type == "cpu":
            bad = (~param.ok(value.to(torch.float64 if param.kind is float else torch.int64))).nonzero()
            if bad.numel():
                r = bad[0, 0].item()
                raise ValueError(f"{param.name} must be {rule}, got {value[r].item()} in row {r}")
        return
    kinds = (int,) if param.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{param.name} must be a number or a [batch_size] tensor, got {type(value).__name__}")
    if not param.ok(value):
        raise ValueError(f"{param.name} must be {rule}, got {value}")


def _check_table(table, procs: "Processors", n_rows: int, device) -> None:
    if not isinstance(table, ListTable):
        raise TypeError(f"list_table must be a ListTable, got {type(table).__name__}")
    if table.rows.shape[0] != n_rows or table.rows.device != device:
        raise ValueError(f"list_table: must have {n_rows} rows (batch_size) on {device}, got "
                         f"{table.rows.shape[0]} on {table.rows.device}")
    for name in table.lists:
        if getattr(procs, name) is not None:
            raise ValueError(f"list_table: holds the {name} lists, which must not also be given ragged")
    if isinstance(procs.min_tokens, torch.Tensor) or procs.min_tokens != MIN_TOKENS.default:
        raise ValueError("min_tokens: unset with list_table (the table holds each row's)")


def _check_ragged(ids_name, off_name, ids, offsets, n_rows, n_cols, device) -> None:
    for name, t in ((ids_name, ids), (off_name, offsets)):
        if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES or t.ndim != 1:
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if offsets.shape[0] != n_rows + 1:
        raise ValueError(f"{off_name} must have batch_size + 1 = {n_rows + 1} entries, got {offsets.shape[0]}")
    # On CUDA, neither ids nor offsets are read back: the kernel clamps spans and skips bad ids
    # (module docstring), which keeps the call free of synchronisations.
    if device.type != "cpu":
        return
    message = ragged_error(ids, offsets, n_cols)
    if message:
        raise ValueError(f"{ids_name if message[0] == 'ids' else off_name}: {message[1]}")


def ragged_broken(ids: torch.Tensor | None, offsets: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Whether a ragged list breaks a rule, as a 0-d bool tensor on its device (nothing read
    back: a caller gathers several and reads them at once). ``ids`` (None: no ids, every row
    empty) and ``offsets`` are 1-D integer tensors, checked in bulk (a few passes over the ids)."""
    n_ids = 0 if ids is None else ids.shape[0]
    broken = [offsets[0] != 0, (offsets[1:] < offsets[:-1]).any(), offsets[-1] != n_ids]
    if n_ids:
        low, high = torch.aminmax(ids)  # one pass over the ids
        broken.append((low < 0) | (high >= n_cols))
    return torch.stack(broken).any()


def ragged_error(ids: torch.Tensor | None, offsets: torch.Tensor, n_cols: int) -> tuple[str, str] | None:
    """The first broken rule of a ragged list, as ``("ids" | "offsets", message)``; None if valid.
    The rules in order: offsets start at 0, do not decrease, end at the ids' length; then the
    first id outside ``[0, n_cols)`` in the ids' order, with its row. Tensors as
    :func:`ragged_broken`'s; one read back where the list is valid."""
    if not ragged_broken(ids, offsets, n_cols).item():
        return None
    n_ids = 0 if ids is None else ids.shape[0]
    start, end = offsets[0].item(), offsets[-1].item()
    if start != 0:
        return "offsets", f"must start at 0, got {start}"
    falls = offsets[1:] < offsets[:-1]
    if falls.any().item():
        r = first_true(falls)
        return "offsets", f"must not decrease, got {offsets[r + 1].item()} after {offsets[r].item()} (row {r})"
    if end != n_ids:
        return "offsets", f"must end at the ids' length {n_ids}, got {end}"
    i = first_true((ids < 0) | (ids >= n_cols))
    return "ids", f"must be in [0, {n_cols}) (vocab_size), got {ids[i].item()} in row {row_of(offsets, i)}"


def first_true(mask: torch.Tensor) -> int:
    """The index of the first True of a 1-D bool tensor that holds one (argmax keeps the first
    of equal maxima)."""
    return int(mask.view(torch.uint8).argmax())


def row_of(offsets: torch.Tensor, i: int) -> int:
    """The row of valid ragged ``offsets`` whose span holds element ``i`` (the last row starting
    at or before it: rows before it may be empty)."""
    return int(torch.searchsorted(offsets, i, right=True)) - 1


def _rows(value, n_rows, dtype, device):
    if isinstance(value, torch.Tensor):
        return value.to(dtype).contiguous()
    return torch.full((n_rows,), value, dtype=dtype, device=device)


def process_logits(logits: torch.Tensor, procs: Processors, backend: str = "auto") -> torch.Tensor:
    """The processed logits, float32 ``[B, V]`` (a new tensor); see the module docstring."""
    n_rows, n_cols = logits.shape
    backend = resolve_backend(backend, logits.device)
    if procs.table is not None and backend == "torch":
        raise ValueError("a list table is read by the Triton kernels only (backend 'triton' or 'interpret')")
    if backend == "torch":
        from ..reference.processors import process as reference
        return reference(logits, procs).to(torch.float32)
    dev = logits.device
    y = torch.empty((n_rows, n_cols), dtype=torch.float32, device=dev)
    if n_rows == 0:
        return y
    dummy = torch.zeros(2, dtype=torch.int32, device=dev)
    table = procs.table
    prompt_on = procs.penalties_on and procs.has("prompt")
    output_on = procs.penalties_on and procs.has("output")
    bias_on, banned_on = procs.has("logit_bias"), procs.has("banned")
    g = procs.grammar_bitmask
    words = (n_cols + 31) // 32
    with_flags = prompt_on or output_on or bias_on
    flag_shape = (n_rows, FLAG_WORDS_PER_GRAMMAR_WORD.value * words) if with_flags else (1,)
    flags = torch.empty(flag_shape, dtype=torch.int32, device=dev)  # zeroed by _dense

    def ragged(lst, on=True):
        return (lst[0], lst[1], lst[0].shape[0]) if lst is not None and on else (dummy, dummy, 0)

    # The output's offsets also serve min_tokens (the output's length), penalties or not.
    o_ids, o_off, o_n = ragged(procs.output)
    if not output_on:
        o_ids = dummy
    mt = _rows(procs.min_tokens, n_rows, torch.int64, dev) if procs.min_tokens_on and table is None else dummy
    g_arg = g if g is not None else dummy
    _dense.for_backend(backend)[(n_rows, triton.cdiv(words, DENSE_WORDS))](
        y, logits, *logits.stride(), n_cols, g_arg, words, flags, HAS_ALLOWED=procs.allowed is not None,
        HAS_GRAMMAR=g is not None, HAS_FLAGS=with_flags, WORDS=DENSE_WORDS, num_warps=8)
    if not (with_flags or procs.allowed is not None or banned_on or procs.min_tokens_on):
        return y  # a grammar bitmask alone: the dense pass did everything
    rep, freq, pres = (_rows(getattr(procs, p.name), n_rows, torch.float32, dev) for p in PENALTY_PARAMS.values())
    bias = procs.logit_bias
    _lists.for_backend(backend)[(n_rows,)](
        y, logits, *logits.stride(), n_cols, flags, g_arg, words, rep, freq, pres, *ragged(procs.prompt, prompt_on),
        o_ids, o_off, o_n, *((bias[0], bias[2], bias[1], bias[0].shape[0]) if bias is not None else
                             (dummy, dummy, dummy, 0)),
        *ragged(procs.allowed), *ragged(procs.banned), *ragged(procs.stop, procs.min_tokens_on), mt,
        dummy if table is None else table.rows,
        HAS_PROMPT=prompt_on, HAS_OUTPUT=output_on, HAS_BIAS=bias_on,
        HAS_ALLOWED=procs.allowed is not None, HAS_BANNED=banned_on,
        HAS_MIN_TOKENS=procs.min_tokens_on, HAS_GRAMMAR=g is not None, TABLE=table is not None, TB=LIST_TILE,
        BT=BIAS_TILE, num_warps=LIST_WARPS)
    return y


APPEND_BLOCK = 256  # rows a program of _append


def append_tokens(table: ListTable, tokens: torch.Tensor, backend: str = "auto") -> None:
    """Each row's token of ``tokens [B]`` (a drawn token: >= 0) stored after its output list in
    ``table`` (its length and capacity columns say where, and whether it fits); the table's own
    lengths are left as they are, for its owner to advance. Triton kernels only."""
    n_rows = tokens.shape[0]
    backend = resolve_backend(backend, tokens.device)
    if n_rows:
        _append.for_backend(backend)[(triton.cdiv(n_rows, APPEND_BLOCK),)](table.rows, tokens, n_rows,
                                                                            BLOCK=APPEND_BLOCK)


__all__ = ["PROCESSOR_KEYWORDS", "TABLE_LISTS", "ListTable", "Processors", "append_tokens", "first_true",
           "process_logits", "ragged_broken", "ragged_error", "row_of"]
