"""``sample``, the public function: its arguments checked against ``params.py``, then a cached plan.

Python scalars and per-row tensors on the CPU are checked here, before any launch
(``TypeError`` / ``ValueError`` naming the parameter and its rule). Per-row tensors on CUDA are
checked inside the merge kernel instead (``stats.py``), since reading them back would cost a
device synchronisation: a row whose parameter breaks its rule returns -1.
"""

from __future__ import annotations

import secrets

import torch

from .._plan import FLOAT_DTYPES, TensorSpec
from .params import (FREQUENCY_PENALTY, MIN_P, MIN_TOKENS, PRESENCE_PENALTY, RANDOM_VAL, REPETITION_PENALTY, SEED,
                     SEED_BITS, SEED_RANGE, STEP, STEP_RANGE, TEMPERATURE, TOP_K, TOP_P, SamplingParam)
from ..reference import sample as reference
from .logprobs import Logprobs, check_logprobs, pack_bits
from .logprobs import logprobs as _logprobs
from .plan import INT_DTYPES, SamplePlan, _cached_plan
from .processors import Processors, process_logits

__all__ = ["Logprobs", "SamplePlan", "sample"]


def _rule(param: SamplingParam) -> str:
    """The rule as the messages state it: the range, then what its edges mean."""
    return f"{param.rule} ({param.note})" if param.note else param.rule


def _check_param(param: SamplingParam, value, n_rows: int) -> None:
    """Type and value rules for one parameter: a Python scalar, or a [B] tensor (values checked on the CPU).

    Float parameters are checked as the kernels read them, in float32: a temperature of 1e300
    is infinite there, a top_p of 1e-300 is 0 and a random_val of 1 - 1e-12 is 1.
    """
    name, integer, rule = param.name, param.kind is int, _rule(param)
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.ndim == 1 and value.shape[0] == n_rows and value.dtype in \
                (FLOAT_DTYPES if param.kind is float else INT_DTYPES):
            bad = (~param.ok(value if integer else value.to(torch.float32))).nonzero()
            if bad.numel():
                row = bad[0, 0].item()
                raise ValueError(f"{name} must be {rule}, got {value[row].item()} in row {row}")
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an int" if integer else "a float"
        raise TypeError(f"{name} must be {kind} or a [batch_size] tensor, got {type(value).__name__}")
    if not param.ok(value if integer else torch.tensor(value, dtype=torch.float32).item()):
        raise ValueError(f"{name} must be {rule} in float32, got {value}")


def _power_of_two_text(v: int) -> str:
    return "0" if v == 0 else f"{'-' if v < 0 else ''}2**{abs(v).bit_length() - 1}"


