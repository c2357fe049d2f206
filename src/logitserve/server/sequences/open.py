"""OpenSequences and CloseSequences: each SequenceSpec checked into a :class:`~.sequences.Sequence`
(its lists copied to the server's device), and the table's answers.

The rules are Sample's (``kernels/sampling/params.py``: each parameter in its range, in float32
too for a float; token ids >= 0; bias values finite in float32), plus: token ids below
``--max-vocab`` (each Sample checks them against its own vocabulary, by the largest id a
sequence holds), bias values one per bias id, ids distinct within the request. A broken rule is
a ``ValueError`` naming ``sequences[i].<field>`` and the rule (INVALID_ARGUMENT). A prompt can
be long: the whole request is checked and copied on a worker thread, in bulk (numpy and torch
reductions, never a loop over a list's elements), off the event loop. ``open_specs`` is the one
open path (the KServe front's sequence_start opens through it too); the checks are
UpdateSequences' as well (sequences/update.py).
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import torch

from logitserve.kernels.sampling.params import (FREQUENCY_PENALTY, MIN_P, MIN_TOKENS, PRESENCE_PENALTY,
                                                REPETITION_PENALTY, SEED, SEED_BITS, STEP, TEMPERATURE, TOP_K, TOP_P)
from logitserve.v1 import logitserve_pb2 as pb

from ..errors import TooLarge, Unsupported
from .sequence import ID_BYTES, Sequence, SequenceParams, SequenceState
from .table import SequenceTable

# The parameters a SequenceSpec may set, in the order they are checked.
_PARAMS = (TEMPERATURE, TOP_K, TOP_P, MIN_P, SEED, REPETITION_PENALTY, FREQUENCY_PENALTY, PRESENCE_PENALTY,
           MIN_TOKENS)
# Room left above a sequence's first step for the steps to come (the kernels take steps < 2**63).
MAX_FIRST_STEP = 1 << 62
_LISTS = ("prompt_token_ids", "output_token_ids", "logit_bias_ids", "banned_token_ids", "stop_token_ids")
# SequenceSpec's lists that a SequenceState holds -> its attribute.
STATE_LISTS = {"prompt_token_ids": "prompt", "logit_bias_ids": "bias_ids", "banned_token_ids": "banned",
               "stop_token_ids": "stop"}


def check_param(spec, param, path: str):
    """``spec``'s value of ``param`` (its default when unset), by the kernels' rule."""
    if not spec.HasField(param.name):
        return param.default
    value = getattr(spec, param.name)
    if not param.ok(value):
        raise ValueError(f"{path}{param.name}: must be {param.rule}, got {value}")
    if param.kind is float:
        with np.errstate(over="ignore"):
            rounded = float(np.float32(value))
        if not param.ok(rounded):
            raise ValueError(f"{path}{param.name}: must be {param.rule} in float32, the precision the kernels use, "
                             f"got {value}")
    return value


def check_ids(values, name: str, max_vocab: int) -> np.ndarray:
    """A list field's ``values`` as int64, each id in [0, max_vocab) (checked in bulk)."""
    ids = np.asarray(values, dtype=np.int64)
    bad = (ids < 0) | (ids >= max_vocab)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"{name}[{i}]: must be a token id in [0, {max_vocab}) (--max-vocab), got {ids[i]}")
    return ids


def check_bias(values, count: int, name: str, ids_name: str) -> np.ndarray:
    """Logit bias ``values`` as float32: one per id (``count`` of ``ids_name``), each finite."""
    bias = np.asarray(values, dtype=np.float64)
    if bias.shape[0] != count:
        raise ValueError(f"{name}: must have one value per {ids_name} entry ({count}), got {bias.shape[0]}")
    with np.errstate(over="ignore"):
        bias32 = bias.astype(np.float32)
    bad = ~np.isfinite(bias32)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"{name}[{i}]: must be finite in float32, got {bias[i]}")
    return bias32


def max_id(ids: np.ndarray) -> int:
    return int(ids.max()) if ids.size else -1


