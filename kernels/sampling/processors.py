"""Logits processors: penalties, logit bias, allowed / banned tokens, min_tokens and a grammar
bitmask, applied to ``logits [B, V]`` before temperature and the filters.

The order (docs/DESIGN.md): penalties -> bias -> allowed / banned / min_tokens / grammar mask.
For a token ``t`` of row ``r`` (``x`` its logit, ``count`` its occurrences in the output so far,
``seen`` whether it occurs in the prompt or the output)::

    x = x / rep if x > 0 else x * rep          where seen   (repetition_penalty; 1: off)
    x = x - freq * count - pres * (count > 0)               (frequency / presence; 0: off)
    x = x + sum of the row's biases for t                    (logit bias)
    x = -inf  unless t is allowed (allowed list, when given; grammar bit set, when given)
    x = -inf  where t is banned, or a stop token while len(output) < min_tokens

``_process`` is one Triton kernel, a program per row, that writes the processed row (float32)
into a new tensor which the sampling launches then read. It runs in phases separated by
barriers: (1) a dense pass copies the row, with the grammar mask, or writes -inf everywhere
when an allowed list is given; (2) the allowed tokens are copied back (grammar permitting);
(3) every token in the prompt, output or bias lists gets its value from the formula above,
unless it is already -inf (masked); (4) banned and (active) stop tokens get -inf. Penalties and
bias touch only the tokens in the lists, so their cost is the lists' lengths (counts by tile
compares, [TB, TB] at a time), not the vocabulary. Each phase-3 write is the token's final value
from the original logits, so duplicate ids (written twice, the same value) need no ordering.

Ids outside ``[0, V)`` are ignored by the kernel (CPU inputs are checked on the host first, with
``ValueError``; CUDA inputs are not, since reading them back would cost a synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._backend import launchable, resolve_backend
from .params import MIN_TOKENS, PENALTY_PARAMS, RAGGED_LISTS, SamplingParam

INDEX_DTYPES = (torch.int32, torch.int64)
TB = 64  # list tokens per tile
DENSE_BLOCK = 2048


@triton.jit
def _allowed_by_grammar(g_ptr, row, g_words, t, HAS_GRAMMAR: tl.constexpr):
    if HAS_GRAMMAR:
        word = tl.load(g_ptr + row * g_words + (t // 32))
        return ((word >> (t % 32).to(word.dtype)) & 1) != 0
    else:
        return t >= 0


@triton.jit
def _span(off_ptr, row):
    return tl.load(off_ptr + row).to(tl.int64), tl.load(off_ptr + row + 1).to(tl.int64)


@triton.jit
def _count_in(t, ids_ptr, lo, hi, TB: tl.constexpr):
    """How often each of ``t [TB]`` occurs in ``ids[lo:hi]`` (int32 [TB])."""
    count = tl.zeros([TB], tl.int32)
    for s in range(lo, hi, TB):
        j = s + tl.arange(0, TB)
        o = tl.load(ids_ptr + j, mask=j < hi, other=-1).to(tl.int64)
        count += tl.sum(((t[:, None] == o[None, :]) & (j < hi)[None, :]).to(tl.int32), axis=1)
    return count


@triton.jit
def _touch(y_row, x_row, x_cs, t, ok, row, rep, freq, pres, p_ids, p_lo, p_hi, o_ids, o_lo, o_hi,
           b_ids, b_vals, b_lo, b_hi, SEEN: tl.constexpr, HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr,
           HAS_BIAS: tl.constexpr, TB: tl.constexpr):
    """Phase 3 for list tokens ``t [TB]`` (lanes ``ok``): their final value, unless masked."""
    cur = tl.load(y_row + t, mask=ok, other=float("-inf"))
    v = tl.load(x_row + t * x_cs, mask=ok, other=0.0).to(tl.float32)
    if HAS_OUTPUT:
        count = _count_in(t, o_ids, o_lo, o_hi, TB)
        seen = count > 0
        if SEEN:
            seen = seen | ok
        elif HAS_PROMPT:
            seen = seen | (_count_in(t, p_ids, p_lo, p_hi, TB) > 0)
        v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
        v = v - freq * count.to(tl.float32) - tl.where(count > 0, pres, 0.0)
    elif HAS_PROMPT:
        seen = ok
        if not SEEN:
            seen = _count_in(t, p_ids, p_lo, p_hi, TB) > 0
        v = tl.where(seen, tl.where(v > 0, v / rep, v * rep), v)
    if HAS_BIAS:
        bias = tl.zeros([TB], tl.float32)
        for s in range(b_lo, b_hi, TB):
            j = s + tl.arange(0, TB)
            bm = j < b_hi
            b = tl.load(b_ids + j, mask=bm, other=-1).to(tl.int64)
            bv = tl.load(b_vals + j, mask=bm, other=0.0).to(tl.float32)
            bias += tl.sum(tl.where((t[:, None] == b[None, :]) & bm[None, :], bv[None, :], 0.0), axis=1)
        v = v + bias
    tl.store(y_row + t, tl.where(cur == float("-inf"), cur, v), mask=ok)


@launchable
@triton.jit(do_not_specialize=["n_cols", "g_words"])
def _process(y_ptr, x_ptr, x_rs, x_cs, n_cols, rep_ptr, freq_ptr, pres_ptr, p_ids, p_off, o_ids, o_off,
             b_ids, b_vals, b_off, a_ids, a_off, n_ids, n_off, s_ids, s_off, mt_ptr, g_ptr, g_words,
             HAS_PROMPT: tl.constexpr, HAS_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_ALLOWED: tl.constexpr, HAS_BANNED: tl.constexpr, HAS_MIN_TOKENS: tl.constexpr,
             HAS_GRAMMAR: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_rs
    y_row = y_ptr + row * n_cols
    # (1) Dense: the row, grammar-masked; everything -inf when an allowed list is given.
    for start in range(0, n_cols, BLOCK):
        col = start + tl.arange(0, BLOCK).to(tl.int64)
        m = col < n_cols
        if HAS_ALLOWED:
            x = tl.full([BLOCK], float("-inf"), tl.float32)
        else:
            x = tl.load(x_row + col * x_cs, mask=m, other=float("-inf")).to(tl.float32)
            if HAS_GRAMMAR:
                word = tl.load(g_ptr + row * g_words + col // 32, mask=m, other=0)
                x = tl.where(((word >> (col % 32).to(word.dtype)) & 1) != 0, x, float("-inf"))
        tl.store(y_row + col, x, mask=m)
    tl.debug_barrier()
    # (2) The allowed tokens back, where the grammar allows them too.
    if HAS_ALLOWED:
        a_lo, a_hi = _span(a_off, row)
        for s in range(a_lo, a_hi, TB):
            j = s + tl.arange(0, TB)
            t = tl.load(a_ids + j, mask=j < a_hi, other=-1).to(tl.int64)
            ok = (j < a_hi) & (t >= 0) & (t < n_cols)
            t = tl.where(ok, t, 0)
            x = tl.load(x_row + t * x_cs, mask=ok, other=float("-inf")).to(tl.float32)
            keep = _allowed_by_grammar(g_ptr, row, g_words, t, HAS_GRAMMAR)
            tl.store(y_row + t, tl.where(keep, x, float("-inf")), mask=ok)
        tl.debug_barrier()
    # (3) Penalties and bias on the tokens of the lists.
    if HAS_PROMPT or HAS_OUTPUT or HAS_BIAS:
        rep = tl.load(rep_ptr + row)
        freq = tl.load(freq_ptr + row)
        pres = tl.load(pres_ptr + row)
        p_lo = row * 0
        p_hi = row * 0
        o_lo = row * 0
        o_hi = row * 0
        b_lo = row * 0
        b_hi = row * 0
        if HAS_PROMPT:
            p_lo, p_hi = _span(p_off, row)
        if HAS_OUTPUT:
            o_lo, o_hi = _span(o_off, row)
        if HAS_BIAS:
            b_lo, b_hi = _span(b_off, row)
        if HAS_PROMPT:
            for s in range(p_lo, p_hi, TB):
                j = s + tl.arange(0, TB)
                t = tl.load(p_ids + j, mask=j < p_hi, other=-1).to(tl.int64)
                ok = (j < p_hi) & (t >= 0) & (t < n_cols)
                _touch(y_row, x_row, x_cs, tl.where(ok, t, 0), ok, row, rep, freq, pres, p_ids, p_lo, p_hi,
                       o_ids, o_lo, o_hi, b_ids, b_vals, b_lo, b_hi, True, HAS_PROMPT, HAS_OUTPUT, HAS_BIAS, TB)
        if HAS_OUTPUT:
            for s in range(o_lo, o_hi, TB):
                j = s + tl.arange(0, TB)
                t = tl.load(o_ids + j, mask=j < o_hi, other=-1).to(tl.int64)
                ok = (j < o_hi) & (t >= 0) & (t < n_cols)
                _touch(y_row, x_row, x_cs, tl.where(ok, t, 0), ok, row, rep, freq, pres, p_ids, p_lo, p_hi,
                       o_ids, o_lo, o_hi, b_ids, b_vals, b_lo, b_hi, True, HAS_PROMPT, HAS_OUTPUT, HAS_BIAS, TB)
        if HAS_BIAS:
            for s in range(b_lo, b_hi, TB):
                j = s + tl.arange(0, TB)
                t = tl.load(b_ids + j, mask=j < b_hi, other=-1).to(tl.int64)
                ok = (j < b_hi) & (t >= 0) & (t < n_cols)
                _touch(y_row, x_row, x_cs, tl.where(ok, t, 0), ok, row, rep, freq, pres, p_ids, p_lo, p_hi,
                       o_ids, o_lo, o_hi, b_ids, b_vals, b_lo, b_hi, False, HAS_PROMPT, HAS_OUTPUT, HAS_BIAS, TB)
        tl.debug_barrier()
    # (4) Banned tokens, and stop tokens while the output is shorter than min_tokens.
    if HAS_BANNED:
        n_lo, n_hi = _span(n_off, row)
        for s in range(n_lo, n_hi, TB):
            j = s + tl.arange(0, TB)
            t = tl.load(n_ids + j, mask=j < n_hi, other=-1).to(tl.int64)
            ok = (j < n_hi) & (t >= 0) & (t < n_cols)
            tl.store(y_row + tl.where(ok, t, 0), tl.full([TB], float("-inf"), tl.float32), mask=ok)
    if HAS_MIN_TOKENS:
        out_lo, out_hi = _span(o_off, row)
        out_len = out_hi - out_lo
        min_len = tl.load(mt_ptr + row).to(tl.int64)
        s_lo, s_hi = _span(s_off, row)
        for s in range(s_lo, s_hi, TB):
            j = s + tl.arange(0, TB)
            t = tl.load(s_ids + j, mask=j < s_hi, other=-1).to(tl.int64)
            ok = (j < s_hi) & (t >= 0) & (t < n_cols) & (j * 0 + out_len < min_len)
            tl.store(y_row + tl.where(ok, t, 0), tl.full([TB], float("-inf"), tl.float32), mask=ok)


@dataclass
class Processors:
    """The processors of one call, checked (``Processors.of``); every list is ``(ids, offsets)``."""

    repetition_penalty: object = 1.0
    frequency_penalty: object = 0.0
    presence_penalty: object = 0.0
    prompt: tuple | None = None
    output: tuple | None = None
    logit_bias: tuple | None = None  # (ids, offsets, values)
    allowed: tuple | None = None
    banned: tuple | None = None
    min_tokens: object = 0
    stop: tuple | None = None
    grammar_bitmask: torch.Tensor | None = None

    @property
    def penalties_on(self) -> bool:
        return any(isinstance(getattr(self, p.name), torch.Tensor) or getattr(self, p.name) != p.off
                   for p in PENALTY_PARAMS.values())

    @property
    def min_tokens_on(self) -> bool:
        return self.stop is not None and (isinstance(self.min_tokens, torch.Tensor) or self.min_tokens != 0)

    @property
    def any(self) -> bool:
        return (self.penalties_on and (self.prompt is not None or self.output is not None)) or \
            self.logit_bias is not None or self.allowed is not None or self.banned is not None or \
            self.min_tokens_on or self.grammar_bitmask is not None

    @classmethod
    def of(cls, n_rows: int, n_cols: int, device, **kw) -> "Processors":
        """Check ``sample``'s processor keywords (``ValueError`` / ``TypeError`` naming the argument)."""
        procs = cls()
        for param in (*PENALTY_PARAMS.values(), MIN_TOKENS):
            value = kw.pop(param.name)
            _check_scalar_or_rows(param, value, n_rows, device)
            setattr(procs, param.name, value)
        for name, (ids_name, off_name, _) in RAGGED_LISTS.items():
            ids, offsets = kw.pop(ids_name), kw.pop(off_name)
            if (ids is None) != (offsets is None):
                raise ValueError(f"{ids_name} and {off_name} must be given together")
            if ids is None:
                continue
            _check_ragged(ids_name, off_name, ids, offsets, n_rows, n_cols, device)
            setattr(procs, name, (ids, offsets))
        values = kw.pop("logit_bias_values")
        if (values is None) != (procs.logit_bias is None):
            raise ValueError("logit_bias_values must be given with logit_bias_ids and logit_bias_offsets")
        if values is not None:
            ids = procs.logit_bias[0]
            if not isinstance(values, torch.Tensor) or values.shape != ids.shape or not values.is_floating_point():
                raise ValueError(f"logit_bias_values must be a float tensor of shape {list(ids.shape)}")
            if values.device.type == "cpu" and not bool(torch.isfinite(values).all()):
                raise ValueError("logit_bias_values must be finite")
            procs.logit_bias = (*procs.logit_bias, values)
        g = kw.pop("grammar_bitmask")
        if g is not None:
            words = (n_cols + 31) // 32
            if not isinstance(g, torch.Tensor) or g.dtype != torch.int32 or tuple(g.shape) != (n_rows, words):
                raise ValueError(f"grammar_bitmask must be an int32 tensor of shape [{n_rows}, {words}] "
                                 f"(ceil(vocab_size / 32) words a row), got "
                                 f"{getattr(g, 'dtype', type(g).__name__)} {list(getattr(g, 'shape', []))}")
            if g.device != device:
                raise ValueError(f"grammar_bitmask must be on {device}, got {g.device}")
            procs.grammar_bitmask = g.contiguous()
        if procs.min_tokens_on and procs.output is None:
            raise ValueError("min_tokens needs output_token_ids and output_offsets (the output's length)")
        assert not kw, kw
        return procs


