"""Sample's logits processors and logprobs on the wire (issue 26): parsing and validation of the
SampleRequest fields, and the launch of a call that sets any of them.

Every field is checked by the rules of ``kernels/sampling/params.py`` and
``kernels/sampling/processors.py`` (token ids in [0, V), offsets ``[B + 1]`` from 0, not
decreasing, ending at the ids' length; bitmask ``[B, ceil(V / 32)]`` int32; penalties in their
ranges; ``logprobs`` in [0, 20]); a broken rule is a ``ValueError`` naming the field, the row and
the rule (INVALID_ARGUMENT). Here, on the event loop, only what costs nothing per element: each
field's dtype, shape and presence, and the scalars. The values of the lists and per-row fields
are checked in bulk on a worker thread before the call queues (processor_checks.py); the
fields stay as they arrived (the request's bytes, read in place by server/wire.py, or a
region), and become the kernels' tensors on the launch thread.

A call with any processor or logprobs launches as its own group (``SampleCall.key`` is None):
the simplest correct rule, since its ragged lists and bitmask would otherwise have to be merged
with its neighbours' (offsets rebased). Where its lists' ids are in CUDA regions (and the rest of
processors_in_place.py's rule holds) it launches there, through a list table the device computes
from the offsets, from a CUDA graph. Otherwise it launches here (:func:`launch_processed`),
eagerly on the launch thread with its lists ragged: lists as bytes or in system regions are
staged at their length, which a graph would hold, and int32 ids, an allowed list or the torch
backend have no table. An empty list over the whole batch is sent as the offsets alone (zeros),
``<x>_token_ids`` unset: the wire has no empty tensors.
"""

from __future__ import annotations

from typing import Mapping

import torch

from logitserve import kernels
from logitserve.kernels.sampling.params import (LOGPROBS_MODES, MAX_LOGPROBS, MIN_TOKENS, PENALTY_PARAMS,
                                                RAGGED_LISTS)

from ..engine.staging import to_host
from ..tensors import INTS, NOT_IN_PLACE, DeviceTensor, HostTensor, decode
from .processor_checks import BulkChecks, Reads

# The float fields' wire dtypes: float32, or float64 (checked in float32 too).
_FLOAT_DTYPES = (torch.float32, torch.float64)
_ROWS_FIELDS = tuple(p.rows_field for p in (*PENALTY_PARAMS.values(), MIN_TOKENS))
_LIST_FIELDS = tuple(f for ids, offsets, _ in RAGGED_LISTS.values() for f in (ids, offsets))
# The processors' tensor fields: read in place from the received request (server/api/servicer.py).
TENSOR_FIELDS = (*_ROWS_FIELDS, *_LIST_FIELDS, "logit_bias_values", "grammar_bitmask")
# Every field the processors read: plain sampling sets none of them and skips their checks.
_FIELDS = (*(p.name for p in (*PENALTY_PARAMS.values(), MIN_TOKENS)), *TENSOR_FIELDS)
# The dtype each tensor field reaches the kernels in, whatever the wire's (the kernels read
# int32 lists too, but one dtype keeps them to one compiled variant).
_KERNEL_DTYPES = {**{p.name: torch.float32 for p in PENALTY_PARAMS.values()}, MIN_TOKENS.name: torch.int64,
                  **{f: torch.int64 for f in _LIST_FIELDS}, "logit_bias_values": torch.float32,
                  "grammar_bitmask": torch.int32}


def _tensor(msg, name: str, path: str, regions, in_place: Mapping[str, memoryview], dtypes, ranks):
    if not msg.HasField(name):
        return None
    return decode(getattr(msg, name), f"{path}{name}", dtypes=dtypes, ranks=ranks, data=in_place.get(name),
                  regions=regions)


