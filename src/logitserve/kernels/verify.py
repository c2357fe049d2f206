"""``verify``: chain speculative sampling (``VerifyPlan``, the function), exact to the target's filters.

The launches, in order (``verify_kernel.py`` explains the algorithm):

1. ``sample``'s statistics over the target logits as ``B (n + 1)`` rows (``sampling/stats.py``):
   max, softmax total, greedy token, validity; with filters, the candidate bound.
2. With filters: ``sample``'s candidate gather (``sampling/gather.py``), then ``_thresholds``,
   each row's kept set as a key threshold and its mass.
3. From draft logits: the same statistics over them as ``B n`` rows, with the draft temperature
   (also for greedy calls: a draft row with a NaN makes its row invalid in every mode).
4. ``_verify_draw``: the walk and the draw, grid batch rows x chunks.

Greedy calls (scalar ``temperature == 0`` or ``top_k == 1``) take launches 1, (3) and 4; pure
temperature sampling skips 2. The parameters are ``sample``'s (``sampling/params.py``), per
batch row; the plan repeats a per-row tensor for the ``n + 1`` target rows of its batch row.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import NamedTuple

import torch
import triton

from ._backend import resolve_backend
from ._plan import FLOAT_DTYPES, TensorSpec, check_dtype, check_same_device, check_tensor, plan_cache
from .reference import verify as reference
from .sampling.api import _check_counter, _check_param
from .sampling.launcher import FastLauncher
from .sampling.params import FILTER_ORDERS, MIN_P, SEED, SEED_BITS, SEED_RANGE, STEP, STEP_RANGE, TEMPERATURE, TOP_K, \
    TOP_P
from .sampling.plan import INT_DTYPES, PARAM_DTYPES, as_int64, chunk_settings, finish_settings, u64_arg
from .sampling.gather import _gather
from .sampling.stats import _stats_merge
from .sampling.workspace import _on_host, workspace_size
from .verify_kernel import _thresholds, _verify_draw, race_layout

# The draft temperature keeps the target temperature's rule (0: the draft drew its arg-max).
DRAFT_TEMPERATURE = dataclasses.replace(TEMPERATURE, name="draft_temperature")
_race_size = _on_host(race_layout)


class VerifyResult(NamedTuple):
    """``token_ids [B, n + 1]`` int64: the accepted draft tokens, then the correction (or bonus)
    token, then -1; ``num_accepted [B]`` int64; ``valid [B]`` bool (false: every token -1)."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    valid: torch.Tensor


def check_layouts(draft_token_ids: TensorSpec, target_logits: TensorSpec, draft: TensorSpec, draft_name: str) -> \
        tuple[int, int, int]:
    """``(B, n, V)`` of agreeing layouts; ``TypeError`` / ``ValueError`` naming the argument and the rule."""
    check_dtype("draft_token_ids", draft_token_ids.dtype, INT_DTYPES)
    if draft_token_ids.ndim != 2 or draft_token_ids.shape[1] < 1:
        raise ValueError(f"draft_token_ids: must be 2-D (batch_size, n) with n >= 1, got shape "
                         f"{list(draft_token_ids.shape)}")
    rows, n = draft_token_ids.shape
    check_dtype("target_logits", target_logits.dtype, FLOAT_DTYPES)
    if target_logits.ndim != 3 or target_logits.shape[:2] != (rows, n + 1) or target_logits.shape[2] < 1:
        raise ValueError(f"target_logits: shape must be [B, n + 1, V] = [{rows}, {n + 1}, V] with V >= 1 (B, n from "
                         f"draft_token_ids), got {list(target_logits.shape)}")
    vocab = target_logits.shape[2]
    check_dtype(draft_name, draft.dtype, FLOAT_DTYPES)
    if draft.shape != (rows, n, vocab):
        raise ValueError(f"{draft_name}: shape must be [B, n, V] = [{rows}, {n}, {vocab}] (B, n from "
                         f"draft_token_ids, V from target_logits), got {list(draft.shape)}")
    for name, spec in (("target_logits", target_logits), (draft_name, draft)):
        check_same_device(name, spec, draft_token_ids.device)
    return rows, n, vocab


