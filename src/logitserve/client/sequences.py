"""Sequences: sampling state the server keeps per sequence (OpenSequences, UpdateSequences,
CloseSequences, and ``Sample`` by ``sequence_ids``), written once for ``Client`` and
``AsyncClient``.

:class:`SequenceMethods` is a mixin of :class:`~.client._Methods` (it uses ``_simple`` and
``sample``). A sequence is opened with its parameters and lists once; each call then names it
and sends only the logits (and a grammar bitmask, which changes every step); the server draws
with the sequence's state, appends the token to its output and advances its step::

    with client.open_sequences([{"id": 1, "prompt_token_ids": prompt, "seed": 7, "top_p": 0.9,
                                 "repetition_penalty": 1.1}]) as seqs:
        for _ in range(steps):
            token = seqs.sample(next_logits()).token_ids       # == client.sample(..., sequence_ids=seqs.ids)

``async with await aclient.open_sequences(...) as seqs`` for :class:`~.client.AsyncClient`
(``await seqs.sample(...)``). Ids are the caller's int64s, apart from other bearer tokens'.

A :class:`Sequences` knows each sequence's step and sends it (``sequence_steps``), so that a
call that failed (DEADLINE_EXCEEDED, UNAVAILABLE: the server may have drawn or not) is safe to
make again: the server answers the tokens it drew then, or draws them now, never twice.
"""

from __future__ import annotations

import inspect
from typing import Iterable, Mapping

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import balancing
from .transport import CLIENT_TIMEOUT