def parse(msg, rows: int, vocab: int, path: str, regions, param,
          in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> tuple[dict | None, BulkChecks | None, int | None, str]:
    """``(kernel keywords of the processors or None, their checks still to run or None,
    logprobs n or None, logprobs mode)`` (``msg.return_kept`` is read by the caller). The
    keywords' tensors are the fields as they arrived (:func:`kernel_keywords` makes them
    tensors); the checks run before the call queues (``SampleCall.checked``).

    ``param(msg, p, rows, path, regions)`` reads a scalar parameter (sample.py's)."""
    kw, checks = {}, None
    if any(map(msg.HasField, _FIELDS)):
        kw, checks = _processors(msg, rows, vocab, path, regions, param, in_place)
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
    return (kw if has else None), (checks or None), n, mode


def _processors(msg, rows: int, vocab: int, path: str, regions, param, in_place) -> tuple[dict, BulkChecks]:
    """The processors' kernel keywords, each field's dtype, shape and presence checked
    (``ValueError`` naming the field), and the checks of their values."""
    kw: dict = {}
    checks = BulkChecks()
    for p in (*PENALTY_PARAMS.values(), MIN_TOKENS):
        values = _tensor(msg, p.rows_field, path, regions, in_place, _FLOAT_DTYPES if p.kind is float else INTS, (1,))
        if values is None:
            value = param(msg, p, rows, path, regions)
            if value != p.default:
                kw[p.name] = value
            continue
        if values.shape[0] != rows:
            raise ValueError(f"{path}{p.rows_field}.shape: must be [{rows}] (one value per row), got "
                             f"{list(values.shape)}")
        checks.rows(path + p.rows_field, p, values)
        kw[p.name] = values
    for ids_name, off_name, _ in RAGGED_LISTS.values():
        ids = _tensor(msg, ids_name, path, regions, in_place, INTS, (1,))
        offsets = _tensor(msg, off_name, path, regions, in_place, INTS, (1,))
        if offsets is None:
            if ids is not None:
                raise ValueError(f"{path}{off_name}: must be set with {ids_name} ([B + 1] row offsets)")
            continue
        if offsets.shape[0] != rows + 1:
            raise ValueError(f"{path}{off_name}.shape: must be [{rows + 1}] (batch_size + 1), got "
                             f"{list(offsets.shape)}")
        checks.ragged(path, ids_name, off_name, ids, offsets, vocab)
        kw[ids_name], kw[off_name] = ids, offsets
    values = _tensor(msg, "logit_bias_values", path, regions, in_place, _FLOAT_DTYPES, (1,))
    if "logit_bias_offsets" in kw:
        ids = kw["logit_bias_ids"]
        n = 0 if ids is None else ids.shape[0]
        got = 0 if values is None else values.shape[0]
        if got != n:
            raise ValueError(f"{path}logit_bias_values.shape: must be [{n}] (one per logit_bias_ids), got [{got}]")
        if values is not None:
            checks.bias(f"{path}logit_bias_values", values, kw["logit_bias_offsets"])
        kw["logit_bias_values"] = values
    elif values is not None:
        raise ValueError(f"{path}logit_bias_values: needs logit_bias_ids and logit_bias_offsets")
    grammar = _tensor(msg, "grammar_bitmask", path, regions, in_place, (torch.int32,), (2,))
    if grammar is not None:
        words = (vocab + 31) // 32
        if tuple(grammar.shape) != (rows, words):
            raise ValueError(f"{path}grammar_bitmask.shape: must be [{rows}, {words}] ([B, ceil(V / 32)] int32), "
                             f"got {list(grammar.shape)}")
        kw["grammar_bitmask"] = grammar
    if "min_tokens" in kw and "stop_offsets" in kw and "output_offsets" not in kw:
        raise ValueError(f"{path}min_tokens: needs output_offsets (the output's length per row)")
    return kw, checks


def kernel_keywords(processors: dict, device: torch.device, read: Reads) -> dict:
    """On the launch thread: the processors' keywords as the kernels take them, every field a
    tensor on ``device`` (a CUDA region there: itself; bytes: copied in, on the CPU read where
    they are; system regions: the copy their checks read, ``read``'s, else read through their
    descriptor now). A list sent as its offsets alone gets empty ids, and values."""
    kw = {}
    for name, value in processors.items():
        if isinstance(value, (HostTensor, DeviceTensor)):
            value = read(value).to(device=device, dtype=_KERNEL_DTYPES[name])
        elif value is None:  # the ids (or bias values) of lists sent as offsets alone
            value = torch.empty(0, dtype=_KERNEL_DTYPES[name], device=device)
        kw[name] = value
    return kw


def launch_processed(call, handle, names) -> tuple:
    """On the launch thread: one call with processors or logprobs, alone, its lists ragged. Returns ``(token ids
    on the host, logprobs as host tensors or None, whether a field in a CUDA region breaks a rule
    (a host bool tensor) or None)``: those fields' checks queue ahead of the kernels
    (processor_checks.py), whose clamping makes any list safe to read."""
    from .resident import device_inputs

    logits, floats, ints = device_inputs(handle, [call.logits], [call.params[0]], [call.params[1]])
    params = dict(zip(names, (*floats.unbind(1), *ints.unbind(1))))
    broken = None if call.device_checks is None else call.device_checks.in_launch()
    procs = kernel_keywords(call.processors or {}, logits.device, checked_reads(call))
    extra = {} if call.logprobs is None else dict(logprobs=call.logprobs, logprobs_mode=call.logprobs_mode)
    if call.return_kept:
        extra["return_kept"] = True
    result = kernels.sample(logits, **params, filter_order=call.filter_order, backend=handle.backend, **procs, **extra)
    tokens, lp = result if extra else (result, None)
    call.put_outputs(tokens)
    return to_host(tokens), logprobs_on_host(lp), None if broken is None else to_host(broken)


def checked_reads(call) -> Reads:
    """The tensors ``call``'s checks read (host and device checks share them), to launch from."""
    for checks in (call.checks, call.device_checks):
        if checks is not None:
            return checks.read
    return Reads()


# A Sample answer's logprobs fields, in the order the answer takes them (Logprobs' attributes;
# kept_bitmask with return_kept).
LOGPROBS_FIELDS = ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs", "kept_bitmask")


def logprobs_on_host(lp) -> tuple | None:
    """A launch's ``Logprobs`` as the answer takes them: ``(token_logprobs, token_ranks,
    top_token_ids, top_logprobs, kept_bitmask)``, each copied to the host (valid once the
    launch's stream is done) or None; None without logprobs."""
    if lp is None:
        return None
    return tuple(None if t is None else to_host(t) for t in (getattr(lp, name) for name in LOGPROBS_FIELDS))