def sequence_of(spec: pb.SequenceSpec, path: str, owner: str | None, device: torch.device,
                max_vocab: int) -> Sequence:
    """One SequenceSpec checked, its lists on ``device``; ``ValueError`` naming the field."""
    values = {p.name: check_param(spec, p, path) for p in _PARAMS}
    if values["seed"] is None:
        values["seed"] = secrets.randbits(SEED_BITS)
    step = spec.step if spec.HasField("step") else STEP.default
    if not 0 <= step < MAX_FIRST_STEP:
        raise ValueError(f"{path}step: must be in [0, 2**62) (room for the steps to come), got {step}")
    lists = {name: check_ids(getattr(spec, name), f"{path}{name}", max_vocab) for name in _LISTS}
    bias = check_bias(spec.logit_bias_values, lists["logit_bias_ids"].shape[0], f"{path}logit_bias_values",
                      "logit_bias_ids")
    output = lists.pop("output_token_ids")
    on = {name: torch.from_numpy(ids).to(device) for name, ids in lists.items()}
    state = SequenceState(params=SequenceParams(**values), prompt=on["prompt_token_ids"],
                          bias_ids=on["logit_bias_ids"], bias_values=torch.from_numpy(bias).to(device),
                          banned=on["banned_token_ids"], stop=on["stop_token_ids"],
                          max_ids={attr: max_id(lists[name]) for name, attr in STATE_LISTS.items()})
    return Sequence(owner=owner, id=spec.id, state=state, step=step, output=torch.from_numpy(output).to(device),
                    output_len=int(output.shape[0]), output_max_id=max_id(output))


def distinct_ids(items, field) -> list[int]:
    """The ``id`` of each of ``items`` (specs or updates); ``ValueError`` naming ``field(i)`` of
    the first id given twice."""
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        first: dict[int, int] = {}
        for i, seq_id in enumerate(ids):
            if first.setdefault(seq_id, i) != i:
                raise ValueError(f"{field(i)}: {seq_id} appears twice in this request (also {field(first[seq_id])})")
    return ids


def spec_bytes(spec: pb.SequenceSpec) -> int:
    """The bytes ``spec``'s sequence will hold once built (its lists: int64 ids, float32 bias
    values), read off the request before anything is built."""
    return (ID_BYTES * sum(len(getattr(spec, name)) for name in _LISTS)
            + np.dtype(np.float32).itemsize * len(spec.logit_bias_values))


async def open_specs(table: SequenceTable, specs: list, owner: str | None, max_vocab: int, *,
                     what: str = "OpenSequences", path=lambda i: f"sequences[{i}].",
                     id_field=lambda i: f"sequences[{i}].id") -> list[Sequence]:
    """``specs`` (SequenceSpecs) checked and copied off the loop, then opened, all or none: the
    one open path of both fronts. ``what`` names the request, ``path(i)`` the i-th spec's
    fields and ``id_field(i)`` its id in messages (the KServe front's differ).

    What can be refused without building a sequence is, first: too many (before a spec is
    read), an id twice, an id open already, more bytes than the bounds leave; a request refused
    there costs no copy."""
    if table.shared_port:
        raise Unsupported(f"{what}: this server process shares its port with other server processes (--workers, or "
                          f"--reuse-port on), each holding its own sequences, and each connection reaches any one of "
                          f"them: a sequence opened through one connection would be NOT_FOUND through another. Run "
                          f"one server process per port (--workers 1), or one per GPU with --devices (each on a "
                          f"port of its own)")
    if table.max_sequences == 0:
        raise TooLarge(f"{what}: this server keeps no sequences (--max-sequences 0); send each row's parameters "
                       f"and lists with Sample instead")
    table.check_room(owner, len(specs), 0, what)
    ids = distinct_ids(specs, id_field)
    table.check_absent(owner, ids, id_field)
    table.check_room(owner, len(specs), sum(spec_bytes(spec) for spec in specs), what)
    sequences = await asyncio.to_thread(
        lambda: [sequence_of(spec, path(i), owner, table.device, max_vocab) for i, spec in enumerate(specs)])
    table.open(sequences, id_field, what)
    return sequences


async def open_sequences(table: SequenceTable, request: pb.OpenSequencesRequest, owner: str | None,
                         max_vocab: int) -> pb.OpenSequencesResponse:
    """The OpenSequences handler's work."""
    sequences = await open_specs(table, request.sequences, owner, max_vocab)
    return pb.OpenSequencesResponse(seeds=[s.params.seed for s in sequences])


def close_sequences(table: SequenceTable, request: pb.CloseSequencesRequest,
                    owner: str | None) -> pb.CloseSequencesResponse:
    """The CloseSequences handler's work: at most --max-sequences ids a call (more could never
    all be open), refused before they are walked."""
    table.check_named(len(request.ids), "ids")
    return pb.CloseSequencesResponse(closed_ids=table.close(owner, request.ids))
