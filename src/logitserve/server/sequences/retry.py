"""A Sample by sequence ids made safe to retry: the call may name the step each row's sequence is
expected to draw (``SampleRequest.sequence_steps``), and a call whose every row names its
sequence's last drawn step is answered what that draw answered, from the answer each sequence
keeps (``Sequence.last``, a :class:`~.sequence.Drawn`). Nothing is ever drawn twice: a client
whose call ended DEADLINE_EXCEEDED (or lost its connection) cannot tell whether the server drew,
and its retry, naming the same steps, gets the tokens drawn then, or the draw if there was none.

Decided at the launch (:func:`repeats`), where the steps are read: every row at its sequence's
next step draws; every row at its last drawn step repeats; anything else (a step not reached, a
step older than the last drawn, a mix of the two kinds of row, a repeat asking other logprobs
than the call it repeats) is FAILED_PRECONDITION naming the row and its sequence's step.
"""

from __future__ import annotations

import torch

from .sequence import Drawn, Sequence, StepMismatch


def asked(call) -> tuple:
    """What of its answer a Sample call asked for beyond the tokens and seeds: a repeat must ask
    the same (its answer is the one kept)."""
    return call.logprobs, call.logprobs_mode, call.return_kept


def _shown(what: tuple) -> str:
    n, mode, kept = what
    return f"logprobs={n}, logprobs_mode={mode!r}, return_kept={kept}"


def answer_bytes(call, vocab: int) -> int:
    """The bytes one row of ``call``'s answer keeps as its sequence's last draw: the logprobs
    fields it asked for, as the kernels answer them (the token and seed are kept as ints)."""
    nbytes = 0
    if call.logprobs is not None:  # token_logprobs float32, token_ranks int64, top ids int64 and logprobs float32
        nbytes += 4 + 8 + call.logprobs * (8 + 4)
    if call.return_kept:  # kept_bitmask int32 [ceil(V / 32)]
        nbytes += 4 * ((vocab + 31) // 32)
    return nbytes


def drawn(sequences: list[Sequence], tokens: list[int], seeds: list[int], call, logprobs: tuple | None) -> list[Drawn]:
    """Each row of a call's answer (``logprobs``: its host tensors, or None) as its sequence's
    last draw, at its step (before it advances)."""
    what = asked(call)
    if logprobs is None:
        return [Drawn(seq.step, token, seed, what, None) for seq, token, seed in zip(sequences, tokens, seeds)]
    return [Drawn(seq.step, token, seed, what, tuple(None if t is None else t[row].clone() for t in logprobs))
            for row, (seq, token, seed) in enumerate(zip(sequences, tokens, seeds))]


def _mismatch(field: str, seq: Sequence, step: int) -> StepMismatch:
    if step > seq.step:
        return StepMismatch(f"{field}: sequence {seq.id} has not reached step {step}: its next draw is step "
                            f"{seq.step} (nothing was drawn)")
    last = ("it has drawn nothing since it opened" if seq.last is None
            else f"only its last draw (step {seq.last.step}) can be repeated")
    return StepMismatch(f"{field}: sequence {seq.id} is past step {step}: its next draw is step {seq.step}, and "
                        f"{last} (nothing was drawn)")


def repeats(sequences: list[Sequence], steps: list[int] | None, call, field: str) -> bool:
    """At the launch: True where ``call`` repeats the last draw of each of its rows' sequences
    (``steps``, one a row, each the step last drawn), False where it draws the next of each (or
    names no steps); ``StepMismatch`` naming ``field[row]`` otherwise."""
    if steps is None:
        return False
    repeating, drawing = [], []
    for row, (seq, step) in enumerate(zip(sequences, steps)):
        if step == seq.step:
            drawing.append(row)
        elif seq.last is not None and step == seq.last.step:
            repeating.append(row)
        else:
            raise _mismatch(f"{field}[{row}]", seq, step)
    if repeating and drawing:
        new, old = drawing[0], repeating[0]
        raise StepMismatch(f"{field}[{new}]: step {steps[new]} is sequence {sequences[new].id}'s next draw, while "
                           f"{field}[{old}] repeats sequence {sequences[old].id}'s last: a call either repeats "
                           f"the last draw of every row (a retry) or draws the next of every row")
    for row in repeating:
        last = sequences[row].last
        if last.asked != asked(call):
            raise StepMismatch(f"{field}[{row}]: step {last.step} of sequence {sequences[row].id} was drawn by a "
                               f"call that asked {_shown(last.asked)}; a retry must ask what the call it repeats "
                               f"asked, this one asks {_shown(asked(call))}")
    return bool(repeating)


def repeated(sequences: list[Sequence], call) -> tuple[list[int], tuple | None]:
    """The answer of the draw ``call`` repeats: each row's token, and the logprobs (host tensors,
    or None) as the launch answered them; the seeds put into ``call`` (its answer's)."""
    last = [seq.last for seq in sequences]
    call.seed = [d.seed for d in last]
    logprobs = None
    if last[0].logprobs is not None:
        logprobs = tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*(d.logprobs for d in last)))
    return [d.token for d in last], logprobs
