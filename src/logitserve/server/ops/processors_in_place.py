"""Sample with logits processors whose lists are in CUDA regions: one launch through a list table
computed on the device from the offsets, replayed from a CUDA graph (issue 45).

A stateless call with processors, logprobs or the kept set is a group of its own
(``SampleCall.key`` is None). It launches here (:func:`takes_table`) when its lists can be held
by address: the ids of every list it sends in a CUDA region on the server's device, int64 (the
table's dtype), the logit bias values float32 there too, no allowed list (the table has no column
for it), on the Triton kernels; and something of the call lives in device memory (a field or the
logits in a CUDA region, logits in a page-locked region, or an output in device memory). Every
other such call launches eagerly with its lists ragged (sample_processors.py): lists as bytes or
in system regions (their bytes are staged, so a graph would hold their lengths), int32 ids, an
allowed list, the torch backend, or nothing in device memory.

The launch: each list's ids address and length (a few int64s, :data:`~logitserve.kernels.sampling.
offsets_table.PLACES`) are staged with the sampling parameters, the penalties, min_tokens, and the
fields sent as bytes; one kernel turns the offsets into the list table (each row's address = ids'
address + offsets[r] * 8, length = offsets[r + 1] - offsets[r]); the processors read the table;
the tokens are drawn and put into their regions. Nothing it reads changes size with the lists, so
a CUDA graph of it serves every call of the same features, rows and places: it is keyed by those
(``resident.places`` of what is read in place: logits, offsets, per-row fields and bitmask in
regions, the outputs), not by the lists' lengths nor their ids' addresses (both staged), and
captured on its key's second use, as a plain call in regions is (resident.graph_key). Raw
logprobs are drawn in the graph too; the processed mode and the kept set (torch sorting) and a
server without graphs launch the same way, eagerly.

Checks stay where they run on the eager path (processor_checks.py): fields as bytes or in system
regions before the call queues, their checked copies staged; fields in CUDA regions in the launch,
the lists by the table's own kernel (the same rules, a flag per row: the rules are over the whole
list, whose length the graph cannot hold, so torch reductions cannot be captured) and the per-row
parameters by their reductions (:meth:`BulkChecks.of_rows`). The flags come back with the tokens;
one set answers INVALID_ARGUMENT with the message ``BulkChecks.error`` makes. The kernels read a
list in a CUDA region after that check, and its client may write it meanwhile: they are safe
against whatever it holds, not reading the checked values (a copy would cost a kernel a list on
every call): each span is clamped into its ids' length before it becomes an address, and ids
outside [0, V) are skipped (kernels/sampling/offsets_table.py, process_kernels.py).
"""

from __future__ import annotations

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.sampling.offsets_table import PLACES, table_of_offsets
from logitserve.kernels.sampling.params import MIN_TOKENS, PENALTY_PARAMS, RAGGED_LISTS, SEED
from logitserve.kernels.sampling.processors import TABLE_LISTS

from ..engine.staging import Staging, to_host
from ..tensors import DeviceTensor, HostTensor
from .resident import launches_in_place, on_device, places, unstaged
from .sample_processors import LOGPROBS_FIELDS, checked_reads

_PENALTIES = tuple(PENALTY_PARAMS)


def _on_device(t, dtype: torch.dtype, device: torch.device) -> bool:
    return type(t) is DeviceTensor and t.dtype == dtype and t.tensor.device == device


def takes_table(call, handle) -> bool:
    """Whether stateless ``call`` (a group of its own) launches here (module docstring)."""
    procs = call.processors or {}
    if handle.backend == "torch" or call.sequences is not None or RAGGED_LISTS["allowed"][1] in procs:
        return False
    device = handle.device
    for name in TABLE_LISTS:
        ids = procs.get(RAGGED_LISTS[name][0])
        if ids is not None and not _on_device(ids, torch.int64, device):
            return False
    values = procs.get("logit_bias_values")
    if values is not None and not _on_device(values, torch.float32, device):
        return False
    in_regions = [v for v in procs.values() if type(v) is DeviceTensor]
    if any(v.tensor.device != device for v in in_regions):
        return False
    return bool(in_regions) or launches_in_place([call], device)


def _kind(value):
    """What a processor field adds to a graph's key: how it reaches the launch, not its values."""
    if type(value) is DeviceTensor:
        return "in place", value.dtype
    return "staged" if isinstance(value, HostTensor) else value is not None


