"""The sampling parameters, written once: name, kind, default, valid range, the value that turns
each off, and the rule an error message states.

Everything that checks or fills a sampling parameter reads this table: the kernels' argument
checks (``api.py``), the in-kernel check of per-row CUDA tensors (the same ranges, written as
comparisons in ``stats._stats_merge``), the torch reference, and the server's validation of the
wire fields (``<name>`` for every row, ``<name>_rows`` per row). A rule is a range with open or
closed ends, tested with comparisons only, so NaN breaks every float rule.

Float parameters are checked as the kernels read them, in float32: a temperature of 1e300 is
infinite there and a top_p of 1e-300 is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FILTER_ORDERS = ("top_k_first", "joint")


@dataclass(frozen=True)
class SamplingParam:
    """One sampling parameter: a Python scalar for every row or a ``[B]`` tensor per row.

    ``low`` / ``high`` bound its valid values (``None``: unbounded), each end open or closed;
    ``off`` is the value that turns the parameter's filter off (``None``: it has none);
    ``default`` is what an unset parameter means (``None``: seed is drawn, random_val unused).
    ``rule`` is the range in words, as an error message states it (``must be <rule>``).
    """

    name: str
    kind: type  # float or int
    default: float | int | None
    off: float | int | None
    low: float | int | None
    high: float | int | None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what the edges mean, appended to the rule in the kernels' messages

    @property
    def rows_field(self) -> str:
        """The wire's per-row field of this parameter (a ``[B]`` tensor)."""
        return self.name + "_rows"

    @property
    def rule(self) -> str:
        """The valid range in words: ``in (0, 1]``, ``>= 0``, ``finite and >= 0``."""
        low, high = self.low, self.high
        if high == math.inf and self.high_open:
            return f"finite and {'>' if self.low_open else '>='} {_num(low)}"
        if high is None:
            return f"{'>' if self.low_open else '>='} {_num(low)}"
        return f"in {'(' if self.low_open else '['}{_num(low)}, {_num(high)}{')' if self.high_open else ']'}"

    def ok(self, value):
        """Whether ``value`` keeps the rule: a Python number, or a tensor of them (element-wise).
        Comparisons only, so NaN breaks it."""
        good = value >= self.low if not self.low_open else value > self.low
        if self.high is not None:
            good = good & (value < self.high if self.high_open else value <= self.high)
        return good


def _num(v) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


# The order is the kernels' keyword order.
# temperature 0 is greedy (arg-max); its rule needs no note.
TEMPERATURE = SamplingParam("temperature", float, default=1.0, off=1.0, low=0.0, high=math.inf, high_open=True)
TOP_K = SamplingParam("top_k", int, default=0, off=0, low=0, high=None,
                      note="0 turns it off; a value above vocab_size keeps every token")
TOP_P = SamplingParam("top_p", float, default=1.0, off=1.0, low=0.0, high=1.0, low_open=True, note="1 turns it off")
MIN_P = SamplingParam("min_p", float, default=0.0, off=0.0, low=0.0, high=1.0, note="0 turns it off")
# The noise's key: 64-bit patterns. The wire carries non-negative int64s (the server draws seeds
# in [0, 2**63)); the kernels take any Python int in [-2**63, 2**64), modulo 2**64.
SEED = SamplingParam("seed", int, default=None, off=None, low=0, high=None)
STEP = SamplingParam("step", int, default=0, off=None, low=0, high=None)
RANDOM_VAL = SamplingParam("random_val", float, default=None, off=None, low=0.0, high=1.0, high_open=True)

SAMPLING_PARAMS: dict[str, SamplingParam] = {p.name: p for p in (TEMPERATURE, TOP_K, TOP_P, MIN_P, SEED, STEP,
                                                                  RANDOM_VAL)}
# The parameters packed per row for a launch, by the kernels' compute type: float32 and int64.
FLOAT_PARAMS = ("temperature", "top_p", "min_p")
INT_PARAMS = ("top_k", "seed", "step")
# Bits of the seeds drawn where none is given: uniform over every non-negative int64.
SEED_BITS = 63
# The Python-int range a kernel seed or step may take (64-bit patterns; step non-negative).
SEED_RANGE = (-(1 << 63), 1 << 64)
STEP_RANGE = (0, 1 << 63)

# Logits processors (applied before temperature and the filters; processors.py). Separate from
# SAMPLING_PARAMS: those are packed per row for every launch, these only for calls that set one.
REPETITION_PENALTY = SamplingParam("repetition_penalty", float, default=1.0, off=1.0, low=0.0, high=math.inf,
                                   low_open=True, high_open=True, note="1 turns it off")
FREQUENCY_PENALTY = SamplingParam("frequency_penalty", float, default=0.0, off=0.0, low=-2.0, high=2.0,
                                  note="0 turns it off")
PRESENCE_PENALTY = SamplingParam("presence_penalty", float, default=0.0, off=0.0, low=-2.0, high=2.0,
                                 note="0 turns it off")
MIN_TOKENS = SamplingParam("min_tokens", int, default=0, off=0, low=0, high=None, note="0 turns it off")
PENALTY_PARAMS: dict[str, SamplingParam] = {p.name: p for p in (REPETITION_PENALTY, FREQUENCY_PENALTY,
                                                                 PRESENCE_PENALTY)}
PROCESSOR_PARAMS: dict[str, SamplingParam] = {**PENALTY_PARAMS, MIN_TOKENS.name: MIN_TOKENS}
# The ragged lists: name -> (ids field, offsets field, what the list means). Token ids must lie in
# [0, vocab_size); offsets are [B + 1], start at 0, never decrease, and end at the ids' length.
RAGGED_LISTS = {
    "prompt": ("prompt_token_ids", "prompt_offsets", "the prompt's tokens (repetition penalty)"),
    "output": ("output_token_ids", "output_offsets", "the output so far (all penalties, min_tokens)"),
    "logit_bias": ("logit_bias_ids", "logit_bias_offsets", "tokens whose logit gets a bias"),
    "allowed": ("allowed_token_ids", "allowed_offsets", "the only tokens that may be drawn"),
    "banned": ("banned_token_ids", "banned_offsets", "tokens never drawn"),
    "stop": ("stop_token_ids", "stop_offsets", "stop tokens, banned while the output is shorter than min_tokens"),
}
# Logprobs: at most this many top tokens per row; the modes (raw: log-softmax of the logits as given;
# processed: after processors, temperature and filters, removed tokens -inf).
MAX_LOGPROBS = 20
LOGPROBS_MODES = ("raw", "processed")