_SCALARS = ("temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "min_tokens")
_LISTS = ("prompt_token_ids", "output_token_ids", "banned_token_ids", "stop_token_ids")


def _ints(values) -> list[int]:
    return [int(i) for i in np.asarray(values, dtype=np.int64).reshape(-1)]


def sequence_spec(id: int, *, logit_bias: Mapping[int, float] | None = None, **fields) -> pb.SequenceSpec:
    """A ``SequenceSpec``: ``id`` and any of the sampling parameters (``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``seed``, ``step``: the first call's, then one more a call), the
    penalties, ``min_tokens``, and the lists as token ids (``prompt_token_ids``,
    ``output_token_ids``, ``banned_token_ids``, ``stop_token_ids``: arrays, tensors or lists);
    ``logit_bias``: ``{token id: bias}``. Unset: the server's defaults (a seed is drawn)."""
    spec = pb.SequenceSpec(id=int(id))
    for name, value in fields.items():
        if name in _SCALARS:
            if value is not None:
                setattr(spec, name, value)
        elif name in _LISTS:
            getattr(spec, name).extend(_ints(value))
        else:
            raise TypeError(f"sequence_spec() got an unexpected keyword argument {name!r}")
    for token, bias in (logit_bias or {}).items():
        spec.logit_bias_ids.append(int(token))
        spec.logit_bias_values.append(float(bias))
    return spec


_UPDATE_SCALARS = tuple(name for name in _SCALARS if name != "step")
_UPDATE_LISTS = tuple(name for name in _LISTS if name != "output_token_ids")


def sequence_update(id: int, *, logit_bias: Mapping[int, float] | None = None, **fields) -> pb.SequenceUpdate:
    """A ``SequenceUpdate``: ``id`` and what changes, as :func:`sequence_spec` takes it but for
    ``step`` and ``output_token_ids`` (the sequence keeps its own). A field left out, or None,
    is kept; a list given replaces the sequence's (``[]`` empties it), ``logit_bias={}`` too."""
    update = pb.SequenceUpdate(id=int(id))
    for name, value in fields.items():
        if name not in _UPDATE_SCALARS + _UPDATE_LISTS:
            raise TypeError(f"sequence_update() got an unexpected keyword argument {name!r}")
        if value is None:
            continue
        if name in _UPDATE_SCALARS:
            setattr(update, name, value)
        else:
            getattr(update, name).SetInParent()  # set, even when empty: replaces the list
            getattr(update, name).ids.extend(_ints(value))
    if logit_bias is not None:
        update.logit_bias.SetInParent()
        for token, bias in logit_bias.items():
            update.logit_bias.ids.append(int(token))
            update.logit_bias.values.append(float(bias))
    return update


class Sequences:
    """Open sequences: ``ids`` (in the order opened), the ``seeds`` they use and the ``steps``
    they draw next. A context manager (``with`` / ``async with``) that closes them;
    :meth:`sample` names them all, one row of the logits each, in ``ids`` order."""

    def __init__(self, client, ids: list[int], seeds: list[int], steps: list[int]):
        self._client = client
        self.ids = ids
        self.seeds = seeds
        self.steps = steps

    def sample(self, logits, **options):
        """``client.sample(logits, sequence_ids=self.ids, sequence_steps=self.steps, **options)``,
        then ``steps`` advanced by one: options are those a sequence leaves to the call
        (``grammar_bitmask``, ``logprobs``, ``logprobs_mode``, ``return_kept``,
        ``filter_order``, ``out``, ``stream``, ``timeout``). A call that raised leaves
        ``steps`` as they were: calling again with the same options is safe (the server
        answers what it drew for those steps, if it drew). After ``update_sequences`` or
        a Sample made without this object, set ``steps`` from the server's answer."""
        answer = self._client.sample(logits, sequence_ids=self.ids, sequence_steps=self.steps, **options)
        if inspect.isawaitable(answer):  # an AsyncClient's
            return self._advanced_once(answer)
        self._advance()
        return answer

    async def _advanced_once(self, answer):
        result = await answer
        self._advance()
        return result

    def _advance(self) -> None:
        self.steps = [step + 1 for step in self.steps]

    def close(self, *, timeout=CLIENT_TIMEOUT):
        """Close them (the ids closed; awaitable with an AsyncClient)."""
        return self._client.close_sequences(self.ids, timeout=timeout)

    def __enter__(self) -> "Sequences":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "Sequences":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class SequenceMethods:
    """OpenSequences, UpdateSequences and CloseSequences; sample by ids with
    ``sample(..., sequence_ids=ids)``. A sequence belongs to one server: a round_robin client
    refuses these methods (:mod:`.balancing`)."""

    def open_sequences(self, sequences: Iterable, *, timeout=CLIENT_TIMEOUT) -> Sequences:
        """Open ``sequences`` (each a dict of :func:`sequence_spec`'s keywords, ``id`` included,
        or a ``SequenceSpec``), all or none; a :class:`Sequences` of them. Errors:
        ALREADY_EXISTS (an id open already), RESOURCE_EXHAUSTED (past the server's
        ``--max-sequences``), INVALID_ARGUMENT naming ``sequences[i].<field>``."""
        balancing.require_one_server(self, "open_sequences")
        specs = [s if isinstance(s, pb.SequenceSpec) else sequence_spec(**s) for s in sequences]
        ids, steps = [s.id for s in specs], [s.step for s in specs]  # step unset: 0, the server's default
        return self._simple("OpenSequences", pb.OpenSequencesRequest(sequences=specs), pb.OpenSequencesResponse,
                            lambda m: Sequences(self, ids, list(m.seeds), steps), timeout)

    def update_sequences(self, updates: Iterable, *, timeout=CLIENT_TIMEOUT) -> list[int]:
        """Change open sequences (each a dict of :func:`sequence_update`'s keywords, ``id``
        included, or a ``SequenceUpdate``), all or none, keeping their outputs and steps; each
        one's step (its next Sample's). Errors: NOT_FOUND (an id not open for this caller),
        INVALID_ARGUMENT naming ``updates[i].<field>``."""
        balancing.require_one_server(self, "update_sequences")
        request = pb.UpdateSequencesRequest(
            updates=[u if isinstance(u, pb.SequenceUpdate) else sequence_update(**u) for u in updates])
        return self._simple("UpdateSequences", request, pb.UpdateSequencesResponse, lambda m: list(m.steps), timeout)

    def close_sequences(self, ids, *, timeout=CLIENT_TIMEOUT) -> list[int]:
        """Close this caller's sequences of ``ids``; the ids that were open (others are skipped)."""
        balancing.require_one_server(self, "close_sequences")
        return self._simple("CloseSequences", pb.CloseSequencesRequest(ids=_ints(ids)), pb.CloseSequencesResponse,
                            lambda m: list(m.closed_ids), timeout)