def _check_counter(name: str, value, valid: tuple[int, int]) -> None:
    """A seed or step: an int in ``valid`` (``[low, high)``), or a per-row tensor."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or a [batch_size] int64 tensor, got {type(value).__name__}")
    low, high = valid
    if not low <= value < high:
        raise ValueError(f"{name} must be an integer in [{_power_of_two_text(low)}, {_power_of_two_text(high)}), "
                         f"got {value}")


# The values that turn the repetition, frequency and presence penalties and min_tokens off.
_PROCESSORS_OFF = tuple(p.off for p in (REPETITION_PENALTY, FREQUENCY_PENALTY, PRESENCE_PENALTY, MIN_TOKENS))


def sample(logits: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
           filter_order: str = "top_k_first", random_val=None, out_dtype: torch.dtype = torch.int64,
           backend: str = "auto", repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
           prompt_token_ids=None, prompt_offsets=None, output_token_ids=None, output_offsets=None,
           logit_bias_ids=None, logit_bias_values=None, logit_bias_offsets=None, allowed_token_ids=None,
           allowed_offsets=None, banned_token_ids=None, banned_offsets=None, min_tokens=0, stop_token_ids=None,
           stop_offsets=None, grammar_bitmask=None, list_table=None, logprobs: int | None = None,
           logprobs_mode: str = "raw", return_kept: bool = False):
    """Draw one token id per row of ``logits``.

    Parameters
    ----------
    logits : torch.Tensor
        ``(batch_size, vocab_size)``, float16 / bfloat16 / float32 / float64, any strides.
    temperature, top_k, top_p, min_p : scalar or ``(batch_size,)`` tensor
        ``temperature == 0`` or ``top_k == 1`` is greedy (arg-max, lowest index on ties).
        Otherwise ``p = softmax(logits / temperature)`` is filtered: ``top_k`` keeps the k
        largest (0: off; above vocab_size: every token), ``top_p`` the smallest most-probable
        set reaching that mass (1: off), ``min_p`` drops ``p < min_p * max(p)`` (0: off). Ties
        with a filter's boundary token are kept. The draw follows ``p`` over the kept tokens.
    seed, step : int or ``(batch_size,)`` int64 tensor
        The noise is a pure function of ``(seed, step, token index)`` (64-bit each), so a row
        draws the same token in any batch and on any backend (but for floating-point near-ties).
        ``seed=None`` draws one 63-bit seed per call from ``secrets``; to replay a call, pass
        explicit seeds.
    filter_order : ``"top_k_first"`` (HF transformers, vLLM: top-p over the renormalised top-k)
        or ``"joint"`` (InfiniCore: in the top-k set and in the unfiltered top-p nucleus).
    random_val : None, float or ``(batch_size,)`` tensor in [0, 1)
        Reproduce InfiniCore's ``random_sample`` with these uniforms instead of the noise
        (``min_p`` must be 0; ``filter_order`` does not apply). Exact but where the threshold
        falls within float32 rounding of a cumulative boundary (random_val within ~1e-6 of 1 on a
        large vocabulary, or a near-tie).
    out_dtype : torch.int64 or torch.int32
    repetition_penalty, frequency_penalty, presence_penalty : float or ``(batch_size,)`` tensor
        Logits processors, applied before temperature and the filters, in the order penalties ->
        bias -> allowed / banned / min_tokens / grammar mask (``processors.py``). Repetition
        (> 0, 1: off) divides a positive logit of a token seen in the prompt or the output by the
        penalty and multiplies a negative one; frequency (in [-2, 2]) subtracts penalty x the
        token's count in the output; presence (in [-2, 2]) subtracts the penalty where it occurs.
    prompt_token_ids, prompt_offsets, output_token_ids, output_offsets : ragged int tensors
        Each row's earlier tokens: ids ``[N]`` and offsets ``[batch_size + 1]`` (row ``r`` is
        ``ids[offsets[r]:offsets[r + 1]]``; starting at 0, not decreasing, ending at ``N``).
    logit_bias_ids, logit_bias_values, logit_bias_offsets : ragged
        Biases added to those tokens' logits (duplicates add up).
    allowed_token_ids, allowed_offsets : ragged
        Only these tokens can be drawn (a row with an empty list draws nothing: -1).
    banned_token_ids, banned_offsets : ragged
        Never drawn.
    min_tokens : int or ``(batch_size,)`` tensor; stop_token_ids, stop_offsets : ragged
        The stop tokens are banned while the row's output (``output_offsets``) is shorter than
        ``min_tokens``.
    grammar_bitmask : int32 ``(batch_size, ceil(vocab_size / 32))``
        Bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed (xgrammar's layout). A row
        allowing no finite logit answers -1.
    list_table : :class:`~.processors.ListTable` or None
        Each row's prompt, output, bias, banned and stop lists (and min_tokens) held by address,
        in place of those ragged arguments (which must then be unset): for a caller that keeps
        each sequence's lists on the device (a server's sequences). Triton kernels only.
    logprobs : None or int in [0, 20]
        Also return a :class:`Logprobs` of the chosen tokens and the top-``logprobs`` tokens
        (``(batch_size, logprobs)`` on every backend; places past the vocabulary: id -1, -inf).
    logprobs_mode : ``"raw"`` or ``"processed"``
        ``raw``: the log-softmax of ``logits`` as given. ``processed``: of the logits after the
        processors and temperature, over the tokens the filters kept (the others -inf; greedy
        rows: the arg-max alone, log-probability 0). Not with ``random_val``.
    return_kept : bool
        Also return the kept set as ``Logprobs.kept_bitmask``, int32 ``(batch_size,
        ceil(vocab_size / 32))``: the support of the distribution drawn from (bit set: the token
        can be drawn; never a banned, grammar-masked or -inf one, whatever the filters).
        ``processed`` mode and the kept set come from torch operations (the reference's
        sort-based filters), on the same processed logits: a float near-tie at a filter's
        boundary may differ from the kernels'.

    With any processor set, the processed logits (float32) are written to a new tensor that the
    sampling launches read (float64 logits are then sampled in float32). With none set, the call
    takes exactly the path it takes without these arguments.

    Returns
    -------
    torch.Tensor
        ``(batch_size,)`` token ids; -1 for a row with a NaN, with no finite logit, or (per-row
        CUDA tensors) with a parameter that breaks its rule. With ``logprobs`` or
        ``return_kept``: the pair ``(token_ids, Logprobs)``.

    Examples
    --------
    >>> logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 5.0, -1.0]])
    >>> sample(logits, temperature=0.0).tolist()
    [1, 0]
    >>> sample(logits, top_k=1, seed=3).tolist()
    [1, 0]
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.ndim != 2:
        raise ValueError(f"logits: must be 2-D (batch_size, vocab_size), got shape {list(logits.shape)}")
    n_rows = logits.shape[0]
    lists = (prompt_token_ids, prompt_offsets, output_token_ids, output_offsets, logit_bias_ids, logit_bias_values,
             logit_bias_offsets, allowed_token_ids, allowed_offsets, banned_token_ids, banned_offsets,
             stop_token_ids, stop_offsets, grammar_bitmask, list_table)
    # The plain call's check costs a microsecond, not Processors.of's tens. By identity: a tensor's
    # == None (what tuple.count does) costs tens of microseconds each.
    plain = all(x is None for x in lists) and all(
        type(v) in (int, float) and v == d for v, d in zip((repetition_penalty, frequency_penalty, presence_penalty,
                                                            min_tokens), _PROCESSORS_OFF))
    procs = None if plain else Processors.of(
        n_rows, logits.shape[1], logits.device, repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, prompt_token_ids=prompt_token_ids,
        prompt_offsets=prompt_offsets, output_token_ids=output_token_ids, output_offsets=output_offsets,
        logit_bias_ids=logit_bias_ids, logit_bias_values=logit_bias_values, logit_bias_offsets=logit_bias_offsets,
        allowed_token_ids=allowed_token_ids, allowed_offsets=allowed_offsets, banned_token_ids=banned_token_ids,
        banned_offsets=banned_offsets, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
        stop_offsets=stop_offsets, grammar_bitmask=grammar_bitmask, list_table=list_table)
    if logprobs is not None:
        check_logprobs(logprobs, logprobs_mode)
        if logprobs_mode == "processed" and random_val is not None:
            raise ValueError("logprobs_mode 'processed' does not apply with random_val")
    if return_kept and random_val is not None:
        raise ValueError("return_kept does not apply with random_val")
    raw = logits
    if procs is not None and procs.any:
        logits = process_logits(logits, procs, backend)
    if seed is None:
        seed = secrets.randbits(SEED_BITS)
    for param, value in ((TEMPERATURE, temperature), (TOP_K, top_k), (TOP_P, top_p), (MIN_P, min_p)):
        _check_param(param, value, n_rows)
    _check_counter(SEED.name, seed, SEED_RANGE)
    _check_counter(STEP.name, step, STEP_RANGE)
    if random_val is not None:
        _check_param(RANDOM_VAL, random_val, n_rows)
        if not isinstance(min_p, torch.Tensor) and min_p != 0:
            raise ValueError(f"min_p must be 0 when random_val is given, got {min_p}")
        if isinstance(min_p, torch.Tensor) and min_p.device.type == "cpu" and bool((min_p != 0).any()):
            raise ValueError("min_p must be 0 when random_val is given, got a nonzero per-row value")

    def spec(value):
        return TensorSpec.of(value) if isinstance(value, torch.Tensor) else None

    plan = _cached_plan(TensorSpec.of(logits), temperature=spec(temperature), top_k=spec(top_k), top_p=spec(top_p),
                        min_p=spec(min_p), seed=spec(seed), step=spec(step), random_val=spec(random_val),
                        random_val_mode=random_val is not None, filter_order=filter_order, out_dtype=out_dtype,
                        backend=backend)
    out = torch.empty(n_rows, dtype=out_dtype, device=logits.device)
    tokens = plan(logits, out, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
                  random_val=random_val)
    if logprobs is None and not return_kept:
        return tokens
    kept = None
    if return_kept or logprobs_mode == "processed":
        rows = [v if isinstance(v, torch.Tensor) else torch.full((n_rows,), v, device=logits.device)
                for v in (temperature, top_k, top_p, min_p)]
        kept = reference.kept_set(logits, *rows, filter_order=filter_order)
    result = Logprobs()
    if logprobs is not None:
        source = raw
        if logprobs_mode == "processed":
            t = rows[0].to(torch.float64 if logits.dtype == torch.float64 else torch.float32)[:, None]
            scaled = logits.to(t.dtype) / torch.where(t > 0, t, 1.0)
            source = torch.where(kept, torch.where(t > 0, scaled, 0.0), float("-inf"))
        result = _logprobs(source, tokens, logprobs, backend=backend)
    if return_kept:
        result.kept_bitmask = pack_bits(kept)
    return tokens, result
