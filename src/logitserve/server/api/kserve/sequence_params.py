"""Triton's sequence parameters of a ModelInferRequest, as its sequence batcher names them:
``sequence_id`` (int64), ``sequence_start`` and ``sequence_end`` (bool); and logitserve's own
``sequence_step`` (int64, optional): the step the request expects its sequence to draw, which
makes a retry safe (logitserve.v1's ``SampleRequest.sequence_steps``; sequences/retry.py).

tritonclient sends all three when ``infer(..., sequence_id=...)`` is not 0 (or ""), none
otherwise. Triton also takes a string id; logitserve's sequence ids are int64, the ids of
``logitserve.v1``'s OpenSequences (a sequence opened there is sampled here by the same number,
for the same bearer token), so a string id is refused, naming the rule. What a sequence request
does is sequences.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
SEQUENCE_STEP = "sequence_step"
SEQUENCE_PARAMS = (SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END, SEQUENCE_STEP)
_INT64_END = 1 << 63


@dataclass(frozen=True)
class SequenceParams:
    """A request's sequence: its id, whether the request opens it (``start``), whether it
    closes it after its draw (``end``), and the step it expects it to draw (None: any)."""

    id: int
    start: bool
    end: bool
    step: int | None = None


def _id(value, name: str = SEQUENCE_ID) -> int:
    choice = value.WhichOneof("parameter_choice")
    got = None if choice is None else getattr(value, choice)
    if choice in ("int64_param", "uint64_param") and -_INT64_END <= got < _INT64_END:
        return got
    if choice == "string_param" and name == SEQUENCE_ID:
        raise TypeError(f"parameters[{SEQUENCE_ID}]: must be an int64 (logitserve's sequence ids are numbers, "
                        f"those of logitserve.v1's OpenSequences; Triton's string ids are not taken), got "
                        f"string_param {got!r}")
    raise TypeError(f"parameters[{name}]: must be an int64, got {choice or 'nothing'}"
                    f"{'' if got is None else f' {got!r}'}")


def _flag(parameters, name: str) -> bool:
    if name not in parameters:
        return False
    value = parameters[name]
    choice = value.WhichOneof("parameter_choice")
    if choice != "bool_param":
        got = None if choice is None else getattr(value, choice)
        raise TypeError(f"parameters[{name}]: must be bool, got {choice or 'nothing'}"
                        f"{'' if got is None else f' {got!r}'}")
    return value.bool_param


def sequence_params(model, parameters) -> SequenceParams | None:
    """The sequence ``parameters`` (a request's) name for ``model`` (models.Model), None when
    they name none; ``TypeError`` / ``ValueError`` naming the parameter and the rule."""
    start, end = _flag(parameters, SEQUENCE_START), _flag(parameters, SEQUENCE_END)
    if SEQUENCE_ID not in parameters:
        if start or end or SEQUENCE_STEP in parameters:
            flag = SEQUENCE_START if start else SEQUENCE_END if end else SEQUENCE_STEP
            raise ValueError(f"parameters[{flag}]: needs parameters[{SEQUENCE_ID}], the sequence it names")
        return None
    seq_id = _id(parameters[SEQUENCE_ID])
    if not model.sequences:
        raise ValueError(f"parameters[{SEQUENCE_ID}]: model {model.name!r} keeps no sequences (only "
                         f"'sample' does)")
    step = _id(parameters[SEQUENCE_STEP], SEQUENCE_STEP) if SEQUENCE_STEP in parameters else None
    return SequenceParams(seq_id, start, end, step)