def _rows_of(spec: TensorSpec) -> bool:
    """Whether a [B, m, V] layout reads as B m rows of V with one row stride."""
    return spec.shape[0] == 1 or spec.strides[0] == spec.strides[1] * spec.shape[1]


class VerifyPlan:
    """Chain speculative sampling for one layout; see :func:`verify`.

    Created from the layouts of ``draft_token_ids``, ``target_logits`` and the draft (its
    probabilities, or with ``from_logits`` its logits), which parameters are per-row tensors
    (their :class:`TensorSpec`; ``None``: a Python scalar), ``filter_order`` and ``backend``.
    Calling it launches with no further checks. Scratch memory belongs to the plan (compiled
    Triton) or to each call (the interpreter): a plan's calls must be ordered (one stream).
    """

    def __init__(self, draft_token_ids: TensorSpec, target_logits: TensorSpec, draft: TensorSpec, *,
                 from_logits: bool = False, draft_temperature: TensorSpec | None = None,
                 temperature: TensorSpec | None = None, top_k: TensorSpec | None = None,
                 top_p: TensorSpec | None = None, min_p: TensorSpec | None = None, seed: TensorSpec | None = None,
                 step: TensorSpec | None = None, filter_order: str = "top_k_first", backend: str = "auto"):
        self.n_rows, self.n_draft, self.n_cols = check_layouts(draft_token_ids, target_logits, draft,
                                                               "draft_logits" if from_logits else "draft_probs")
        if filter_order not in FILTER_ORDERS:
            raise ValueError(f"filter_order must be one of {FILTER_ORDERS}, got {filter_order!r}")
        specs = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
                 "step": step, "draft_temperature": draft_temperature}
        if draft_temperature is not None and not from_logits:
            raise ValueError("draft_temperature: applies only to draft logits")
        for name, spec in specs.items():
            if spec is None:
                continue
            check_dtype(name, spec.dtype, PARAM_DTYPES["temperature" if name == "draft_temperature" else name])
            if spec.shape != (self.n_rows,):
                raise ValueError(f"{name}: a per-row tensor must have shape [{self.n_rows}], got {list(spec.shape)}")
            check_same_device(name, spec, target_logits.device)
        self.per_row = {name: spec is not None for name, spec in specs.items()}
        self.from_logits, self.filter_order = from_logits, filter_order
        self.backend = resolve_backend(backend, target_logits.device)
        self.is_f64 = target_logits.dtype == torch.float64
        self.draft_f64 = draft.dtype == torch.float64
        self.copy_target, self.copy_draft = not _rows_of(target_logits), from_logits and not _rows_of(draft)
        self.chunk, self.groups, self.warps = chunk_settings(self.n_cols)
        self.n_chunks = triton.cdiv(self.n_cols, self.chunk)
        self.block, self.select_block, self.finish_warps = finish_settings(self.n_cols)
        self._scratch = None
        if self.backend != "torch":
            self.kernels = [FastLauncher(k, self.backend) for k in (_stats_merge, _gather, _thresholds, _verify_draw)]
            self.device_index = target_logits.device.index or 0

    def _new_scratch(self, device: torch.device) -> dict:
        """Zero-filled workspaces (the kernels leave their tickets at zero) and per-row arrays."""
        n_rows, n_draft = self.n_rows, self.n_draft
        target_rows, ct = n_rows * (n_draft + 1), torch.float64 if self.is_f64 else torch.float32

        def zeros(size):
            return torch.zeros(size, dtype=torch.uint8, device=device)

        scratch = dict(
            target=zeros(workspace_size(target_rows, self.n_chunks, self.groups, self.is_f64)),
            race=zeros(_race_size(n_rows, self.n_chunks, 8 if self.is_f64 else 4)[-1]),
            greedy=torch.empty(target_rows, dtype=torch.int64, device=device),
            kept_key=torch.empty(target_rows, dtype=torch.int64, device=device),
            kept_mass=torch.empty(target_rows, dtype=ct, device=device))
        if self.from_logits:
            scratch["draft"] = zeros(workspace_size(n_rows * n_draft, self.n_chunks, self.groups, self.draft_f64))
            scratch["draft_greedy"] = torch.empty(n_rows * n_draft, dtype=torch.int64, device=device)
        return scratch

    def _scratch_for(self, device: torch.device) -> dict:
        if self.backend != "triton" or torch.cuda.is_current_stream_capturing():
            return self._new_scratch(device)
        if self._scratch is None:
            self._scratch = self._new_scratch(device)
        return self._scratch

    def __call__(self, draft_token_ids: torch.Tensor, target_logits: torch.Tensor, draft: torch.Tensor, *,
                 draft_temperature=1.0, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0,
                 out: VerifyResult | None = None) -> VerifyResult:
        """``out``, when given: contiguous tensors of the result's shapes and dtypes, written in full."""
        device, n_rows, n_draft = target_logits.device, self.n_rows, self.n_draft
        if out is None:
            out = VerifyResult(torch.empty((n_rows, n_draft + 1), dtype=torch.int64, device=device),
                               torch.empty(n_rows, dtype=torch.int64, device=device),
                               torch.empty(n_rows, dtype=torch.bool, device=device))
        tokens, accepted, valid = out.token_ids, out.num_accepted, out.valid.view(torch.int8)
        if n_rows == 0:
            return out
        if self.backend == "torch":
            for target, value in zip(out, self._reference(draft_token_ids, target_logits, draft, draft_temperature,
                                                          temperature, top_k, top_p, min_p, seed, step)):
                target.copy_(value)
            return out
        stats_merge, gather, thresholds, draw = self.kernels
        per_row, n_cols, dev = self.per_row, self.n_cols, self.device_index
        scratch = self._scratch_for(device)
        ws = scratch["target"]
        positions = n_draft + 1
        target_rows = n_rows * positions
        x = (target_logits.contiguous() if self.copy_target else target_logits).reshape(target_rows, n_cols)
        t, k = _arg(temperature, float, positions), _arg(top_k, lambda v: min(int(v), n_cols), positions)
        p, mp = _arg(top_p, float, positions), _arg(min_p, float, positions)
        k_scalar = not per_row["top_k"]
        greedy = (not per_row["temperature"] and temperature == 0) or (k_scalar and top_k == 1)
        filtered = not greedy and (per_row["top_k"] or per_row["top_p"] or per_row["min_p"]
                                   or 0 < top_k < n_cols or top_p < 1 or min_p > 0)
        flags = dict(T_TENSOR=per_row["temperature"], K_TENSOR=per_row["top_k"], P_TENSOR=per_row["top_p"],
                     MP_TENSOR=per_row["min_p"], IS_F64=self.is_f64, CH=self.chunk, NG=self.groups)
        grid = (target_rows, self.n_chunks)
        cb = triton.next_power_of_2(self.n_chunks)
        rs, cs = x.stride()
        stats_merge(grid, (scratch["greedy"], ws, x, rs, cs, *t, *k, *p, *mp, 0.0, 0, target_rows, n_cols),
                    dict(flags, RV_MODE=False, RV_TENSOR=False, CB=cb, SELECT_BLOCK=self.select_block,
                         WITH_SOFTMAX=not greedy, WITH_GROUPS=filtered,
                         WITH_ARGMAX=greedy or per_row["temperature"] or per_row["top_k"]), self.warps, dev)
        if filtered:
            gather(grid, (ws, x, rs, cs, *t, *mp, 0, 0, 0, 0, 0, 0, target_rows, n_cols),
                   dict(T_TENSOR=per_row["temperature"], MP_TENSOR=per_row["min_p"], SEED_TENSOR=False,
                        STEP_TENSOR=False, IS_F64=self.is_f64, CH=self.chunk, NG=self.groups, GATHER=True,
                        WITH_PASS1=False), 8, dev)
            thresholds((target_rows,), (scratch["kept_key"], scratch["kept_mass"], ws, x, rs, cs, *t, *k, *p, *mp,
                                        target_rows, n_cols),
                       dict(flags, TOP_K_FIRST=self.filter_order == "top_k_first", BLOCK=self.block,
                            SELECT_BLOCK=self.select_block), self.finish_warps, dev)
        d_ws, d_greedy, dt = ws, scratch["greedy"], (1.0, 0)
        if self.from_logits:
            d_ws, d_greedy = scratch["draft"], scratch["draft_greedy"]
            dt = _arg(draft_temperature, float, n_draft)
            # Also for greedy calls, which do not read q: a draft row's validity does not depend on the mode.
            y = (draft.contiguous() if self.copy_draft else draft).reshape(n_rows * n_draft, n_cols)
            stats_merge(
                (n_rows * n_draft, self.n_chunks),
                (d_greedy, d_ws, y, *y.stride(), *dt, 0, 0, 1.0, 0, 0.0, 0, 0.0, 0, n_rows * n_draft, n_cols),
                dict(T_TENSOR=per_row["draft_temperature"], K_TENSOR=False, P_TENSOR=False, MP_TENSOR=False,
                     RV_MODE=False, RV_TENSOR=False, IS_F64=self.draft_f64, CH=self.chunk, NG=self.groups,
                     CB=cb, SELECT_BLOCK=self.select_block, WITH_SOFTMAX=True, WITH_GROUPS=False,
                     WITH_ARGMAX=per_row["draft_temperature"] or draft_temperature == 0), self.warps, dev)
        seeds = (*u64_arg(seed), *u64_arg(step))
        draw((n_rows, self.n_chunks),
             (tokens, accepted, valid, scratch["race"], ws, scratch["greedy"], scratch["kept_key"],
              scratch["kept_mass"], draft_token_ids, *draft_token_ids.stride(), target_logits,
              *target_logits.stride(), draft, *draft.stride(), d_ws, d_greedy, *dt, *t, *mp, *seeds, n_rows,
              n_draft, n_cols),
             dict(T_TENSOR=per_row["temperature"], MP_TENSOR=per_row["min_p"],
                  DT_TENSOR=per_row["draft_temperature"], SEED_TENSOR=per_row["seed"], STEP_TENSOR=per_row["step"],
                  IS_F64=self.is_f64, DRAFT_F64=self.draft_f64, FROM_LOGITS=self.from_logits, FILTERED=filtered,
                  CH=self.chunk, NG=self.groups, NB=triton.next_power_of_2(n_draft + 1), CB=cb), self.warps, dev)
        return out

    def _reference(self, draft_token_ids, target_logits, draft, draft_temperature, temperature, top_k, top_p, min_p,
                   seed, step) -> VerifyResult:
        device = target_logits.device

        def full(value, dtype):
            if isinstance(value, torch.Tensor):
                return value
            return torch.full((self.n_rows,), value, dtype=dtype, device=device)

        seed = seed if isinstance(seed, torch.Tensor) else as_int64(seed)
        draft_valid = None
        if self.from_logits:
            draft, draft_valid = reference.draft_probs_of(draft, full(draft_temperature, torch.float32))
        tokens, accepted, valid = reference.verify(
            draft_token_ids, draft, target_logits, full(temperature, torch.float32), full(top_k, torch.int64),
            full(top_p, torch.float32), full(min_p, torch.float32), full(seed, torch.int64), full(step, torch.int64),
            filter_order=self.filter_order, draft_valid=draft_valid)
        return VerifyResult(tokens, accepted, valid)


