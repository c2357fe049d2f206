"""VerifyDraft: ``kernels.verify`` (chain speculative sampling) on draft tokens, the draft's distribution
and the target's logits, with the target's sampling parameters scalar or per row.

The parameters are Sample's, checked by the same rules (``kernels/sampling/params.py``, through
``sample_params.wire_param``); the draft temperature keeps the temperature's rule. A launch does only what
its rows ask: where no row sets top_k, top_p or min_p, the filters go to the kernels as off
(scalars), which skips their launches (``kernels.verify``: the candidate gather and the
thresholds) and the filtered walk; calls with and without filters batch apart (``key``).

Per-row parameters in CUDA regions are read on a worker thread before the call queues
(:meth:`VerifyDraftCall.checked`, as Sample's are): a copy from the device waits for it, which
the event loop must not.

A lone call whose tensors are all in the client's device memory (or page-locked regions)
replays a CUDA graph, as Sample's does (server/ops/resident.py: keyed by the places, captured on
a key's second use); other batches launch eagerly on the device's launch thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.sampling.params import MIN_P, SEED, STEP, TEMPERATURE, TOP_K, TOP_P
from logitserve.kernels.verify import DRAFT_TEMPERATURE
from logitserve.v1 import logitserve_pb2 as pb

from ..engine.staging import to_host
from ..tensors import FLOATS, INTS, NOT_IN_PLACE, DeviceTensor, HostTensor, from_array, tensor_field
from .batching import split
from .limits import Limits, answer_bytes
from .resident import Outputs, column_stage, device_inputs, graph_key, launches_in_place, on_device
from .sample import WIRE_FILTER_ORDERS
from .processor_checks import off_loop
from .sample_params import DeviceRows, draw_seeds, param_rows, read_device_rows, take_device_rows, wire_param

# The packed per-row columns, as the launch passes them to kernels.verify: float32, then int64.
FLOAT_COLUMNS = (TEMPERATURE.name, TOP_P.name, MIN_P.name, DRAFT_TEMPERATURE.name)
INT_COLUMNS = (TOP_K.name, SEED.name, STEP.name)
DRAFT_FIELDS = ("draft_probs", "draft_logits")
OUTPUT_NAMES = ("token_ids", "num_accepted", "valid", "seeds")


def _shapes(rows: int, n: int) -> dict:
    return {"token_ids": (torch.int64, (rows, n + 1)), "num_accepted": (torch.int64, (rows,)),
            "valid": (torch.bool, (rows,)), "seeds": (torch.int64, (rows,))}


def _check_ids(ids, vocab: int, name: str) -> None:
    """Every draft token in [0, V): the kernels would answer an outside one with an invalid row."""
    values = np.asarray(ids.tolist(), dtype=np.int64).reshape(ids.shape)
    bad = np.argwhere((values < 0) | (values >= vocab))
    if len(bad):
        row, col = bad[0].tolist()
        raise ValueError(f"{name}[{row}, {col}]: must be in [0, V) with V = {vocab} (target_logits.shape[2]), "
                         f"got {values[row, col]}")


@dataclass(eq=False)
class VerifyDraftCall:
    """``kernels.verify`` on ``draft_token_ids [B, n]``, the draft ``[B, n, V]`` and ``target_logits [B, n + 1, V]``."""

    draft_token_ids: HostTensor
    draft: HostTensor
    from_logits: bool
    target_logits: HostTensor
    values: dict  # each parameter of FLOAT_COLUMNS and INT_COLUMNS: a scalar or one value per row
    filter_order: str
    outputs: Outputs | None = None
    regions: object = None
    answer_size: int = 0  # the answer's message size (limits.answer_bytes)
    device_rows: dict[str, DeviceRows] | None = None  # per-row parameters still in CUDA regions (checked reads them)

    op = "verify_draft"

    @classmethod
    def from_pb(cls, msg: pb.VerifyDraftRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None) -> "VerifyDraftCall":
        ids = tensor_field(msg, "draft_token_ids", path, in_place, dtypes=INTS, ranks=(2,), regions=regions)
        target = tensor_field(msg, "target_logits", path, in_place, dtypes=FLOATS, ranks=(3,), regions=regions)
        rows, n = ids.shape
        if tuple(target.shape[:2]) != (rows, n + 1):
            raise ValueError(f"{path}target_logits.shape: must be [B, n + 1, V] = [{rows}, {n + 1}, V] (B, n from "
                             f"draft_token_ids.shape), got {list(target.shape)}")
        vocab = target.shape[2]
        limits.check(f"{path}target_logits", rows * (n + 1), vocab)
        given = [name for name in DRAFT_FIELDS if msg.HasField(name)]
        if len(given) != 1:
            raise ValueError(f"{path}draft_probs / draft_logits: exactly one must be set, got "
                             f"{' and '.join(given) or 'neither'}")
        draft_name = given[0]
        draft = tensor_field(msg, draft_name, path, in_place, dtypes=FLOATS, ranks=(3,), regions=regions)
        if tuple(draft.shape) != (rows, n, vocab):
            raise ValueError(f"{path}{draft_name}.shape: must be [B, n, V] = [{rows}, {n}, {vocab}] (B, n from "
                             f"draft_token_ids.shape, V from target_logits.shape), got {list(draft.shape)}")
        from_logits = draft_name == "draft_logits"
        if not from_logits and (msg.HasField("draft_temperature") or msg.HasField("draft_temperature_rows")):
            raise ValueError(f"{path}draft_temperature: applies only with draft_logits")
        if type(ids) is not DeviceTensor:  # in the client's device memory: checked in the launch
            _check_ids(ids, vocab, f"{path}draft_token_ids")
        if msg.filter_order not in WIRE_FILTER_ORDERS:
            raise ValueError(f"{path}filter_order: unknown value {msg.filter_order}")
        values = {p.name: wire_param(msg, p, rows, path, regions, device_rows=True)
                  for p in (SEED, TEMPERATURE, TOP_K, TOP_P, MIN_P, STEP, DRAFT_TEMPERATURE)}
        device_rows = take_device_rows(values) or None
        if values["seed"] is None:
            values["seed"] = draw_seeds(rows)
        shapes = _shapes(rows, n)
        outputs = Outputs.of(msg, "VerifyDraft", regions, path, shapes)
        size = answer_bytes(pb.VerifyDraftResponse, shapes, outputs)
        limits.check_answer(f"{path}target_logits", size)
        return cls(ids, draft, from_logits, target, values, WIRE_FILTER_ORDERS[msg.filter_order], outputs, regions,
                   size, device_rows)

    async def checked(self) -> None:
        """The per-row parameters in CUDA regions read and checked on a worker thread
        (``ValueError`` naming the field, the row and the rule): the batcher awaits this before it
        queues the call, whose key (``filtered``) reads them."""
        if self.device_rows is not None:
            self.values.update(await off_loop(read_device_rows, self.device_rows))
            self.device_rows = None

    @property
    def inputs(self) -> tuple:
        return (self.draft_token_ids, self.draft, self.target_logits)

    @property
    def rows(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def filtered(self) -> bool:
        """Whether a row sets a filter: top_k in (0, V), top_p below 1, min_p above 0."""
        def values(name):
            value = self.values[name]
            return value if isinstance(value, list) else [value]

        vocab = self.target_logits.shape[2]
        return any(0 < k < vocab for k in values(TOP_K.name)) or any(p < 1 for p in values(TOP_P.name)) or \
            any(m > 0 for m in values(MIN_P.name))

    @property
    def key(self):
        """Calls with equal dtypes, n, V, draft kind, filter order and filtering share a launch."""
        return (self.op, self.draft_token_ids.dtype, self.draft.dtype, self.target_logits.dtype,
                *self.target_logits.shape[1:], self.from_logits, self.filter_order, self.filtered)

    def seeds(self) -> list[int]:
        seed = self.values["seed"]
        return seed if isinstance(seed, list) else [seed] * self.rows

    def columns(self) -> tuple[HostTensor, HostTensor]:
        """The parameters as per-row float32 and int64 columns (``FLOAT_COLUMNS``, ``INT_COLUMNS``)."""
        return (param_rows([self.values[name] for name in FLOAT_COLUMNS], self.rows, torch.float32),
                param_rows([self.values[name] for name in INT_COLUMNS], self.rows, torch.int64))

    @classmethod
    async def run_batch(cls, calls: list["VerifyDraftCall"], handle) -> list["VerifyDraftResult"]:
        if len(calls) == 1 and launches_in_place(calls, handle.device):
            key = graph_key(calls[0], handle)
            if key is not None and handle.graphs.seen_again(key):
                return [await _replay_in_place(calls[0], key, handle)]
        return await handle.run(_launch_on_thread, calls, handle)


def _verify(first: VerifyDraftCall, ids, draft, target, floats, ints, backend: str):
    """``kernels.verify`` of a batch of calls like ``first`` over its device tensors; the filters
    passed as off where no row sets one (``VerifyDraftCall.filtered``)."""
    params = dict(zip(FLOAT_COLUMNS + INT_COLUMNS, (*floats.unbind(1), *ints.unbind(1))))
    draft_temperature = params.pop(DRAFT_TEMPERATURE.name)
    if not first.filtered:
        params.update({TOP_K.name: 0, TOP_P.name: 1.0, MIN_P.name: 0.0})
    draft_arg = dict(draft_logits=draft, draft_temperature=draft_temperature) if first.from_logits else \
        dict(draft_probs=draft)
    return kernels.verify(ids, target, **draft_arg, **params, filter_order=first.filter_order, backend=backend)


async def _replay_in_place(call: VerifyDraftCall, key, handle) -> "VerifyDraftResult":
    """A lone call on tensors in the client's device memory (or page-locked regions), from the
    CUDA graph of ``key``: the parameters staged, the outputs named in output_regions written by
    the graph, the others brought back."""
    rows = call.rows
    floats, ints = call.columns()

    vocab = call.target_logits.shape[2]

    def launch(float_rows, int_rows):
        ids, draft, target = (on_device(t, handle.device) for t in call.inputs)
        result = _verify(call, ids, draft, target, float_rows[:rows], int_rows[:rows], handle.backend)
        written = dict(zip(OUTPUT_NAMES, (*result, int_rows[:rows, INT_COLUMNS.index(SEED.name)])))
        for name in call.outputs.slots if call.outputs is not None else ():
            call.outputs.put(name, written[name])
        # The draft tokens' check (from_pb leaves ids in device memory to the launch): read back
        # with the outputs. The kernels answer a row with an id outside [0, V) invalid.
        return (*result, ((ids < 0) | (ids >= vocab)).any().reshape(1))

    *outs, broken = await handle.launch(key, rows, column_stage(floats, ints), launch)
    if broken[0]:
        await handle.run(_check_ids, call.draft_token_ids, vocab, "draft_token_ids")
    values = {name: torch.from_numpy(value) for name, value in zip(OUTPUT_NAMES, outs)
              if call.outputs is None or name not in call.outputs}
    return VerifyDraftResult(values, call.seeds(), call.outputs)


def _launch_on_thread(calls: list[VerifyDraftCall], handle) -> list["VerifyDraftResult"]:
    """On the launch thread: the calls in one launch; each call's outputs put into its regions or
    brought to the host."""
    for c in calls:  # draft tokens in device memory, which from_pb left to the launch
        if type(c.draft_token_ids) is DeviceTensor:
            _check_ids(c.draft_token_ids, c.target_logits.shape[2], "draft_token_ids")
    columns = [c.columns() for c in calls]
    ids, draft, target, floats, ints = device_inputs(
        handle, [c.draft_token_ids for c in calls], [c.draft for c in calls], [c.target_logits for c in calls],
        [f for f, _ in columns], [i for _, i in columns])
    result = _verify(calls[0], ids, draft, target, floats, ints, handle.backend)
    sizes = [c.rows for c in calls]
    results = []
    for c, tokens, accepted, valid in zip(calls, *(split(t, sizes) for t in result)):
        outs = {"token_ids": tokens, "num_accepted": accepted, "valid": valid}
        if c.outputs is not None and c.outputs.on_device:
            outs["seeds"] = torch.tensor(c.seeds(), dtype=torch.int64)
            for name in [name for name in outs if name in c.outputs]:
                c.outputs.put(name, outs.pop(name))
        results.append(VerifyDraftResult({name: to_host(value) for name, value in outs.items()}, c.seeds(),
                                         c.outputs))
    return results


@dataclass
class VerifyDraftResult:
    # The outputs still to answer (host tensors, read once the stream is done): token_ids,
    # num_accepted, valid; those put into device regions are absent.
    values: dict
    seeds: list[int]
    outputs: Outputs | None = None  # the outputs that go into regions

    def to_pb(self) -> pb.VerifyDraftResponse:
        response = pb.VerifyDraftResponse()
        arrays = {name: value.numpy() for name, value in self.values.items()}
        arrays["seeds"] = np.asarray(self.seeds, dtype=np.int64)
        for name in OUTPUT_NAMES:
            if self.outputs is not None and name in self.outputs:
                if name in self.values or (name == "seeds" and not self.outputs.on_device):
                    self.outputs.write(name, arrays[name])  # a system region: written from the host
                getattr(response, name).CopyFrom(self.outputs.message(name))
            else:
                getattr(response, name).CopyFrom(from_array(arrays[name]))
        return response