PROCESSOR_KEYWORDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens",
                      "logit_bias_values", "grammar_bitmask",
                      *(name for pair in RAGGED_LISTS.values() for name in pair[:2]))


def _check_scalar_or_rows(param: SamplingParam, value, n_rows: int, device) -> None:
    rule = f"{param.rule} ({param.note})" if param.note else param.rule
    if isinstance(value, torch.Tensor):
        if value.shape != (n_rows,) or value.device != device:
            raise ValueError(f"{param.name}: a per-row tensor must have shape [{n_rows}] on {device}")
        if value.device.type == "cpu":
            bad = (~param.ok(value.to(torch.float64 if param.kind is float else torch.int64))).nonzero()
            if bad.numel():
                r = bad[0, 0].item()
                raise ValueError(f"{param.name} must be {rule}, got {value[r].item()} in row {r}")
        return
    kinds = (int,) if param.kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{param.name} must be a number or a [batch_size] tensor, got {type(value).__name__}")
    if not param.ok(value):
        raise ValueError(f"{param.name} must be {rule}, got {value}")


def _check_ragged(ids_name, off_name, ids, offsets, n_rows, n_cols, device) -> None:
    for name, t in ((ids_name, ids), (off_name, offsets)):
        if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES or t.ndim != 1:
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if offsets.shape[0] != n_rows + 1:
        raise ValueError(f"{off_name} must have batch_size + 1 = {n_rows + 1} entries, got {offsets.shape[0]}")
    # The offsets ([B + 1]) are read on the host on every device, since the kernel trusts the
    # spans they make: one past the ids would read out of bounds. The ids are checked on the CPU
    # only (the kernel skips an id outside the vocabulary; reading them back would cost a copy).
    message = ragged_error(ids.tolist() if device.type == "cpu" else None, offsets.tolist(), n_cols,
                           n_ids=ids.shape[0])
    if message:
        raise ValueError(f"{ids_name if message[0] == 'ids' else off_name}: {message[1]}")


