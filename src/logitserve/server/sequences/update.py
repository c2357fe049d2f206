"""UpdateSequences: each SequenceUpdate checked into a change of its sequence's
:class:`~.sequences.SequenceState` (a set field replaces, an unset one keeps), then applied to
the caller's open sequences all or none; their outputs and steps are kept.

The rules are OpenSequences' (sequences/open.py), checked the same way: in bulk, on a worker
thread, the replacing lists copied to the server's device there. A broken rule is a
``ValueError`` naming ``updates[i].<field>`` (INVALID_ARGUMENT); an id the caller has no open
sequence of is NOT_FOUND, and nothing changes.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import torch

from logitserve.kernels.sampling.params import (FREQUENCY_PENALTY, MIN_P, MIN_TOKENS, PRESENCE_PENALTY,
                                                REPETITION_PENALTY, SEED, TEMPERATURE, TOP_K, TOP_P)
from logitserve.v1 import logitserve_pb2 as pb

from .sequence import ID_BYTES, SequenceState
from .table import SequenceTable
from .open import check_bias, check_ids, check_param, distinct_ids, max_id

# The parameters an update may set (the step is the sequence's own: kept).
_PARAMS = (TEMPERATURE, TOP_K, TOP_P, MIN_P, SEED, REPETITION_PENALTY, FREQUENCY_PENALTY, PRESENCE_PENALTY,
           MIN_TOKENS)
# The list fields an update may replace (TokenIds messages) -> SequenceState's attribute.
_LISTS = {"prompt_token_ids": "prompt", "banned_token_ids": "banned", "stop_token_ids": "stop"}


def _change(update: pb.SequenceUpdate, path: str, device: torch.device, max_vocab: int):
    """``update`` checked, its lists on ``device``; the function of a SequenceState that gives
    the updated one (run under the table's lock: it only assembles)."""
    params = {p.name: check_param(update, p, path) for p in _PARAMS if update.HasField(p.name)}
    lists = {attr: check_ids(getattr(update, name).ids, f"{path}{name}.ids", max_vocab)
             for name, attr in _LISTS.items() if update.HasField(name)}
    on = {}
    if update.HasField("logit_bias"):
        lists["bias_ids"] = check_ids(update.logit_bias.ids, f"{path}logit_bias.ids", max_vocab)
        bias = check_bias(update.logit_bias.values, lists["bias_ids"].shape[0], f"{path}logit_bias.values",
                          f"{path}logit_bias.ids")
        on["bias_values"] = torch.from_numpy(bias).to(device)
    on.update({attr: torch.from_numpy(ids).to(device) for attr, ids in lists.items()})
    max_ids = {attr: max_id(ids) for attr, ids in lists.items()}

    def change(state: SequenceState) -> SequenceState:
        return dataclasses.replace(state, params=dataclasses.replace(state.params, **params), **on,
                                   max_ids={**state.max_ids, **max_ids})
    return change


def _changes(request: pb.UpdateSequencesRequest, device: torch.device, max_vocab: int) -> list:
    return [(u.id, _change(u, f"updates[{i}].", device, max_vocab)) for i, u in enumerate(request.updates)]


def _replaced(update: pb.SequenceUpdate) -> dict[str, int]:
    """The bytes of each list ``update`` replaces, by SequenceState attribute, read off the
    request before anything is built."""
    sizes = {attr: ID_BYTES * len(getattr(update, name).ids) for name, attr in _LISTS.items() if update.HasField(name)}
    if update.HasField("logit_bias"):
        sizes["bias_ids"] = ID_BYTES * len(update.logit_bias.ids)
        sizes["bias_values"] = np.dtype(np.float32).itemsize * len(update.logit_bias.values)
    return sizes


async def update_sequences(table: SequenceTable, request: pb.UpdateSequencesRequest, owner: str | None,
                           max_vocab: int) -> pb.UpdateSequencesResponse:
    """The UpdateSequences handler's work: refused before any change is built where it can be
    (more updates than can be open, an id twice, an id not open, more bytes than the bounds
    leave), checked and copied off the loop, then applied."""
    table.check_named(len(request.updates), "updates")
    ids = distinct_ids(request.updates, lambda i: f"updates[{i}].id")
    table.check_update(owner, ids, [_replaced(u) for u in request.updates])
    changes = await asyncio.to_thread(_changes, request, table.device, max_vocab)
    return pb.UpdateSequencesResponse(steps=table.update(owner, changes))
