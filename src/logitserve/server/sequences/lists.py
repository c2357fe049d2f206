"""Sample by sequence ids on the Triton kernels: each row's lists read where its sequence holds
them, and the drawn tokens appended, in one launch that a CUDA graph replays.

The kernels take the rows' lists as a list table (kernels/sampling/processors.py ``ListTable``):
a row of addresses and lengths per batch row, pointing at the sequence's own tensors (prompt,
output, logit bias, banned and stop tokens) and holding its min_tokens and its output's
capacity. Built on the host from values each sequence keeps at hand (:class:`StateRows`,
cached per state), staged with the rows' parameters, it replaces the per-call gathering of
every list (``torch.cat`` over the rows: milliseconds at 256 rows), and the launch no longer
depends on the lists' lengths: the processors, the draw and ``append_tokens`` (each drawn token
stored after its row's output) are captured as one CUDA graph per (features, batch bucket,
logits place), replayed as plain Sample calls are (server/engine/graphs.py).

The host keeps each output's length: before the launch every output has room for one more token
(:meth:`.sequences.SequenceTable.reserve`), after it each row that drew a token counts it
(:meth:`.sequences.SequenceTable.counted`). One sequence call at a time goes from the reading of
its state to that count (``SequenceTable.launch_lock``), so two calls never store a token at the
same place. The answer equals the stateless call with the same lists (the kernels read the same
values; tests/test_sequences.py compares them step by step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.sampling.params import FLOAT_PARAMS, INT_PARAMS, PENALTY_PARAMS, SEED, STEP
from logitserve.kernels.sampling.process_kernels import COL_OUTPUT, COL_OUTPUT_CAPACITY
from logitserve.kernels.sampling.processors import ListTable, append_tokens

from ..ops.resident import on_device, places, unstaged
from ..ops.sample_processors import logprobs_on_host
from .sequence import SequenceState
from ..engine.staging import Staging, to_host
from ..tensors import HostTensor

_OUTPUT, _OUTPUT_CAPACITY = COL_OUTPUT.value, COL_OUTPUT_CAPACITY.value
_PENALTIES = tuple(PENALTY_PARAMS)
_OUTPUT_ONLY = frozenset({"output"})


@dataclass(frozen=True)
class StateRows:
    """What a sequence's state gives each call's staged parts, as bytes computed once per state
    (a state is replaced whole, never changed; a call joins its rows' bytes, where building
    arrays row by row cost 0.5 ms at 256 rows): its list-table row (every column but the
    output's), its penalties, its sampling parameters as the kernels' float and int columns (the
    step is the sequence's), and which lists it holds."""

    table: bytes  # int64 [TABLE_COLUMNS]
    penalties: bytes  # float32 [3]
    floats: bytes  # float32 [len(FLOAT_PARAMS)]
    ints: bytes  # int64 [len(INT_PARAMS)], the step 0
    lists: frozenset  # of TABLE_LISTS, the output's aside
    penalties_on: bool

    @classmethod
    def of(cls, state: SequenceState) -> "StateRows":
        cached = state.__dict__.get("_rows")
        if cached is not None:
            return cached

        def listed(t: torch.Tensor) -> tuple[int, int]:
            return (t.data_ptr(), t.numel()) if t.numel() else (0, 0)

        p = state.params
        table = [*listed(state.prompt), 0, 0, *listed(state.bias_ids), state.bias_values.data_ptr(),
                 *listed(state.banned), *listed(state.stop), p.min_tokens, 0]
        penalties_on = any(getattr(p, name) != PENALTY_PARAMS[name].off for name in _PENALTIES)
        lists = {name for name, held in (("logit_bias", state.bias_ids.numel()), ("banned", state.banned.numel()),
                                         ("stop", p.min_tokens > 0 and state.stop.numel())) if held}
        rows = cls(np.array(table, dtype=np.int64).tobytes(),
                   np.array([getattr(p, name) for name in _PENALTIES], dtype=np.float32).tobytes(),
                   np.array([getattr(p, name) for name in FLOAT_PARAMS], dtype=np.float32).tobytes(),
                   np.array([0 if name == STEP.name else getattr(p, name) for name in INT_PARAMS],
                            dtype=np.int64).tobytes(),
                   frozenset(lists), penalties_on)
        state.__dict__["_rows"] = rows  # a frozen dataclass: its own dict holds the cache
        return rows


def _joined(rows: list[StateRows], attr: str, dtype) -> np.ndarray:
    """The rows' ``attr`` bytes as one array ``[len(rows), -1]`` (a copy, writable)."""
    return np.frombuffer(b"".join(getattr(r, attr) for r in rows), dtype=dtype).reshape(len(rows), -1).copy()


def lists_of(rows: list[StateRows]) -> tuple[frozenset, bool]:
    """The lists some row uses (a list no row holds is left out, as a stateless caller leaves
    it; the output goes with the penalties and with min_tokens), and whether any row's
    penalties are on."""
    lists = frozenset().union(*(r.lists for r in rows))
    penalties = any(r.penalties_on for r in rows)
    if penalties:
        lists |= {"prompt", "output"}
    if "stop" in lists:
        lists |= {"output"}
    return lists, penalties


def table_rows(sequences: list, rows: list[StateRows]) -> HostTensor:
    """The list table's rows of ``sequences`` (their states' ``rows``), for staging."""
    table = _joined(rows, "table", np.int64)
    table[:, _OUTPUT] = [seq.output_address for seq in sequences]
    table[:, _OUTPUT + 1] = [seq.output_len for seq in sequences]
    table[:, _OUTPUT_CAPACITY] = [seq.output_capacity for seq in sequences]
    return HostTensor(table.tobytes(), torch.int64, table.shape)


def penalty_rows(rows: list[StateRows]) -> list[HostTensor]:
    """Each penalty's per-row values, one part each (a kernel reads each contiguous)."""
    values = np.ascontiguousarray(_joined(rows, "penalties", np.float32).T)
    return [HostTensor(row.tobytes(), torch.float32, row.shape) for row in values]


def param_rows(sequences: list, rows: list[StateRows]) -> tuple[np.ndarray, np.ndarray]:
    """The rows' sampling parameters as the kernels' float32 and int64 columns, each row's step
    its sequence's."""
    ints = _joined(rows, "ints", np.int64)
    ints[:, INT_PARAMS.index(STEP.name)] = [seq.step for seq in sequences]
    return _joined(rows, "floats", np.float32), ints


class TableLaunch:
    """A Sample call by sequence ids, its state read (at the launch: :meth:`SequenceRows.run`),
    as staged parts and a launch function over them."""

    def __init__(self, call, handle, names: tuple[str, ...], sequences: list, rows: list[StateRows]):
        self.call, self.handle, self.names = call, handle, names
        self.lists, self.penalties = lists_of(rows)
        self.table = table_rows(sequences, rows)
        self.penalty_values = penalty_rows(rows) if self.penalties else None
        grammar = (call.processors or {}).get("grammar_bitmask")
        # Each tensor input read where it is (the client's device memory, or copied in from a
        # page-locked region), or staged.
        self.fixed = [t for t in (call.logits, grammar) if t is not None and unstaged(t, handle.device)]
        self.staged = [t for t in (call.logits, grammar) if t is not None and not unstaged(t, handle.device)]
        self.grammar = grammar
        self.graphed = call.logprobs is None and not call.return_kept
        # Launched over exactly the call's rows where a tensor or an output is in place (its
        # size is the call's), else over every staged row of the bucket.
        self.exact = bool(self.fixed) or call.outputs is not None

    def key(self):
        """The key of this launch's CUDA graph, or None where it launches eagerly (no graphs
        here, logprobs or the kept set asked for, inputs a graph cannot hold: resident.places)."""
        graphs = self.handle.graphs
        if graphs is None or not self.graphed:
            return None
        where = places(self.fixed, self.call.outputs, self.handle)
        if where is None:
            return None
        logits = self.call.logits
        return (("sample", "sequences", logits.dtype, logits.shape[1], self.call.filter_order, self.lists,
                 self.penalties, self.grammar is not None, tuple(t is self.grammar for t in self.staged),
                 self.call.rows if self.exact else None), *where)

    def stage_for(self, batch_rows: int) -> Staging:
        """The staged parts, padded to ``batch_rows``: the rows' float and int parameters, list
        table and penalties (zero padding: a padding row has top_p 0 and no lists, so it
        answers -1 and appends nothing), then the staged tensor inputs."""
        stage = Staging()
        for part in (*self.call.params, self.table, *(self.penalty_values or ())):
            stage.add([part], rows=batch_rows, zero_padding=True)
        for t in self.staged:
            stage.add([t], rows=batch_rows)
        return stage

    def launch(self, float_rows, int_rows, table, *rest):
        """The launch over the staged parts (on the launch thread, or captured): the processors
        with the list table, the draw, the outputs into their regions, the tokens appended. Over
        the call's rows where a tensor or an output is in place (the rows are in the graph's
        key), else over every staged row: a graph serves every batch of its bucket, its padding
        rows drawing nothing (top_p 0) and appending nothing (no output room)."""
        call = self.call
        rows = call.rows if self.exact else float_rows.shape[0]
        penalties = rest[:len(_PENALTIES)] if self.penalties else None
        staged = dict(zip(map(id, self.staged), rest[len(penalties or ()):]))

        def tensor(t):
            return on_device(t, self.handle.device) if id(t) not in staged else staged[id(t)][:rows]

        params = dict(zip(self.names, (*float_rows[:rows].unbind(1), *int_rows[:rows].unbind(1))))
        kw = {}
        if penalties is not None:
            kw = {name: values[:rows] for name, values in zip(_PENALTIES, penalties)}
        if self.grammar is not None:
            kw["grammar_bitmask"] = tensor(self.grammar).to(torch.int32)
        if call.logprobs is not None:
            kw.update(logprobs=call.logprobs, logprobs_mode=call.logprobs_mode)
        if call.return_kept:
            kw["return_kept"] = True
        lists = ListTable(table[:rows], self.lists) if self.lists else None
        result = kernels.sample(tensor(call.logits), **params, filter_order=call.filter_order,
                                backend=self.handle.backend, list_table=lists, **kw)
        tokens, logprobs = result if (call.logprobs is not None or call.return_kept) else (result, None)
        call.put_outputs(tokens, params[SEED.name])
        # Every output grows, read by this call's processors or not (a later update may turn
        # penalties on).
        append_tokens(ListTable(table[:rows], _OUTPUT_ONLY), tokens, backend=self.handle.backend)
        self.logprobs = logprobs
        return (tokens,)

    def eagerly(self) -> tuple[torch.Tensor, tuple | None]:
        """On the launch thread, without a graph: the tokens on the host, and the logprobs'."""
        tokens, = self.launch(*self.stage_for(self.call.rows).to(self.handle.device))
        return to_host(tokens), logprobs_on_host(self.logprobs)
