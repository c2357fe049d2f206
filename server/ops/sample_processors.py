"""Sample's logits processors and logprobs on the wire (issue 26): parsing and validation of the
SampleRequest fields, and the launch of a call that sets any of them.

Every field is checked here, before the call is queued, by the rules of
``kernels/sampling/params.py`` and ``kernels/sampling/processors.py`` (token ids in [0, V),
offsets ``[B + 1]`` from 0, not decreasing, ending at the ids' length; bitmask
``[B, ceil(V / 32)]`` int32; penalties in their ranges; ``logprobs`` in [0, 20]); a broken rule is
a ``ValueError`` naming the field, the row and the rule (INVALID_ARGUMENT).

A call with any processor or logprobs launches as its own group (``SampleCall.key`` is None):
the simplest correct rule, since its ragged lists and bitmask would otherwise have to be merged
with its neighbours' (offsets rebased). It runs eagerly on the launch thread (no CUDA graph).
An empty list over the whole batch is sent as the offsets alone (zeros), ``<x>_token_ids``
unset: the wire has no empty tensors.
"""

from __future__ import annotations

import torch

from logitserve import kernels
from logitserve.kernels.sampling.params import (LOGPROBS_MODES, MAX_LOGPROBS, MIN_TOKENS, PENALTY_PARAMS,
                                                RAGGED_LISTS)
from logitserve.kernels.sampling.processors import ragged_error

from ..tensors import INTS, DeviceTensor, decode


def _values(t) -> list:
    return t.tensor.tolist() if isinstance(t, DeviceTensor) else t.tolist()


def _tensor(msg, name: str, path: str, regions, dtypes, ranks):
    if not msg.HasField(name):
        return None
    return decode(getattr(msg, name), f"{path}{name}", dtypes=dtypes, ranks=ranks, regions=regions)


# Every field the processors read: plain sampling sets none of them and skips their checks.
_FIELDS = (*(f for p in (*PENALTY_PARAMS.values(), MIN_TOKENS) for f in (p.name, p.rows_field)),
           *(f for ids, offsets, _ in RAGGED_LISTS.values() for f in (ids, offsets)),
           "logit_bias_values", "grammar_bitmask")


def parse(msg, rows: int, vocab: int, path: str, regions, param) -> tuple[dict | None, int | None, str]:
    """``(kernel keywords of the processors or None, logprobs n or None, logprobs mode)``
    (``msg.return_kept`` is read by the caller).

    ``param(msg, p, rows, path, regions)`` reads a scalar-or-per-row parameter (sample.py's)."""
    kw = _processors(msg, rows, vocab, path, regions, param) if any(map(msg.HasField, _FIELDS)) else {}
    n = msg.logprobs if msg.HasField("logprobs") else None
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ValueError(f"{path}logprobs: must be in [0, {MAX_LOGPROBS}], got {n}")
    mode = msg.logprobs_mode or LOGPROBS_MODES[0]
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"{path}logprobs_mode: must be one of {list(LOGPROBS_MODES)}, got {msg.logprobs_mode!r}")
    if msg.HasField("random_val") or msg.HasField("random_val_rows"):
        if mode == "processed" and n is not None:
            raise ValueError(f"{path}logprobs_mode: 'processed' does not apply with random_val")
        if msg.return_kept:
            raise ValueError(f"{path}return_kept: does not apply with random_val")
    has = any(k.endswith("_offsets") for k in kw) or "grammar_bitmask" in kw
    return (kw if has else None), n, mode