def ragged_error(ids: list | None, offsets: list, n_cols: int, n_ids: int | None = None) -> tuple[str, str] | None:
    """The first broken rule of a ragged list, as ``("ids" | "offsets", message)``; None if valid.
    ``ids`` None checks the offsets alone, against ``n_ids`` ids."""
    if n_ids is None:
        n_ids = len(ids)
    if offsets[0] != 0:
        return "offsets", f"must start at 0, got {offsets[0]}"
    for r in range(len(offsets) - 1):
        if offsets[r + 1] < offsets[r]:
            return "offsets", f"must not decrease, got {offsets[r + 1]} after {offsets[r]} (row {r})"
    if offsets[-1] != n_ids:
        return "offsets", f"must end at the ids' length {n_ids}, got {offsets[-1]}"
    if ids is None:
        return None
    for r in range(len(offsets) - 1):
        for i in range(offsets[r], offsets[r + 1]):
            if not 0 <= ids[i] < n_cols:
                return "ids", f"must be in [0, {n_cols}) (vocab_size), got {ids[i]} in row {r}"
    return None


def _rows(value, n_rows, dtype, device):
    if isinstance(value, torch.Tensor):
        return value.to(dtype).contiguous()
    return torch.full((n_rows,), value, dtype=dtype, device=device)


