"""MoE routers of current models: softmax or sigmoid scores, a selection-only correction bias,
grouped top-k (DeepSeek-V2 / V3), renormalization and a routed scaling factor.

One kernel, one launch, beside :mod:`.topk_softmax` (which runs the default options unchanged).
A program owns ``ROWS`` tokens as a ``[ROWS, BLOCK_E]`` tile in registers; position
``p = g * BLOCK_G + j`` holds expert ``g * GROUP_SIZE + j`` (``BLOCK_G`` the group size rounded
up to a power of two), so position order is expert order and group statistics are a reshape to
``[ROWS, GROUPS, BLOCK_G]`` away. Groups score in one NaN-propagating pass (the top two, or the
top one); groups and then experts are taken on int32 keys by :mod:`.router_select`'s rounds,
exact or packed (:data:`VARIANTS`); ``k > 16`` experts by :mod:`.topk_softmax`'s bitonic
network on int64 keys. Ties go to the lower expert and the lower group everywhere. The picks
come out as ``[ROWS, BLOCK_K]`` indices, and the weights from their reloaded logits, so the
stores are ``k`` values a row rather than a masked store of the whole tile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._backend import launchable, resolve_backend
from ._plan import TensorSpec, check_same_device, check_tensor, plan_cache
from .reference import route_experts as reference
from .router_select import DROP, MARK, exact_rounds, group_scores, has_nan, index_bits, ordered_bits, packed_rounds
from .topk_softmax import (TopkSoftmaxPlan, _bitonic_topk, check_gate_logits, num_warps_for, rows_per_program,
                           use_sort)

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")
# The widest padded tile a program holds (int64 keys); groups' padding can double 4096 experts.
MAX_BLOCK = 8192


class RouterVariant(NamedTuple):
    """How a plan's kernel selects (for ``k <= 16``; beyond, the bitonic network) and its tile.

    ``select``: ``"exact"`` (two reductions a round) or ``"packed"`` (one, plus an exact redo of
    the programs with a row it cannot vouch for). ``rows`` and ``warps`` multiply
    :func:`rows_per_program` and :func:`num_warps_for`.
    """

    select: str
    rows: int = 1
    warps: int = 1


SELECTS = ("exact", "packed")
VARIANTS = {
    "exact": RouterVariant("exact"),
    "packed": RouterVariant("packed"),
    "packed rows x2": RouterVariant("packed", rows=2),             # two rows a warp: twice the ILP
    "packed warps x4": RouterVariant("packed", rows=4, warps=4),   # four-warp programs, a row a warp
}
# The variants plans use unless told otherwise (every variant gives the same result; only the
# time differs): the fastest of `python -m bench.router_variants` on the H100, 2026-11-26.
# `packed`: DeepSeek-V3 15.8 us, Kimi-K2 25.5 and grouped 27.8, against `exact`'s 19.0, 32.7,
# 35.4. Top-1 routers, `packed warps x4`: Llama 4 with 128 experts 3.4 us against 6.2, with 16
# experts 1.7 against 1.8.
DEFAULT_VARIANT = "packed"
TOP1_VARIANT = "packed warps x4"


def default_variant(k: int) -> str:
    """The variant a plan of ``k`` experts a row uses unless told otherwise."""
    return TOP1_VARIANT if k == 1 else DEFAULT_VARIANT


@triton.jit
def _broadcast_groups(kept, ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    # [ROWS, GROUPS] -> [ROWS, GROUPS * BLOCK_G]: each position takes its group's value.
    return tl.reshape(tl.broadcast_to(kept[:, :, None], [ROWS, GROUPS, BLOCK_G]), [ROWS, GROUPS * BLOCK_G])


@triton.jit
def _exact_keys(ordered, gord, bad, keep, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                GROUPED: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_TG: tl.constexpr):
    # The experts' keys, DROP outside the TOPK_GROUP best groups (chosen by exact rounds); NaN
    # rows tie every group and expert (so the lowest win).
    if GROUPED:
        g = tl.arange(0, GROUPS)[None, :]
        gkey = tl.where(g < N_GROUP, tl.where(bad[:, None], 0, gord), DROP)
        _, gkey = exact_rounds(gkey, g, TOPK_GROUP, BLOCK_TG, GROUPS)
        keep = keep & _broadcast_groups(gkey == MARK, ROWS, GROUPS, BLOCK_G)
    return tl.where(keep, tl.where(bad[:, None], 0, ordered), DROP)


@triton.jit
def _exact_picks(ordered, gord, bad, expert, keep, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 GROUPED: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_TG: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    # The semantics step by step: the group selection, then the K best keys by exact rounds.
    key = _exact_keys(ordered, gord, bad, keep, N_GROUP, TOPK_GROUP, GROUPED, ROWS, GROUPS, BLOCK_G, BLOCK_TG)
    picks, _ = exact_rounds(key, expert, K, BLOCK_K, BLOCK_E * 2)
    return picks


@launchable
@triton.jit
def _route_experts_kernel(
    weights_ptr, indices_ptr, x_ptr, bias_ptr,
    out_row_stride, x_row_stride, x_col_stride, bias_stride,
    n_rows, scale,
    K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, TOP2: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TG: tl.constexpr,
    SELECT: tl.constexpr, PACK_EXACT: tl.constexpr, IDX_BITS: tl.constexpr, GROUP_BITS: tl.constexpr,
    LOG_ROWS: tl.constexpr, LOG_E: tl.constexpr, LOG_K: tl.constexpr,
):
    # The tile is [ROWS, BLOCK_E], position p = g * BLOCK_G + j holding expert
    # g * GROUP_SIZE + j (the identity when EVEN); group statistics view it as
    # [ROWS, GROUPS, BLOCK_G], a reshape that moves no data.
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_in = rows < n_rows
    p = tl.arange(0, BLOCK_E)[None, :]
    if EVEN:
        expert = p
        keep = p < BLOCK_E
        mask = row_in[:, None]
    else:
        expert = (p // BLOCK_G) * GROUP_SIZE + p % BLOCK_G
        keep = (p % BLOCK_G < GROUP_SIZE) & (p // BLOCK_G < N_GROUP)
        mask = row_in[:, None] & keep
    x_row = x_ptr + rows[:, None] * x_row_stride
    x = tl.load(x_row + expert.to(tl.int64) * x_col_stride, mask=mask, other=-float("inf")).to(tl.float32)

    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
    else:
        # As topk_softmax: padding loads -inf (exp 0); total is NaN exactly for a NaN, a +inf
        # or no finite logit.
        row_max = tl.max(x, axis=1)
        e = tl.exp(x - row_max[:, None])
        total = tl.sum(e, axis=1)
        score = e * (1.0 / total)[:, None]
    if HAS_BIAS:
        # Loaded as a [ROWS, BLOCK_E] tile (each row its own copy, from L1): a [1, BLOCK_E] load
        # makes Triton lay the whole tile out to suit it, one row over all the warps.
        b = tl.load(tl.broadcast_to(bias_ptr + expert * bias_stride, [ROWS, BLOCK_E]), mask=keep, other=0.0)
        biased = score + b
        ranked = biased
    else:
        biased = score
        ranked = x  # logit order is the exact scores' order

    # NaN rows: a NaN score, biased score or group score. Group scores propagate NaN, so with
    # groups they alone tell; sigmoid scores are NaN exactly where the logits are.
    gord = 0
    if GROUPED:
        c = tl.where(keep, biased, -float("inf"))
        gscore = group_scores(tl.reshape(c, [ROWS, GROUPS, BLOCK_G]), TOP2)
        bad = tl.max((gscore != gscore).to(tl.int32), axis=1) > 0
        gord = ordered_bits(gscore)
    elif HAS_BIAS:
        bad = has_nan(biased)
    elif SIGMOID:
        bad = has_nan(x)
    else:
        bad = total != total
    ordered = ordered_bits(ranked)

    if SELECT == 1:
        # Packed keys, one reduction a round. Rows the check cannot vouch for (near-ties in the
        # dropped bits, exact ties, NaN rows) are redone exactly, the whole program at once.
        exact = bad == 0
        fast_keep = keep  # the redo starts again from keep, not from these groups
        if GROUPED:
            g = tl.arange(0, GROUPS)[None, :]
            gkey = tl.where(g < N_GROUP, (gord & -(1 << GROUP_BITS)) | (GROUPS - 1 - g), DROP)
            _, gkey, gexact = packed_rounds(gkey, TOPK_GROUP, BLOCK_TG, GROUP_BITS, True)
            exact = exact & gexact
            fast_keep = keep & _broadcast_groups(gkey == MARK, ROWS, GROUPS, BLOCK_G)
        key = tl.where(fast_keep, (ordered & -(1 << IDX_BITS)) | ((1 << IDX_BITS) - 1 - expert), DROP)
        picks, _, kexact = packed_rounds(key, K, BLOCK_K, IDX_BITS, not PACK_EXACT)
        exact = exact & kexact
        if tl.max((row_in & (exact == 0)).to(tl.int32), axis=0) > 0:
            picks = _exact_picks(ordered, gord, bad, expert, keep, N_GROUP, TOPK_GROUP, GROUPED, ROWS, GROUPS,
                                 BLOCK_G, BLOCK_TG, K, BLOCK_K, BLOCK_E)
    elif SELECT == 0:
        picks = _exact_picks(ordered, gord, bad, expert, keep, N_GROUP, TOPK_GROUP, GROUPED, ROWS, GROUPS,
                             BLOCK_G, BLOCK_TG, K, BLOCK_K, BLOCK_E)
    else:
        # k > 16: topk_softmax's bitonic network on int64 keys (bits above the reversed
        # position: distinct, ties to the lower expert), after exact group selection.
        key = _exact_keys(ordered, gord, bad, keep, N_GROUP, TOPK_GROUP, GROUPED, ROWS, GROUPS, BLOCK_G, BLOCK_TG)
        key = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - p).to(tl.int64)
        top = _bitonic_topk(key, ROWS, BLOCK_K, LOG_ROWS, LOG_E, LOG_K)
        pos = BLOCK_E - 1 - top.to(tl.int32)  # truncation keeps the low half
        picks = (pos // BLOCK_G) * GROUP_SIZE + pos % BLOCK_G

    # Weights from the chosen logits (reloaded: the keys hold biased scores), in pick order.
    kcols = tl.arange(0, BLOCK_K)[None, :]
    chosen = row_in[:, None] & (kcols < K)
    xs = tl.load(x_row + picks.to(tl.int64) * x_col_stride, mask=chosen, other=0.0).to(tl.float32)
    if SIGMOID:
        w = 1.0 / (1.0 + tl.exp(-xs))
    else:
        w = tl.exp(xs - row_max[:, None]) * (1.0 / total)[:, None]
    if RENORMALIZE:
        w = w * (1.0 / tl.sum(tl.where(chosen, w, 0.0), axis=1))[:, None]
    w = tl.where(bad[:, None], float("nan"), w * scale)
    out = (rows * out_row_stride)[:, None] + kcols
    tl.store(weights_ptr + out, w, mask=chosen)
    tl.store(indices_ptr + out, picks, mask=chosen)


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

    The options and the contract are :func:`route_experts`'s; here ``gate_logits`` and
    ``correction_bias`` are :class:`TensorSpec` layouts, checked once, and ``variant`` picks a kernel.
    """

    def __init__(self, gate_logits: TensorSpec, k: int, *, scoring: str = "softmax",
                 correction_bias: TensorSpec | None = None, n_group: int = 1, topk_group: int = 1,
                 group_score: str = "top2_sum", renormalize: bool = False, routed_scaling_factor: float = 1.0,
                 backend: str = "auto", variant: str | None = None):
        n_rows, n_experts = check_gate_logits(gate_logits)
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant: must be one of {sorted(VARIANTS)}, got {variant!r}")
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
        chosen = VARIANTS[default_variant(k) if variant is None else variant]
        self.rows = rows_per_program(n_rows, block_e) * chosen.rows
        self.num_warps = num_warps_for(self.rows // chosen.rows, block_e) * chosen.warps
        block_k = max(2, triton.next_power_of_2(k))
        # Packed keys lose nothing where the ranked value is a 16-bit logit: its float32 bits end
        # in 16 (bfloat16) or 13 (float16) bits that follow from the rest, room for the index.
        pack_exact = correction_bias is None and gate_logits.dtype != torch.float32
        self.meta = dict(K=k, SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
                         N_GROUP=n_group if grouped else 1, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
                         GROUPED=grouped, TOP2=group_score == "top2_sum", RENORMALIZE=renormalize, ROWS=self.rows,
                         GROUPS=groups, BLOCK_G=block_g, BLOCK_E=block_e,
                         EVEN=block_g == group_size and groups == (n_group if grouped else 1), BLOCK_K=block_k,
                         BLOCK_TG=max(2, triton.next_power_of_2(topk_group)),
                         SELECT=2 if use_sort(k) else SELECTS.index(chosen.select), PACK_EXACT=pack_exact,
                         IDX_BITS=index_bits(n_experts), GROUP_BITS=groups.bit_length() - 1,
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

    Parameters
    ----------
    gate_logits : torch.Tensor
        ``(num_tokens, E)``, float16, bfloat16 or float32, any strides; ``1 <= E <= 4096``.
    k : int
        Experts per token, ``1 <= k <= topk_group * E / n_group``.
    scoring : str
        ``"softmax"`` over the row, or ``"sigmoid"`` of each logit.
    correction_bias : torch.Tensor or None
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
    backend : str
        ``"auto"``, ``"triton"``, ``"interpret"`` or ``"torch"`` (see :mod:`logitserve.kernels`).

    Experts rank by biased score, or without a bias by logit (the exact scores' order); equal
    keys go to the lower expert, equal group scores to the lower group. Outputs are in that
    order. Llama 4's router (top-1, sigmoid of the chosen logit) is ``scoring="sigmoid", k=1``.
    With softmax scoring and no bias, groups or scaling, this is :class:`TopkSoftmaxPlan`. NaN
    rows: see :func:`logitserve.kernels.reference.route_experts.route_experts`.

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