class OffsetsLaunch:
    """A call that :func:`takes_table`, as staged parts and a launch function over them."""

    def __init__(self, call, handle, names: tuple[str, ...]):
        self.call, self.handle, self.names = call, handle, names
        procs = call.processors or {}
        self.procs = procs
        read = checked_reads(call)
        rows, device = call.rows, handle.device
        # The lists the call sends, by table name: (ids or None, offsets).
        self.lists = {name: (procs.get(ids), procs[offsets]) for name, (ids, offsets, _) in RAGGED_LISTS.items()
                      if name in TABLE_LISTS and offsets in procs}
        self.penalties = [name for name in _PENALTIES if name in procs]
        self.min_tokens = procs.get(MIN_TOKENS.name) if "stop" in self.lists else None
        self.grammar = procs.get("grammar_bitmask")
        self.row_checks = None if call.device_checks is None else call.device_checks.of_rows()
        # The Logprobs fields the launch returns after the tokens (and the checks' flag): the
        # kept set's with return_kept, the others' with logprobs.
        self.logprobs = tuple(name for name in LOGPROBS_FIELDS
                              if (call.return_kept if name == "kept_bitmask" else call.logprobs is not None))
        # Staged after the parameters and the places, by name; read in place: the rest.
        staged: dict[str, HostTensor] = {}
        if self.penalties:
            values = np.empty((len(_PENALTIES), rows), dtype=np.float32)
            for i, name in enumerate(_PENALTIES):
                values[i] = _host_rows(procs.get(name, PENALTY_PARAMS[name].default), read)
            staged["penalties"] = HostTensor(values.tobytes(), torch.float32, values.shape)
        if self.min_tokens is not None and type(self.min_tokens) is not DeviceTensor:
            values = np.empty(rows, dtype=np.int64)
            values[:] = _host_rows(self.min_tokens, read)
            staged["min_tokens"] = HostTensor(values.tobytes(), torch.int64, values.shape)
        for name, (_, offsets) in self.lists.items():
            if type(offsets) is not DeviceTensor:  # the checked copy (Reads), as int64
                staged[name] = HostTensor.of(read(offsets).to(torch.int64))
        for name, t in (("logits", call.logits), ("grammar", self.grammar)):
            if t is not None and not unstaged(t, device):
                staged[name] = t
        self.staged = staged
        # The logits and the bitmask, wherever they are, and the other fields in CUDA regions
        # (the rest are staged above, as copies); of them, those read where they are: in device
        # memory or copied in from a page-locked region.
        self.inputs = [t for t in (call.logits, self.grammar) if t is not None] + \
            [t for t in (*(off for _, off in self.lists.values()), *map(procs.get, _PENALTIES), self.min_tokens)
             if type(t) is DeviceTensor]
        self.fixed = [t for t in self.inputs if unstaged(t, device)]
        self.places = HostTensor(self._places().tobytes(), torch.int64, (PLACES,))

    def _places(self) -> np.ndarray:
        """Each list's ids address and length, then the bias values' address (offsets_table.py)."""
        places = np.zeros(PLACES, dtype=np.int64)
        for i, name in enumerate(TABLE_LISTS):
            ids = self.lists.get(name, (None, None))[0]
            if ids is not None:
                places[2 * i:2 * i + 2] = ids.tensor.data_ptr(), ids.shape[0]
        values = self.procs.get("logit_bias_values")
        if values is not None:
            places[-1] = values.tensor.data_ptr()
        return places

    def key(self):
        """The key of this launch's CUDA graph, or None where it launches eagerly (no graphs here,
        processed logprobs or the kept set, inputs or outputs a graph cannot hold)."""
        call = self.call
        if self.handle.graphs is None or call.return_kept or (call.logprobs is not None and
                                                              call.logprobs_mode != "raw"):
            return None
        where = places(self.inputs, call.outputs, self.handle)
        if where is None:
            return None
        features = tuple((name, _kind(value)) for name, value in sorted(self.procs.items()))
        return (("sample", "lists in place", call.logits.dtype, call.logits.shape, call.filter_order,
                 call.random_val is None, features, call.logprobs, tuple(self.staged)), *where)

    def stage_for(self, batch_rows: int) -> Staging:
        """The parameters (padded to ``batch_rows`` with zeros), the places, then the staged parts."""
        stage = Staging()
        for part in self.call.params:
            stage.add([part], rows=batch_rows, zero_padding=True)
        stage.add([self.places])
        for part in self.staged.values():
            stage.add([part])
        return stage

    def launch(self, float_rows, int_rows, places, *rest) -> tuple[torch.Tensor, ...]:
        """The table from the offsets, the processors and the draw over the call's rows, the
        outputs into their regions (launch thread, or captured). Returns the tokens, the checks'
        flag (``[1]`` bool) when a field is in a CUDA region, then the logprobs asked for."""
        call, device, backend = self.call, self.handle.device, self.handle.backend
        rows = call.rows
        staged = dict(zip(self.staged, rest))

        def tensor(name, t):
            return staged[name] if name in staged else on_device(t, device)

        params = dict(zip(self.names, (*float_rows[:rows].unbind(1), *int_rows[:rows].unbind(1))))
        kw, flags = {}, []
        if self.lists:
            offsets = {name: tensor(name, off) for name, (_, off) in self.lists.items()}
            min_tokens = None if self.min_tokens is None else tensor("min_tokens", self.min_tokens)
            table, broken_rows = table_of_offsets(offsets, places, call.logits.shape[1], min_tokens, backend)
            kw["list_table"] = table
            flags.append(broken_rows.any())
        for i, name in enumerate(_PENALTIES if self.penalties else ()):
            value = self.procs.get(name)
            kw[name] = value.torch().to(torch.float32) if type(value) is DeviceTensor else staged["penalties"][i]
        if self.grammar is not None:
            kw["grammar_bitmask"] = tensor("grammar", self.grammar)
        if call.logprobs is not None:
            kw.update(logprobs=call.logprobs, logprobs_mode=call.logprobs_mode)
        if call.return_kept:
            kw["return_kept"] = True
        if self.row_checks is not None:
            flags.append(self.row_checks.in_launch())
        result = kernels.sample(tensor("logits", call.logits), **params, filter_order=call.filter_order,
                                backend=backend, **kw)
        tokens, logprobs = result if self.logprobs else (result, None)
        call.put_outputs(tokens, params[SEED.name])
        checked = (torch.stack(flags).any().reshape(1),) if call.device_checks is not None else ()
        return (tokens, *checked, *(getattr(logprobs, name) for name in self.logprobs))

    def eagerly(self) -> list[np.ndarray]:
        """On the launch thread, without a graph: :meth:`launch`'s outputs on the host (read once
        the stream is done)."""
        outputs = self.launch(*self.stage_for(self.call.rows).to(self.handle.device))
        return [to_host(out).numpy() for out in outputs]

    def answer(self, outputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None, tuple | None]:
        """``(tokens, the checks' flag or None, the logprobs as SampleResult takes them or None)``."""
        tokens, *rest = outputs
        flag = rest.pop(0) if self.call.device_checks is not None else None
        if not self.logprobs:
            return tokens, flag, None
        got = dict(zip(self.logprobs, rest))
        return tokens, flag, tuple(torch.from_numpy(got[name]) if name in got else None
                                   for name in LOGPROBS_FIELDS)


def _host_rows(value, read) -> np.ndarray | float | int:
    """A per-row field's values for a staged column: a scalar as it is, bytes or a system
    region's (the checked copy) as an array, a CUDA region's left to the launch (0 here)."""
    if type(value) is DeviceTensor:
        return 0
    if isinstance(value, HostTensor):
        return read(value).numpy()
    return value


async def run_with_table(call, handle, names: tuple[str, ...]):
    """``call`` launched here: from its graph where it has one (module docstring), else
    eagerly. Returns ``(tokens, logprobs)``; ``ValueError`` naming the first field in a CUDA
    region that breaks a rule."""
    launch = OffsetsLaunch(call, handle, names)
    key = launch.key()
    if key is not None and (not launch.fixed or handle.graphs.seen_again(key)):
        outputs = await handle.launch(key, call.rows, launch.stage_for, launch.launch)
    else:
        outputs = await handle.run(launch.eagerly)
    tokens, flag, logprobs = launch.answer(outputs)
    if flag is not None and flag[0]:
        raise ValueError(await handle.run(call.device_checks.error))
    return tokens, logprobs