def _processors(msg, rows: int, vocab: int, path: str, regions, param) -> dict:
    """The processors' kernel keywords, each checked (``ValueError`` naming the field)."""
    kw: dict = {}
    for p in (*PENALTY_PARAMS.values(), MIN_TOKENS):
        value = param(msg, p, rows, path, regions)
        if isinstance(value, list):
            kw[p.name] = torch.tensor(value, dtype=torch.float32 if p.kind is float else torch.int64)
        elif value != p.default:
            kw[p.name] = value
    for name, (ids_name, off_name, _) in RAGGED_LISTS.items():
        ids = _tensor(msg, ids_name, path, regions, INTS, (1,))
        offsets = _tensor(msg, off_name, path, regions, INTS, (1,))
        if offsets is None:
            if ids is not None:
                raise ValueError(f"{path}{off_name}: must be set with {ids_name} ([B + 1] row offsets)")
            continue
        if offsets.shape[0] != rows + 1:
            raise ValueError(f"{path}{off_name}.shape: must be [{rows + 1}] (batch_size + 1), got "
                             f"{list(offsets.shape)}")
        id_values = [] if ids is None else _values(ids)
        error = ragged_error(id_values, _values(offsets), vocab)
        if error:
            field = ids_name if error[0] == "ids" else off_name
            raise ValueError(f"{path}{field}: {error[1]}")
        kw[ids_name] = torch.tensor(id_values, dtype=torch.int64)
        kw[off_name] = torch.tensor(_values(offsets), dtype=torch.int64)
    values = _tensor(msg, "logit_bias_values", path, regions, (torch.float32, torch.float64), (1,))
    if "logit_bias_ids" in kw:
        n = kw["logit_bias_ids"].shape[0]
        got = 0 if values is None else values.shape[0]
        if got != n:
            raise ValueError(f"{path}logit_bias_values.shape: must be [{n}] (one per logit_bias_ids), got [{got}]")
        bias = torch.tensor([] if values is None else _values(values), dtype=torch.float32)
        bad = (~torch.isfinite(bias)).nonzero()
        if bad.numel():
            i = bad[0, 0].item()
            row = int((kw["logit_bias_offsets"] <= i).sum()) - 1
            raise ValueError(f"{path}logit_bias_values[{i}]: must be finite in float32 (row {row}), got "
                             f"{bias[i].item()}")
        kw["logit_bias_values"] = bias
    elif values is not None:
        raise ValueError(f"{path}logit_bias_values: needs logit_bias_ids and logit_bias_offsets")
    grammar = _tensor(msg, "grammar_bitmask", path, regions, (torch.int32,), (2,))
    if grammar is not None:
        words = (vocab + 31) // 32
        if tuple(grammar.shape) != (rows, words):
            raise ValueError(f"{path}grammar_bitmask.shape: must be [{rows}, {words}] ([B, ceil(V / 32)] int32), "
                             f"got {list(grammar.shape)}")
        kw["grammar_bitmask"] = torch.tensor(_values(grammar), dtype=torch.int32).reshape(rows, words)
    if "min_tokens" in kw and "stop_token_ids" in kw and "output_offsets" not in kw:
        raise ValueError(f"{path}min_tokens: needs output_offsets (the output's length per row)")
    return kw


def launch_processed(call, handle, names) -> tuple:
    """On the launch thread: one call with processors or logprobs, alone. Returns
    ``(token ids on the host, logprobs as host tensors or None)``."""
    from .resident import device_inputs
    from ..staging import to_host

    logits, floats, ints = device_inputs(handle, [call.logits], [call.params[0]], [call.params[1]])
    params = dict(zip(names, (*floats.unbind(1), *ints.unbind(1))))
    procs = {k: v.to(logits.device) if isinstance(v, torch.Tensor) else v for k, v in (call.processors or {}).items()}
    extra = {} if call.logprobs is None else dict(logprobs=call.logprobs, logprobs_mode=call.logprobs_mode)
    if call.return_kept:
        extra["return_kept"] = True
    result = kernels.sample(logits, **params, filter_order=call.filter_order, backend=handle.backend, **procs, **extra)
    tokens, lp = result if extra else (result, None)
    call.put_outputs(tokens)
    host_lp = None
    if lp is not None:
        host_lp = tuple(None if t is None else t.cpu() for t in (lp.token_logprob, lp.token_rank, lp.top_token_ids,
                                                                  lp.top_logprobs, lp.kept_bitmask))
    return to_host(tokens), host_lp
