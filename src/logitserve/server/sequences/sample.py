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

Before the draw each sequence gets room for it (``SequenceTable.reserve``, within the bounds);
after it, each keeps its row of the answer, so that a call naming the steps it expects
(``sequence_steps``) and repeating the last drawn ones is answered the same without a draw
(sequences/retry.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from logitserve.kernels.sampling.params import MIN_TOKENS, PENALTY_PARAMS, RAGGED_LISTS, SAMPLING_PARAMS

from ..regions.servicer import caller
from .lists import StateRows, TableLaunch, lists_of, param_rows
from .retry import answer_bytes, drawn, repeated, repeats
from .sequence import Sequence, SequenceState
from .table import SequenceTable

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
    steps: list[int] | None = None  # the steps the call expects its rows' sequences to draw (None: any)

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

    def _repeats(self, call) -> bool:
        """At the launch: the sequences still open (NOT_FOUND for one closed or expired while the
        call waited), and whether the call repeats their last draws (sequences/retry.py)."""
        self.table.check_open(self.sequences, self.path + "sequence_ids")
        return repeats(self.sequences, self.steps, call, self.path + "sequence_steps")

    def _read_state(self, call) -> tuple[list[SequenceState], list[StateRows]]:
        """At the launch of a draw: each sequence's state read once (an update replaces it whole),
        its tokens checked again against the vocabulary (a call meanwhile may have appended, an
        update given longer lists), and the rows' parameters put into ``call``."""
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
            if self._repeats(call):
                tokens, logprobs = repeated(self.sequences, call)
                if call.outputs is not None:
                    await handle.run(self._put_outputs, call, tokens)
                return tokens, logprobs
            _, rows = self._read_state(call)
            kept = answer_bytes(call, self.vocab)
            try:
                if kept or any(seq.full for seq in self.sequences):  # on the launches' stream
                    await handle.run(self.table.reserve, self.sequences, self.path + "sequence_ids", kept)
                launch = TableLaunch(call, handle, names, self.sequences, rows)
                key = launch.key()
                if key is not None and (not launch.fixed or handle.graphs.seen_again(key)):
                    tokens, = await handle.launch(key, call.rows, launch.stage_for, launch.launch)
                    logprobs = None
                else:
                    tokens, logprobs = await handle.run(launch.eagerly)
                tokens = tokens.tolist()
                self.table.drew(self.sequences, tokens, self._answers(call, tokens, logprobs))
            except BaseException:
                self.table.recount(self.sequences)  # the room counted for an answer never kept goes
                raise
        return tokens, logprobs

    # ------------------------------------------------------------ an ordered step (server/ordered/)

    def read_ordered(self, call, holder: str) -> tuple[list[SequenceState], list[StateRows]]:
        """An ordered step's draw, at its enqueue, under ``table.launch_lock``: the sequences still
        open and in no other caller's draw, their state read into ``call``, and each then held by
        ``holder`` until :meth:`count_ordered` (no other call may draw it meanwhile: its output's
        length and its step are known once the step is done). The states, which the caller keeps
        until then: the list table holds their lists' addresses, not the lists, and an update
        meanwhile would free them while the step, on another stream, has yet to read them."""
        self.table.check_open(self.sequences, self.path + "sequence_ids")
        states, rows = self._read_state(call)
        for seq in self.sequences:
            seq.ordered = holder
        return states, rows

    def launch_ordered(self, call, handle, names: tuple[str, ...], rows: list[StateRows]) -> TableLaunch:
        """On the launch thread, on the handle's stream: room for one more token in each output
        (a full one grows there), then the step's launch over the list table."""
        self.table.reserve(self.sequences, self.path + "sequence_ids")
        return TableLaunch(call, handle, names, self.sequences, rows)

    def count_ordered(self, call, tokens: list[int] | None) -> None:
        """The ordered step is done: each row's token (appended by the launch; -1: none) counted,
        kept as its sequence's last draw, its step advanced (``tokens`` None: the device faulted,
        nothing is counted), and the sequences free for other calls."""
        try:
            if tokens is None:
                self.table.recount(self.sequences)
            else:
                self.table.drew(self.sequences, tokens, self._answers(call, tokens, None))
        finally:
            for seq in self.sequences:
                seq.ordered = None

    def _answers(self, call, tokens: list[int], logprobs: tuple | None) -> list:
        """Each row's answer, as its sequence keeps it (at its step, before it advances)."""
        return drawn(self.sequences, tokens, call.seeds(), call, logprobs)

    @staticmethod
    def _put_outputs(call, tokens: list[int]) -> None:
        """On the launch thread: a repeated answer's outputs into their regions."""
        call.put_outputs(torch.tensor(tokens, dtype=torch.int64), torch.tensor(call.seeds(), dtype=torch.int64))

    def launch(self, call, handle, names, launch_processed: Callable) -> tuple:
        """On the launch thread: ``call`` (a SampleCall of these rows) launched with the
        sequences' state by ``launch_processed``; then each row's token appended, its step
        advanced (or, for a call repeating its rows' last draws, their answer). Returns the
        tokens and logprobs (host tensors, or None)."""
        if self._repeats(call):
            tokens, logprobs = repeated(self.sequences, call)
            self._put_outputs(call, tokens)
            return torch.tensor(tokens, dtype=torch.int64), logprobs
        states, rows = self._read_state(call)
        self.table.reserve(self.sequences, self.path + "sequence_ids", answer_bytes(call, self.vocab))
        try:
            call.processors = {**(call.processors or {}), **self.processors(states, rows, handle.device)}
            tokens, logprobs, _ = launch_processed(call, handle, names)  # no list of a region to check
            if tokens.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # to_host's copy: the values are read here
            listed = tokens.tolist()
            self.table.drew(self.sequences, listed, self._answers(call, listed, logprobs), tokens.to(handle.device))
        except BaseException:
            self.table.recount(self.sequences)  # the room counted for an answer never kept goes
            raise
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
        steps = _steps(msg.sequence_steps, rows, path + "sequence_steps")
        sequences = self.table.lookup(caller(self.context), ids, name)
        _check_vocab(sequences, [seq.state for seq in sequences], vocab, path)
        return SequenceRows(self.table, sequences, vocab, path, steps)


def _steps(steps, rows: int, name: str) -> list[int] | None:
    """A call's ``sequence_steps``: None when unset, else one step >= 0 a row."""
    if not len(steps):
        return None
    if len(steps) != rows:
        raise ValueError(f"{name}: must have one step per logits row ({rows}), got {len(steps)} (or none: each "
                         f"row draws its sequence's next step)")
    steps = list(steps)
    for row, step in enumerate(steps):
        if step < 0:
            raise ValueError(f"{name}[{row}]: must be >= 0 (the step its sequence is expected to draw), got {step}")
    return steps
