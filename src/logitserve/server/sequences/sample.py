"""Sample with ``sequence_ids``: each row's parameters and lists read from its sequence's state
(server/sequences/table.py) at the launch, the draw made by the one Sample path, then each row's token
appended and its step advanced.

On the event loop (``SampleCall.from_pb``, through :meth:`SequenceLookup.rows`): one id per
row, none twice, every one an open sequence of the caller, the fields the state replaces
unset, each sequence's tokens below the call's vocabulary. At the launch
(:meth:`SequenceRows._read_state`): the sequences still open (one closed or expired while the
call waited: NOT_FOUND), each one's state read once (UpdateSequences replaces it whole: an
update made while the call waited applies), the rows' parameters packed into the call as if
sent per row. Then the lists: on the Triton kernels by address, read where each sequence holds
them (sequences/lists.py: a list table, the appends in the same launch, a CUDA graph); on the
torch backend as ragged keywords of ``launch_processed`` (ids concatenated, ``[B + 1]``
offsets, the tokens appended row by row after it). Either way only the lists some row uses are
passed (``sequences_lists.lists_of``), as a stateless caller would leave the others out, so the
answer equals a call without sequence ids that sends the same values and lists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from logitserve.kernels.sampling.params import MIN_TOKENS, PENALTY_PARAMS, RAGGED_LISTS, SAMPLING_PARAMS

from ..regions.servicer import caller
from .sequence import Sequence, SequenceState
from .table import SequenceTable
from .lists import StateRows, TableLaunch, lists_of, param_rows

# The SampleRequest fields a sequence's state replaces: with sequence_ids they must be unset.
REPLACED = (*(f for p in (*SAMPLING_PARAMS.values(), *PENALTY_PARAMS.values(), MIN_TOKENS)
              for f in (p.name, p.rows_field)),
            *(f for ids, offsets, _ in RAGGED_LISTS.values() for f in (ids, offsets)), "logit_bias_values")
_PENALTIES = tuple(PENALTY_PARAMS)


def _ragged(parts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' lists as the kernels' ragged pair: ids concatenated, offsets ``[B + 1]`` from 0."""
    offsets = torch.tensor([0, *itertools.accumulate(p.shape[0] for p in parts)], dtype=torch.int64)
    return torch.cat(parts), offsets.to(device)


def _check_vocab(sequences: list[Sequence], states: list[SequenceState], vocab: int, path: str) -> None:
    """Each sequence's token ids (its output's, and its lists' as ``states`` hold them) below ``vocab``."""
    for row, (seq, state) in enumerate(zip(sequences, states)):
        held = max(state.max_id, seq.output_max_id)
        if held >= vocab:
            raise ValueError(f"{path}sequence_ids[{row}]: sequence {seq.id} holds token id {held}, not below "
                             f"this call's vocabulary ({vocab} logits a row)")


