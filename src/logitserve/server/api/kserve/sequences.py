"""Sequences on the KServe front: a ``sample`` request with Triton's sequence parameters
(sequence_params.py) samples by a sequence the server holds, through the same table
(server/sequences/table.py), open path (``open_specs``) and Sample path (``SequenceLookup``) as
``logitserve.v1``'s OpenSequences and ``Sample(sequence_ids=...)``.

As Triton's sequence batcher, one request is one sequence: ``LOGITS`` has one row, and its
``sequence_id`` is that row's ``sequence_ids[0]``. A request with ``sequence_start`` opens the
sequence first, its parameters taken from the request's (``temperature``, ``top_k``, ``top_p``,
``min_p``, ``seed``, ``step``; unset: the defaults, a drawn seed, which ``SEEDS`` answers); the
sequence's later requests leave them unset. One with ``sequence_end`` closes it after its draw.
A request that fails closes the sequence it opened (a retry may start it again) and leaves open
one it would have ended (``CloseSequences`` or idle expiry closes it). A request with
``sequence_step`` names the step it expects its sequence to draw, so that a retry is safe: a
repeat of the step last drawn answers what was drawn then (sequences/retry.py). A retried
``sequence_start`` whose first attempt opened the sequence is ALREADY_EXISTS (send it again
without ``sequence_start``, its ``sequence_step`` the same); one retried after its
``sequence_end`` closed the sequence is NOT_FOUND.
"""

from __future__ import annotations

import contextlib

from logitserve.kernels.sampling.params import RANDOM_VAL, SAMPLING_PARAMS
from logitserve.v1 import logitserve_pb2 as pb

from ...errors import TooLarge
from ...regions.servicer import caller
from ...sequences.sequence import OPEN_FIRST, SequenceExists, SequenceNotFound, StepMismatch
from ...sequences.open import open_specs
from ...sequences.sample import SequenceLookup
from . import translate
from .sequence_params import SEQUENCE_ID, SEQUENCE_START, SEQUENCE_STEP

ID_FIELD = f"parameters[{SEQUENCE_ID}]"
START_FIELD = f"parameters[{SEQUENCE_START}]"
STEP_FIELD = f"parameters[{SEQUENCE_STEP}]"
# The parameters a sequence_start request gives its sequence (random_val: a sequence draws its
# own noise from its seed and step).
_OPENING = tuple(p.name for p in SAMPLING_PARAMS.values() if p is not RANDOM_VAL)
_OPEN_HINT = f"{OPEN_FIRST}, or by a request with {START_FIELD} true"


def _one_row(job: translate.Translated) -> None:
    shape = list(job.message.logits.shape)
    if len(shape) == 2 and shape[0] != 1:
        raise ValueError(f"{job.names.get('logits', 'LOGITS')}: shape {shape} has {shape[0]} rows, but a request "
                         f"with {ID_FIELD} samples its one sequence, one row (as Triton's sequence batcher: a "
                         f"request a sequence); many sequences in one call: logitserve.v1's Sample with "
                         f"sequence_ids")


def _as_sequence_call(job: translate.Translated) -> pb.SequenceSpec | None:
    """``job``'s Sample request made one by its sequence's id, checked for what a sequence
    request must leave unset; the SequenceSpec a sequence_start request opens (None: none)."""
    msg, seq = job.message, job.sequence
    _one_row(job)
    for p in SAMPLING_PARAMS.values():
        if msg.HasField(p.rows_field):
            raise ValueError(f"input {job.names[p.rows_field]}: not taken with {ID_FIELD} (the sequence holds "
                             f"its parameters: set them by parameters on its {SEQUENCE_START} request)")
    if msg.HasField(RANDOM_VAL.name):
        raise ValueError(f"parameters[{RANDOM_VAL.name}]: not taken with {ID_FIELD} (a sequence draws its own "
                         f"noise, from its seed and step)")
    given = [name for name in _OPENING if msg.HasField(name)]
    if given and not seq.start:
        raise ValueError(f"parameters[{given[0]}]: must be unset on a sequence's later requests (the "
                         f"parameters of its {SEQUENCE_START} request hold for the whole sequence)")
    job.names.update({"sequence_ids[0]": ID_FIELD, "sequence_ids": ID_FIELD, "sequence_steps[0]": STEP_FIELD,
                      "sequence_steps": STEP_FIELD})
    msg.sequence_ids.append(seq.id)
    if seq.step is not None:
        msg.sequence_steps.append(seq.step)
    if not seq.start:
        return None
    spec = pb.SequenceSpec(id=seq.id, **{name: getattr(msg, name) for name in given})
    for name in given:
        msg.ClearField(name)
    return spec


def _not_found(exc: SequenceNotFound, names: dict) -> SequenceNotFound:
    text = str(translate.renamed(exc, names))
    return SequenceNotFound(text.replace(OPEN_FIRST, _OPEN_HINT))


@contextlib.asynccontextmanager
async def sequence_of(job: translate.Translated, service, context):
    """Around a KServe inference: yields the keywords its operator's ``from_pb`` takes for
    ``job``'s sequence (none without one), having opened it on ``sequence_start``; closes it
    after the body on ``sequence_end``, or when the body fails and this request opened it."""
    if job.sequence is None:
        yield {}
        return
    table, owner, seq = service.sequences, caller(context), job.sequence
    spec = _as_sequence_call(job)
    if spec is not None:
        try:
            await open_specs(table, [spec], owner, service.config.max_vocab, what=START_FIELD, path=lambda i: "",
                             id_field=lambda i: ID_FIELD)
        except (ValueError, TooLarge) as exc:
            raise translate.renamed(exc, job.names) from None
        except SequenceExists as exc:
            raise SequenceExists(f"{exc}; over KServe, end it by parameters[sequence_end] on its last request") \
                from None
    try:
        yield {"sequences": SequenceLookup(table, context)}
    except BaseException as exc:
        if spec is not None:
            table.close(owner, [seq.id])
        if isinstance(exc, SequenceNotFound):
            raise _not_found(exc, job.names) from None
        if isinstance(exc, (StepMismatch, TooLarge)):  # raised at the launch: in the request's names
            raise translate.renamed(exc, job.names) from None
        raise
    if seq.end:
        table.close(owner, [seq.id])