def process_logits(logits: torch.Tensor, procs: Processors, backend: str = "auto") -> torch.Tensor:
    """The processed logits, float32 ``[B, V]`` (a new tensor); see the module docstring."""
    n_rows, n_cols = logits.shape
    backend = resolve_backend(backend, logits.device)
    if backend == "torch":
        from ..reference.processors import process as reference
        return reference(logits, procs).to(torch.float32)
    dev = logits.device
    y = torch.empty((n_rows, n_cols), dtype=torch.float32, device=dev)
    if n_rows == 0:
        return y
    dummy = torch.zeros(2, dtype=torch.int32, device=dev)
    fdummy = torch.zeros(1, dtype=torch.float32, device=dev)
    rep, freq, pres = (_rows(getattr(procs, p.name), n_rows, torch.float32, dev) for p in PENALTY_PARAMS.values())
    use_penalties = procs.penalties_on

    def pair(lst, on=True):
        return (lst[0], lst[1]) if lst is not None and on else (dummy, dummy)

    prompt_on = use_penalties and procs.prompt is not None
    output_on = use_penalties and procs.output is not None
    bias = procs.logit_bias
    g = procs.grammar_bitmask
    mt = _rows(procs.min_tokens, n_rows, torch.int64, dev) if procs.min_tokens_on else dummy
    o_off = procs.output[1] if procs.output is not None else dummy
    o_ids = procs.output[0] if output_on else dummy
    args = (y, logits, *logits.stride(), n_cols, rep, freq, pres, *pair(procs.prompt, prompt_on), o_ids, o_off,
            *((bias[0], bias[2], bias[1]) if bias is not None else (dummy, fdummy, dummy)),
            *pair(procs.allowed), *pair(procs.banned), *pair(procs.stop, procs.min_tokens_on), mt,
            g if g is not None else dummy, g.shape[1] if g is not None else 0)
    _process.for_backend(backend)[(n_rows,)](
        *args, HAS_PROMPT=prompt_on, HAS_OUTPUT=output_on, HAS_BIAS=bias is not None,
        HAS_ALLOWED=procs.allowed is not None, HAS_BANNED=procs.banned is not None,
        HAS_MIN_TOKENS=procs.min_tokens_on, HAS_GRAMMAR=g is not None,
        BLOCK=min(DENSE_BLOCK, triton.next_power_of_2(max(n_cols, 16))), TB=TB, num_warps=8)
    return y


__all__ = ["PROCESSOR_KEYWORDS", "Processors", "process_logits", "ragged_error"]