@dataclass(eq=False)
class SequenceRows:
    """A Sample call's sequences, one per row."""

    table: SequenceTable
    sequences: list[Sequence]
    vocab: int
    path: str

    def processors(self, states: list[SequenceState], rows: list[StateRows], device: torch.device) -> dict:
        """The kernels' processor keywords of the rows' state (``states``, read once, and their
        ``rows``), as ragged lists on ``device``: the lists :func:`lists_of` says some row uses,
        as the list table passes them."""
        seqs, kw = self.sequences, {}
        lists, penalties = lists_of(rows)
        params = [state.params for state in states]
        if penalties:
            for name in _PENALTIES:
                kw[name] = torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
            kw["prompt_token_ids"], kw["prompt_offsets"] = _ragged([state.prompt for state in states], device)
        if "output" in lists:
            kw["output_token_ids"], kw["output_offsets"] = _ragged([seq.outputs() for seq in seqs], device)
        if "stop" in lists:
            kw["min_tokens"] = torch.tensor([p.min_tokens for p in params], dtype=torch.int64, device=device)
            kw["stop_token_ids"], kw["stop_offsets"] = _ragged([state.stop for state in states], device)
        if "logit_bias" in lists:
            kw["logit_bias_ids"], kw["logit_bias_offsets"] = _ragged([state.bias_ids for state in states], device)
            kw["logit_bias_values"] = torch.cat([state.bias_values for state in states])
        if "banned" in lists:
            kw["banned_token_ids"], kw["banned_offsets"] = _ragged([state.banned for state in states], device)
        return kw

    def _read_state(self, call) -> tuple[list[SequenceState], list[StateRows]]:
        """At the launch: the sequences still open (NOT_FOUND for one closed or expired while the
        call waited), each one's state read once (an update replaces it whole), its tokens
        checked again against the vocabulary (a call meanwhile may have appended, an update
        given longer lists), and the rows' parameters put into ``call``."""
        self.table.check_open(self.sequences, self.path + "sequence_ids")
        states = [seq.state for seq in self.sequences]
        _check_vocab(self.sequences, states, self.vocab, self.path)
        rows = [StateRows.of(state) for state in states]
        call.use_rows(*param_rows(self.sequences, rows))
        return states, rows

    async def run(self, call, handle, names, launch_processed: Callable) -> tuple[list[int], tuple | None]:
        """``call`` (a SampleCall of these rows) launched with the sequences' state, each row's
        token appended and its step advanced: on the Triton kernels through a list table
        (sequences/lists.py), on the torch backend with the lists gathered (:meth:`launch`).
        Returns the tokens and the logprobs (host tensors, or None)."""
        if handle.backend == "torch":
            tokens, logprobs = await handle.run(self.launch, call, handle, names, launch_processed)
            return tokens.tolist(), logprobs
        async with self.table.launch_lock:
            _, rows = self._read_state(call)
            if any(seq.full for seq in self.sequences):  # on the launches' stream
                await handle.run(self.table.reserve, self.sequences, self.path + "sequence_ids")
            launch = TableLaunch(call, handle, names, self.sequences, rows)
            key = launch.key()
            if key is not None and (not launch.fixed or handle.graphs.seen_again(key)):
                tokens, = await handle.launch(key, call.rows, launch.stage_for, launch.launch)
                logprobs = None
            else:
                tokens, logprobs = await handle.run(launch.eagerly)
            tokens = tokens.tolist()
            self.table.counted(self.sequences, tokens)
        return tokens, logprobs

    def launch(self, call, handle, names, launch_processed: Callable) -> tuple:
        """On the launch thread: ``call`` (a SampleCall of these rows) launched with the
        sequences' state by ``launch_processed``; then each row's token appended, its step
        advanced. Returns the tokens and logprobs (host tensors, or None)."""
        states, rows = self._read_state(call)
        self.table.reserve(self.sequences, self.path + "sequence_ids")
        call.processors = {**(call.processors or {}), **self.processors(states, rows, handle.device)}
        tokens, logprobs, _ = launch_processed(call, handle, names)  # no list of a region to check
        if tokens.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # to_host's copy: the values are read here
        self.table.advance(self.sequences, tokens.tolist(), tokens.to(handle.device))
        return tokens, logprobs


@dataclass(eq=False)
class SequenceLookup:
    """What a Sample handler gives ``SampleCall.from_pb``: the table and the caller's owner."""

    table: SequenceTable
    context: object  # the call's grpc context: its authorization header names the owner

    def rows(self, msg, rows: int, vocab: int, path: str = "") -> SequenceRows:
        """The sequences ``msg.sequence_ids`` names, checked; ``ValueError`` / NOT_FOUND naming
        the field, the row and the rule."""
        ids = msg.sequence_ids
        name = path + "sequence_ids"
        if len(ids) != rows:
            raise ValueError(f"{name}: must have one id per logits row ({rows}), got {len(ids)}: every row of a "
                             f"call names a sequence, or none does")
        if len(set(ids)) != len(ids):
            first: dict[int, int] = {}
            for row, seq_id in enumerate(ids):
                if first.setdefault(seq_id, row) != row:
                    raise ValueError(f"{name}[{row}]: sequence {seq_id} is named twice in one call (also {name}"
                                     f"[{first[seq_id]}]); a sequence draws one token a call")
        for field in REPLACED:
            if msg.HasField(field):
                raise ValueError(f"{path}{field}: must be unset with sequence_ids (each row's sequence holds its "
                                 f"parameters and lists; change them with UpdateSequences)")
        sequences = self.table.lookup(caller(self.context), ids, name)
        _check_vocab(sequences, [seq.state for seq in sequences], vocab, path)
        return SequenceRows(self.table, sequences, vocab, path)
