"""MoE routers of current models: softmax or sigmoid scores, a selection-only correction bias,
grouped top-k (DeepSeek-V2 / V3), renormalization and a routed scaling factor.

One kernel, one launch, beside :mod:`.topk_softmax` (which runs the default options unchanged).
A program owns ``ROWS`` tokens as a ``[ROWS, GROUPS, BLOCK_G]`` tile in registers (``BLOCK_G``
the group size rounded up to a power of two; one group without grouping): position
``p = g * BLOCK_G + j`` is expert ``g * GROUP_SIZE + j``, so position order is expert order, and
group statistics reduce axis 2 with no layout conversion. The selection key (the biased score,
or the logit without a bias) is a float32 whose bits are made order-preserving. Groups are
ranked on int64 keys (those bits above the reversed group index); ``k <= 16`` experts by ``k``
rounds on int32 keys (the largest key, then the lowest position holding it: two one-instruction
warp reductions); larger ``k`` by :mod:`.topk_softmax`'s bitonic network on int64 keys (bits
above ``BLOCK_E - 1 - p``). Ties go to the lower expert and the lower group everywhere.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._backend import launchable, resolve_backend
from ._plan import TensorSpec, check_same_device, check_tensor, plan_cache
from .reference import route_experts as reference
from .topk_softmax import (TopkSoftmaxPlan, _bitonic_topk, check_gate_logits, num_warps_for, rows_per_program,
                           use_sort)

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
# The widest padded tile a program holds (int64 keys); groups' padding can double 4096 experts.
MAX_BLOCK = 8192
KEY_MARK = -(2 ** 63)  # below every int64 key: chosen and padding groups


@triton.jit
def _ordered(v):
    # float32 -> int32 whose order is the floats' (-0.0 == +0.0).
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _row_max(v):
    return tl.max(tl.max(v, axis=2), axis=1)


@triton.jit
def _row_min(v):
    return tl.min(tl.min(v, axis=2), axis=1)


@triton.jit
def _row_sum(v):
    return tl.sum(tl.sum(v, axis=2), axis=1)


@launchable
@triton.jit
def _route_experts_kernel(
    weights_ptr, indices_ptr, x_ptr, bias_ptr,
    out_row_stride, x_row_stride, x_col_stride, bias_stride,
    n_rows, scale,
    MARK: tl.constexpr, MARK32: tl.constexpr, K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, TOP2: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_SORT: tl.constexpr, LOG_ROWS: tl.constexpr,
    LOG_E: tl.constexpr, LOG_K: tl.constexpr,
):
    # The tile is [ROWS, GROUPS, BLOCK_G] throughout (GROUPS = 1 without groups): group
    # statistics reduce axis 2 and come back by broadcasting, with no layout conversion.
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    r3 = rows[:, None, None]
    g = tl.arange(0, GROUPS)[None, :, None]
    j = tl.arange(0, BLOCK_G)[None, None, :]
    p = g * BLOCK_G + j
    expert = g * GROUP_SIZE + j
    valid = (j < GROUP_SIZE) & (g < N_GROUP)
    x_row = x_ptr + r3 * x_row_stride
    x = tl.load(x_row + expert.to(tl.int64) * x_col_stride, mask=(r3 < n_rows) & valid,
                other=-float("inf")).to(tl.float32)

    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
        row_ok = _row_sum((x != x).to(tl.int32)) == 0
    else:
        # As topk_softmax: padding loads -inf (exp 0); total is NaN exactly for a NaN, a +inf
        # or no finite logit.
        row_max = _row_max(x)
        e = tl.exp(x - row_max[:, None, None])
        total = _row_sum(e)
        score = e * (1.0 / total)[:, None, None]
        row_ok = total == total
    if HAS_BIAS:
        b = tl.load(bias_ptr + expert * bias_stride, mask=valid, other=0.0)
        biased = score + b
        row_ok = row_ok & (_row_sum((biased != biased).to(tl.int32)) == 0)
        ranked = biased
    else:
        biased = score
        ranked = x  # logit order is the exact scores' order

    keep = valid
    if GROUPED:
        c = tl.where(valid, biased, -float("inf"))
        best = tl.max(c, axis=2)
        if TOP2:
            at_best = c == best[:, :, None]
            second = tl.max(tl.where(at_best, -float("inf"), c), axis=2)
            second = tl.where(tl.sum(at_best.to(tl.int32), axis=2) > 1, best, second)
            gscore = best + second
        else:
            gscore = best
        row_ok = row_ok & (tl.sum((gscore != gscore).to(tl.int32), axis=1) == 0)
        g2 = tl.arange(0, GROUPS)[None, :]
        glow = (GROUPS - 1 - g2).to(tl.int64)
        gkey = (_ordered(gscore).to(tl.int64) << 32) | glow
        gkey = tl.where(row_ok[:, None], gkey, glow)
        gkey = tl.where(g2 < N_GROUP, gkey, MARK)
        # TOPK_GROUP rounds of max-and-remove over the groups.
        gkeep = tl.zeros([ROWS, GROUPS], dtype=tl.int32)
        for r in tl.static_range(TOPK_GROUP):
            top = tl.max(gkey, axis=1)
            hit = gkey == top[:, None]
            gkeep = tl.where(hit, 1, gkeep)
            gkey = tl.where(hit, MARK, gkey)
        keep = keep & (gkeep[:, :, None] != 0)

    # Selection keys: the float32 key's bits made order-preserving. Rows with a NaN tie every
    # expert (0); dropped and padding experts sit below every real key (-inf's is
    # -2**31 + 0x7FFFFF) and above the marks of the chosen.
    ordered = tl.where(row_ok[:, None, None], _ordered(ranked), 0)
    ordered = tl.where(keep, ordered, MARK32 + 0x10000)
    if USE_SORT:
        # int64 keys, the reversed position in the low half: distinct, ties to the lower expert.
        key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - p).to(tl.int64)
        top = _bitonic_topk(tl.reshape(key, [ROWS, BLOCK_E]), ROWS, BLOCK_K, LOG_ROWS, LOG_E, LOG_K)
        kcols = tl.arange(0, BLOCK_K)
        chosen = (kcols < K)[None, :]
        pos = BLOCK_E - 1 - top.to(tl.int32)  # truncation keeps the low half
        indices = (pos // BLOCK_G) * GROUP_SIZE + pos % BLOCK_G
        # The key holds the biased score: reload the chosen logits for the weights.
        row_mask = (rows < n_rows)[:, None]
        xs = tl.load(x_ptr + rows[:, None] * x_row_stride + indices.to(tl.int64) * x_col_stride,
                     mask=row_mask & chosen, other=0.0).to(tl.float32)
        if SIGMOID:
            w = 1.0 / (1.0 + tl.exp(-xs))
        else:
            w = tl.exp(xs - row_max[:, None]) * (1.0 / total)[:, None]
        if RENORMALIZE:
            w = w * (1.0 / tl.sum(tl.where(chosen, w, 0.0), axis=1))[:, None]
        w = tl.where(row_ok[:, None], w * scale, float("nan"))
        out = (rows * out_row_stride)[:, None] + kcols[None, :]
        tl.store(weights_ptr + out, w, mask=row_mask & chosen)
        tl.store(indices_ptr + out, indices, mask=row_mask & chosen)
    else:
        # K rounds of max-and-remove on int32 keys (a warp reduces one in a single instruction):
        # the largest key, then the lowest position holding it; the chosen key becomes
        # MARK32 + round, so each expert then knows its output position and stores itself.
        key = ordered
        mark = tl.full([1, 1, 1], MARK32, tl.int32)
        for r in tl.static_range(K):
            best_key = _row_max(key)
            first = _row_min(tl.where(key == best_key[:, None, None], p, BLOCK_E))
            key = tl.where(p == first[:, None, None], mark, key)
            mark += 1
        chosen = key < MARK32 + K
        w = score
        if RENORMALIZE:
            w = w * (1.0 / _row_sum(tl.where(chosen, w, 0.0)))[:, None, None]
        w = tl.where(row_ok[:, None, None], w * scale, float("nan"))
        out = r3 * out_row_stride + (key ^ MARK32)
        out_mask = (r3 < n_rows) & chosen
        tl.store(weights_ptr + out, w, mask=out_mask)
        tl.store(indices_ptr + out, expert, mask=out_mask)


def _check_options(k, scoring, n_group, topk_group, group_score, renormalize, routed_scaling_factor) -> None:
    # Types are checked before the plan cache, whose keys cannot tell 2.0 from 2 or 1 from True.
    for name, value in (("k", k), ("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: must be an int, got {type(value).__name__}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: must be a bool, got {type(renormalize).__name__}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor: must be a float, got {type(routed_scaling_factor).__name__}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: must be one of {SCORINGS}, got {scoring!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score: must be one of {GROUP_SCORES}, got {group_score!r}")


class RouteExpertsPlan:
    """Route tokens to experts with the routers of current models: ``(weights, indices)``.

    Parameters
    ----------
    gate_logits : TensorSpec
        ``(num_tokens, E)``, float16, bfloat16 or float32, any strides; ``1 <= E <= 4096``.
    k : int
        Experts per token, ``1 <= k <= topk_group * E / n_group``.
    scoring : str
        ``"softmax"`` over the row, or ``"sigmoid"`` of each logit.
    correction_bias : TensorSpec or None
        float32 ``(E,)``, on the logits' device: added to the scores for selection (and group
        scores) only; the weights come from the unbiased scores.
    n_group, topk_group : int
        ``n_group`` divides E into consecutive groups; the ``topk_group`` best groups stay
        (``1 <= topk_group <= n_group``).
    group_score : str
        A group's score: the sum of its two best biased scores (``"top2_sum"``, DeepSeek-V3;
        needs ``E / n_group >= 2``) or its best (``"max"``, DeepSeek-V2).
    renormalize : bool
        Divide the ``k`` weights of a row by their sum (before scaling).
    routed_scaling_factor : float
        Multiplies the weights; finite and > 0.

    Experts rank by biased score, or without a bias by logit (the exact scores' order); equal
    keys go to the lower expert, equal group scores to the lower group. Outputs are in that
    order. Llama 4's router (top-1, sigmoid of the chosen logit) is ``scoring="sigmoid", k=1``.
    With softmax scoring and no bias, groups or scaling, this is :class:`TopkSoftmaxPlan`. NaN
    rows: see :func:`logitserve.kernels.reference.route_experts.route_experts`.
    """

    def __init__(self, gate_logits: TensorSpec, k: int, *, scoring: str = "softmax",
                 correction_bias: TensorSpec | None = None, n_group: int = 1, topk_group: int = 1,
                 group_score: str = "top2_sum", renormalize: bool = False, routed_scaling_factor: float = 1.0,
                 backend: str = "auto"):
        n_rows, n_experts = check_gate_logits(gate_logits)
        _check_options(k, scoring, n_group, topk_group, group_score, renormalize, routed_scaling_factor)
        check_group_options(n_experts, k, n_group, topk_group, group_score, routed_scaling_factor)
        if correction_bias is not None:
            if correction_bias.dtype != torch.float32:
                raise ValueError(f"correction_bias: dtype must be float32, got "
                                 f"{str(correction_bias.dtype).removeprefix('torch.')}")
            if correction_bias.shape != (n_experts,):
                raise ValueError(f"correction_bias: shape must be (E,) = ({n_experts},), got {correction_bias.shape}")
            check_same_device("correction_bias", correction_bias, gate_logits.device)
        self.gate_logits, self.k, self.correction_bias = gate_logits, k, correction_bias
        self.options = dict(scoring=scoring, n_group=n_group, topk_group=topk_group, group_score=group_score,
                            renormalize=renormalize, routed_scaling_factor=float(routed_scaling_factor))
        self.backend = resolve_backend(backend, gate_logits.device)
        self.n_rows = n_rows
        self.workspace_size = 0
        self.kernel = self.inner = None
        if scoring == "softmax" and correction_bias is None and self.grouped_out(n_group, topk_group) \
                and routed_scaling_factor == 1.0:
            self.inner = TopkSoftmaxPlan(gate_logits, k, renormalize=renormalize, backend=backend)
            return
        if self.backend == "torch":
            return
        grouped = not self.grouped_out(n_group, topk_group)
        group_size = n_experts // n_group if grouped else n_experts
        groups = triton.next_power_of_2(n_group) if grouped else 1
        block_g = max(2 if groups == 1 else 1, triton.next_power_of_2(group_size))
        block_e = groups * block_g
        if block_e > MAX_BLOCK:
            raise ValueError(f"n_group: E = {n_experts} in {n_group} groups pads to {block_e} > {MAX_BLOCK} "
                             "positions a row; use a power-of-two group count or size")
        self.rows = rows_per_program(n_rows, block_e)
        self.num_warps = num_warps_for(self.rows, block_e)
        block_k = max(2, triton.next_power_of_2(k))
        self.meta = dict(MARK=KEY_MARK, MARK32=-(2 ** 31), K=k, SIGMOID=scoring == "sigmoid",
                         HAS_BIAS=correction_bias is not None,
                         N_GROUP=n_group if grouped else 1, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
                         GROUPED=grouped, TOP2=group_score == "top2_sum", RENORMALIZE=renormalize, ROWS=self.rows,
                         GROUPS=groups, BLOCK_G=block_g, BLOCK_E=block_e, BLOCK_K=block_k, USE_SORT=use_sort(k),
                         LOG_ROWS=self.rows.bit_length() - 1, LOG_E=block_e.bit_length() - 1,
                         LOG_K=block_k.bit_length() - 1)
        self.grid = (triton.cdiv(n_rows, self.rows),)
        bias_stride = correction_bias.strides[0] if correction_bias is not None else 0
        self.args = (k, gate_logits.strides[0], gate_logits.strides[1], bias_stride, n_rows,
                     float(routed_scaling_factor))
        self.kernel = _route_experts_kernel.for_backend(self.backend)

    @staticmethod
    def grouped_out(n_group: int, topk_group: int) -> bool:
        # Keeping every group is no grouping at all.
        return n_group == 1 or topk_group == n_group

    def __call__(self, gate_logits: torch.Tensor, correction_bias: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None, indices: torch.Tensor | None = None):
        """Launch; ``correction_bias`` iff the plan has one; ``weights`` / ``indices``, when given,
        contiguous ``(num_tokens, k)`` float32 / int32."""
        if (correction_bias is None) != (self.correction_bias is None):
            raise ValueError("correction_bias: pass it exactly when the plan was made with one")
        if self.inner is not None:
            return self.inner(gate_logits, weights, indices)
        if self.kernel is None:
            w, i = reference.route_experts(gate_logits, self.k, correction_bias=correction_bias, **self.options)
            return (w if weights is None else weights.copy_(w), i if indices is None else indices.copy_(i))
        device = gate_logits.device
        if weights is None:
            weights = torch.empty((self.n_rows, self.k), dtype=torch.float32, device=device)
        if indices is None:
            indices = torch.empty((self.n_rows, self.k), dtype=torch.int32, device=device)
        if self.n_rows:
            bias = correction_bias if correction_bias is not None else gate_logits
            self.kernel[self.grid](weights, indices, gate_logits, bias, *self.args,
                                   num_warps=self.num_warps, **self.meta)
        return weights, indices


def check_group_options(n_experts: int, k: int, n_group: int, topk_group: int, group_score: str,
                        routed_scaling_factor: float, path: str = "") -> None:
    """The rules between E, k and the group options (the server checks its requests with them)."""
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"{path}n_group: must be >= 1 and divide E = {n_experts}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{path}topk_group: must satisfy 1 <= topk_group <= n_group ({n_group}), got {topk_group}")
    allowed = topk_group * (n_experts // n_group)
    if not 1 <= k <= allowed:
        raise ValueError(f"{path}k: must satisfy 1 <= k <= topk_group * E / n_group = {allowed} "
                         f"(E = {n_experts}), got {k}")
    if n_group > 1 and group_score == "top2_sum" and n_experts // n_group < 2:
        raise ValueError(f"{path}group_score: 'top2_sum' needs >= 2 experts a group, got E / n_group = "
                         f"{n_experts // n_group}")
    if not (math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise ValueError(f"{path}routed_scaling_factor: must be finite and > 0, got {routed_scaling_factor}")


_cached_plan = plan_cache(RouteExpertsPlan)


def route_experts(gate_logits: torch.Tensor, k: int, *, scoring: str = "softmax",
                  correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                  group_score: str = "top2_sum", renormalize: bool = False, routed_scaling_factor: float = 1.0,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` experts of each token under a model's router: ``(weights f32, indices int32)``, ``(N, k)``.

    See :class:`RouteExpertsPlan` for the options and the full contract.

    Example (DeepSeek-V3's router)
    ------------------------------
    >>> g, bias = torch.randn(4, 256), torch.zeros(256)
    >>> w, i = route_experts(g, 8, scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=4,
    ...                      renormalize=True, routed_scaling_factor=2.5)
    >>> tuple(w.shape), round(w.sum(-1)[0].item(), 4)
    ((4, 8), 2.5)
    """
    check_tensor("gate_logits", gate_logits)
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias)
    _check_options(k, scoring, n_group, topk_group, group_score, renormalize, routed_scaling_factor)
    bias_spec = None if correction_bias is None else TensorSpec.of(correction_bias)
    plan = _cached_plan(TensorSpec.of(gate_logits), k, scoring=scoring, correction_bias=bias_spec, n_group=n_group,
                        topk_group=topk_group, group_score=group_score, renormalize=renormalize,
                        routed_scaling_factor=float(routed_scaling_factor), backend=backend)
    return plan(gate_logits, correction_bias)