def _arg(value, convert, repeats: int) -> tuple:
    """A per-row parameter as kernel arguments for rows repeated ``repeats`` times: (that tensor,
    its stride) or (scalar, 0)."""
    if isinstance(value, torch.Tensor):
        return value.repeat_interleave(repeats), 1
    return convert(value), 0


_cached_plan = plan_cache(VerifyPlan)


def verify(draft_token_ids: torch.Tensor, target_logits: torch.Tensor, *, draft_probs: torch.Tensor | None = None,
           draft_logits: torch.Tensor | None = None, draft_temperature=1.0, temperature=1.0, top_k=0, top_p=1.0,
           min_p=0.0, seed=None, step=0, filter_order: str = "top_k_first", backend: str = "auto") -> VerifyResult:
    """Chain speculative sampling: which draft tokens the target model accepts, and the next token.

    Parameters
    ----------
    draft_token_ids : torch.Tensor
        ``(batch_size, n)`` int32 or int64, ``n >= 1``: the draft model's tokens.
    target_logits : torch.Tensor
        ``(batch_size, n + 1, vocab_size)`` float16 / bfloat16 / float32 / float64: the target
        model's logits at each draft position and after the last.
    draft_probs, draft_logits : torch.Tensor
        Exactly one, ``(batch_size, n, vocab_size)``, any float dtype: the draft model's
        distribution at each position, as probabilities (taken as given: nonnegative, summing to 1)
        or as logits with ``draft_temperature`` (scalar or ``(batch_size,)``; its rule is the
        temperature's, 0 meaning the draft drew its arg-max).
    temperature, top_k, top_p, min_p, seed, step, filter_order
        The target's sampling, per row, exactly as :func:`logitserve.kernels.sample` takes them.

    Position ``i`` accepts ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``, ``p_i`` the
    target's filtered distribution and ``q_i`` the draft's; at the first rejection the next token
    is drawn from ``max(0, p_i - q_i)`` (normalised), after ``n`` acceptances from ``p_n``. The
    emitted tokens are then distributed as ``sample`` would draw them from the target, token by
    token. Greedy rows (``temperature == 0`` or ``top_k == 1``) accept while ``d_i`` is the
    target's arg-max (lowest index on ties) and emit the arg-max. Seeded and batch invariant as
    ``sample``: a row's answer is a function of its own inputs and ``(seed, step)``.

    Returns
    -------
    VerifyResult
        ``token_ids (batch_size, n + 1)`` int64 (accepted prefix, the emitted token, then -1),
        ``num_accepted (batch_size,)`` int64, ``valid (batch_size,)`` bool. A row is invalid (every
        token -1, 0 accepted) when a target position has a NaN or no finite logit, a draft id lies
        outside ``[0, vocab_size)`` (CUDA tensors; on the CPU it raises), a draft logits position
        has a NaN or no finite value, or (per-row CUDA tensors) a parameter breaks its rule.

    Examples
    --------
    >>> target = torch.tensor([[[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
    >>> verify(torch.tensor([[1, 2]]), target, draft_probs=torch.full((1, 2, 3), 1 / 3),
    ...        temperature=0.0).token_ids.tolist()
    [[1, 0, -1]]
    """
    for name, value in (("draft_token_ids", draft_token_ids), ("target_logits", target_logits)):
        check_tensor(name, value)
    if (draft_probs is None) == (draft_logits is None):
        raise ValueError("draft_probs / draft_logits: give exactly one")
    from_logits = draft_logits is not None
    draft = draft_logits if from_logits else draft_probs
    if not from_logits and (isinstance(draft_temperature, torch.Tensor) or draft_temperature != 1.0):
        raise ValueError("draft_temperature: applies only with draft_logits")
    check_tensor("draft_logits" if from_logits else "draft_probs", draft)
    if seed is None:
        seed = secrets.randbits(SEED_BITS)
    n_rows = draft_token_ids.shape[0] if draft_token_ids.ndim else 0
    for param, value in ((TEMPERATURE, temperature), (TOP_K, top_k), (TOP_P, top_p), (MIN_P, min_p),
                         (DRAFT_TEMPERATURE, draft_temperature)):
        _check_param(param, value, n_rows)
    _check_counter(SEED.name, seed, SEED_RANGE)
    _check_counter(STEP.name, step, STEP_RANGE)

    def spec(value):
        return TensorSpec.of(value) if isinstance(value, torch.Tensor) else None

    plan = _cached_plan(TensorSpec.of(draft_token_ids), TensorSpec.of(target_logits), TensorSpec.of(draft),
                        from_logits=from_logits, draft_temperature=spec(draft_temperature) if from_logits else None,
                        temperature=spec(temperature), top_k=spec(top_k), top_p=spec(top_p), min_p=spec(min_p),
                        seed=spec(seed), step=spec(step), filter_order=filter_order, backend=backend)
    if draft_token_ids.device.type == "cpu":
        vocab = plan.n_cols
        bad = ((draft_token_ids < 0) | (draft_token_ids >= vocab)).nonzero()
        if bad.numel():
            row, col = bad[0].tolist()
            raise ValueError(f"draft_token_ids[{row}, {col}]: must be in [0, V) with V = {vocab} (target_logits' "
                             f"vocabulary), got {draft_token_ids[row, col].item()}")
    return plan(draft_token_ids, target_logits, draft, draft_temperature=draft_temperature, temperature=temperature,
                top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step)
