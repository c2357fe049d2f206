"""MoE routing: softmax over the experts of each token, then the k most probable experts.

One kernel, one launch. A program owns ``ROWS`` rows (tokens) as a ``[ROWS, BLOCK_E]`` tile held
in registers: load, softmax (max-subtracted, Triton tutorial 02-fused-softmax), then the top k.
Selection works on one integer key per expert: the logit's bits, made order-preserving, in the
high half and ``BLOCK_E - 1 - expert`` in the low half. Keys are distinct and "largest key"
means "largest logit (so largest probability), ties to the lower index". 16-bit logits give
int32 keys, float32 logits int64 ones. Small ``k`` takes ``k`` rounds of max-and-remove, each
chosen expert then storing itself at its round's position; larger ``k`` a bitonic top-k network.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import launchable, resolve_backend
from ._plan import TensorSpec, check_dtype, check_tensor, plan_cache
from .reference import topk_softmax as reference

# The widest expert axis: one program holds a whole row of keys in registers (4096 float32
# keys at 4 warps: 32 int64 keys, 64 registers, a thread); the float16 key keeps 13 index bits,
# so 8192 is a hard ceiling. Wider rows would need a loop over chunks.
MAX_EXPERTS = 4096
GATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOW_BITS = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 32}


@triton.jit
def _indicator(N_DIMS: tl.constexpr, J: tl.constexpr):
    # 0 or 1: the position along the J-th innermost axis of a [2] * N_DIMS hypercube.
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - J - 1) + [2] + [1] * J)


@triton.jit
def _compare_and_swap(h, flip, N_DIMS: tl.constexpr, J: tl.constexpr):
    # The partner across the J-th innermost axis is the pair's sum minus self (int64 wraps
    # exactly); tl.sort finds it with an xor reduction, which the interpreter runs element by
    # element: a sum keeps interpreted tests fast, compiled code is the same shuffle.
    partner = tl.sum(h, axis=N_DIMS - 1 - J, keep_dims=True) - h
    swap = (h > partner) != ((flip ^ _indicator(N_DIMS, J)) != 0)
    return tl.where(swap, partner, h)


@triton.jit
def _bitonic_merge(h, N_DIMS: tl.constexpr, STAGE: tl.constexpr, ORDER: tl.constexpr):
    # ORDER 1: descending; 2: alternating between neighbouring runs of 2**STAGE.
    if ORDER == 2:
        flip = _indicator(N_DIMS, STAGE)
    else:
        flip = ORDER
    for i in tl.static_range(STAGE):
        h = _compare_and_swap(h, flip, N_DIMS, STAGE - 1 - i)
    return h


@triton.jit
def _bitonic_topk(key, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LOG_ROWS: tl.constexpr, LOG_E: tl.constexpr,
                  LOG_K: tl.constexpr):
    # The 2**LOG_K largest keys of each row of key [ROWS, 2**LOG_E], descending: bitonic top-k
    # (Shanbhag, Pirk, Madden, SIGMOD 2018), as Triton's tl.topk builds it on a hypercube.
    h = tl.reshape(key, [2] * (LOG_ROWS + LOG_E))
    for i in tl.static_range(1, LOG_K + 1):
        h = _bitonic_merge(h, LOG_ROWS + LOG_E, i, 2 if i < LOG_E else 1)
    for i in tl.static_range(LOG_K + 1, LOG_E + 1):
        # Keep the larger of each pair of sorted runs of 2**LOG_K, then re-sort the survivors.
        h = tl.max(h, axis=LOG_ROWS + LOG_E - i)
        h = _bitonic_merge(h, LOG_ROWS + LOG_E - i + LOG_K, LOG_K, 2 if i < LOG_E else 1)
    return tl.reshape(h, [ROWS, BLOCK_K])


@launchable
@triton.jit
def _topk_softmax_kernel(
    weights_ptr, indices_ptr, x_ptr,
    out_row_stride, x_row_stride, x_col_stride,
    n_rows, n_experts,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    EVEN_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_SORT: tl.constexpr, LOW_BITS: tl.constexpr,
    MARK: tl.constexpr, LOG_ROWS: tl.constexpr, LOG_E: tl.constexpr, LOG_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_rows
    if EVEN_E:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (cols < n_experts)[None, :]
    x_offs = rows[:, None] * x_row_stride + cols.to(tl.int64)[None, :] * x_col_stride
    x = tl.load(x_ptr + x_offs, mask=mask, other=-float("inf")).to(tl.float32)

    # p = exp(x - max) / sum(exp(x - max)); padded columns load -inf and add exp(-inf) = 0.
    row_max = tl.max(x, axis=1)
    e = tl.exp(x - row_max[:, None])
    total = tl.sum(e, axis=1)
    # total is NaN exactly when the row has a NaN, a +inf (inf - inf) or no finite logit
    # (-inf - -inf): every expert of such a row ties, so indices 0..k-1 win, with NaN weights.
    row_ok = total == total

    # Key: the logit's float32 bits made order-preserving (negatives get their magnitude bits
    # flipped; + 0.0 first turns -0.0 into +0.0) above the reversed index: distinct keys,
    # largest = largest logit, ties to the lower index. A 16-bit logit uses only the top 16
    # (bfloat16) or 19 (float16) bits, so its key fits an int32; float32 logits need an int64.
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    low = BLOCK_E - 1 - cols
    if LOW_BITS == 32:
        key = (ordered.to(tl.int64) << 32) | low[None, :]
    else:
        key = (ordered & -(1 << LOW_BITS)) | low[None, :]
    key = tl.where(row_ok[:, None], key, low[None, :])
    if not EVEN_E:
        # Padding sits below every real key and above MARK + j, the mark of the j-th chosen.
        key = tl.where((cols < n_experts)[None, :], key, MARK + (1 << LOW_BITS) - 1)

    if USE_SORT:
        # Output position p holds the p-th largest key; decode expert and logit from it.
        top = _bitonic_topk(key, ROWS, BLOCK_K, LOG_ROWS, LOG_E, LOG_K)
        kcols = tl.arange(0, BLOCK_K)
        chosen = (kcols < K)[None, :]
        position = kcols[None, :]
        if LOW_BITS == 32:
            indices = BLOCK_E - 1 - top.to(tl.int32)  # truncation keeps the low half
            ordered = (top >> 32).to(tl.int32)
            bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        else:
            indices = BLOCK_E - 1 - (top & ((1 << LOW_BITS) - 1))
            ordered = top & -(1 << LOW_BITS)
            bits = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)) & -(1 << LOW_BITS)
        e_out = tl.exp(bits.to(tl.float32, bitcast=True) - row_max[:, None])
    else:
        # k rounds of max-and-remove: the chosen key becomes MARK + round, so afterwards every
        # expert knows its output position and stores itself; no data leaves the key tile.
        mark = tl.full([1, 1], MARK, key.dtype)
        for j in range(K):
            best = tl.max(key, axis=1)
            key = tl.where(key == best[:, None], mark, key)
            mark += 1
        chosen = key < MARK + K
        position = (key ^ MARK).to(tl.int32)
        e_out = e
        indices = cols[None, :]

    # weight = e / sum(e), or e / (sum of the k chosen e) with renormalize; NaN rows stay NaN.
    denom = total
    if RENORMALIZE:
        denom = tl.where(row_ok, tl.sum(tl.where(chosen, e_out, 0.0), axis=1), total)
    weights = e_out * (1.0 / denom)[:, None]
    out_mask = row_mask[:, None] & chosen
    row_offs = (rows * out_row_stride)[:, None]
    tl.store(weights_ptr + row_offs + position, weights, mask=out_mask)
    tl.store(indices_ptr + row_offs + position, indices, mask=out_mask)


def rows_per_program(n_rows: int, block_e: int) -> int:
    """Rows one program owns: a tile of at least 256 logits, fewer rows while that leaves under 256 programs.

    From an H100 sweep over experts, rows and warps: one row a program from 256 experts up, 2
    rows at 128 and 4 at 64 within 8% of the best tile. 256 programs is about two per SM (132
    SMs), below which splitting rows further shortens the critical path.
    """
    rows = max(1, 256 // block_e)
    while rows > 1 and triton.cdiv(n_rows, rows) < 256:
        rows //= 2
    return rows


def num_warps_for(rows: int, block_e: int) -> int:
    """Warps for a ``[rows, block_e]`` tile: one per 1024 logits.

    Selection is bound by instruction issue and by its per-round reductions, and a reduction
    across warps goes through shared memory: one warp a row was fastest on the H100 up to 1024
    experts, four warps at 4096.
    """
    return max(1, rows * block_e // 1024)


def use_sort(k: int) -> bool:
    """Bitonic top-k beyond 16; up to 16, ``k`` rounds of max-and-remove are cheaper.

    A round costs one tile-wide max and one compare per key, so rounds grow with ``k``; the
    network costs about ``log2(k) * (log2(E) - log2(k) / 2)`` compare-and-swap passes. On the
    H100 rounds were faster up to k = 16 and the network well beyond.
    """
    return k > 16


def _check_option_types(k, renormalize) -> None:
    # Also checked before the plan cache, whose keys cannot tell 2.0 from 2 or 1 from True.
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k: must be an int, got {type(k).__name__}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: must be a bool, got {type(renormalize).__name__}")


def check_gate_logits(gate_logits: TensorSpec) -> tuple[int, int]:
    """``(num_tokens, num_experts)`` of a router's gate logits, after the rules every router
    shares: a float16 / bfloat16 / float32 matrix of 1 to MAX_EXPERTS experts."""
    check_dtype("gate_logits", gate_logits.dtype, GATE_DTYPES)
    if gate_logits.ndim != 2:
        raise ValueError(f"gate_logits: must be 2-D (num_tokens, num_experts), got shape {gate_logits.shape}")
    n_rows, n_experts = gate_logits.shape
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"gate_logits: num_experts must be in [1, {MAX_EXPERTS}], got {n_experts}")
    return n_rows, n_experts


class TopkSoftmaxPlan:
    """Route tokens to experts: ``(weights, indices)`` of the ``k`` most probable experts per row.

    Parameters
    ----------
    gate_logits : TensorSpec
        ``(num_tokens, num_experts)``, float16, bfloat16 or float32, any strides;
        ``1 <= num_experts <= 4096``.
    k : int
        Experts per token, ``1 <= k <= num_experts``.
    renormalize : bool
        Divide the ``k`` weights of a row by their sum.
    backend : str
        ``"auto"``, ``"triton"``, ``"interpret"`` or ``"torch"``.

    Calling the plan with a tensor of that layout returns ``weights`` (float32
    ``(num_tokens, k)``, descending) and ``indices`` (int32 ``(num_tokens, k)``). Experts rank
    by logit, the order of their exact probabilities; equal logits go to the lower expert index
    (-0.0 equals +0.0). A row with a NaN logit, a ``+inf`` logit, or no finite logit gives NaN
    weights at indices ``0..k-1``; ``-inf`` logits are experts of weight 0.

    Example
    -------
    >>> x = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    >>> w, i = TopkSoftmaxPlan(TensorSpec.of(x), 2)(x)
    >>> i.tolist()
    [[1, 2]]
    """

    def __init__(self, gate_logits: TensorSpec, k: int, *, renormalize: bool = False, backend: str = "auto"):
        n_rows, n_experts = check_gate_logits(gate_logits)
        _check_option_types(k, renormalize)
        if not 1 <= k <= n_experts:
            raise ValueError(f"k: must satisfy 1 <= k <= num_experts ({n_experts}), got {k}")
        self.gate_logits = gate_logits
        self.k = k
        self.renormalize = renormalize
        self.backend = resolve_backend(backend, gate_logits.device)
        self.n_rows = n_rows
        self.workspace_size = 0
        if self.backend == "torch":
            self.kernel = None
            return
        block_e = max(2, triton.next_power_of_2(n_experts))
        self.rows = rows_per_program(n_rows, block_e)
        self.num_warps = num_warps_for(self.rows, block_e)
        block_k = max(2, triton.next_power_of_2(k))  # the bitonic network needs >= 1 level
        # Index bits under the logit's bits in a key: float32 logits take an int64's high half;
        # bfloat16 (float32's top 16 bits) and float16 (its top 19 once widened) leave 16 and 13.
        low_bits = LOW_BITS[gate_logits.dtype]
        self.meta = dict(K=k, RENORMALIZE=renormalize, ROWS=self.rows, BLOCK_E=block_e,
                         EVEN_E=block_e == n_experts, BLOCK_K=block_k, USE_SORT=use_sort(k), LOW_BITS=low_bits,
                         MARK=-(2 ** 63) if low_bits == 32 else -(2 ** 31), LOG_ROWS=self.rows.bit_length() - 1,
                         LOG_E=block_e.bit_length() - 1, LOG_K=block_k.bit_length() - 1)
        self.grid = (triton.cdiv(n_rows, self.rows),)
        self.args = (k, gate_logits.strides[0], gate_logits.strides[1], n_rows, n_experts)
        self.kernel = _topk_softmax_kernel.for_backend(self.backend)

    def __call__(self, gate_logits: torch.Tensor, weights: torch.Tensor | None = None,
                 indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch; ``weights`` / ``indices``, when given, must be contiguous ``(num_tokens, k)`` float32 / int32."""
        if self.kernel is None:
            ref_weights, ref_indices = reference.topk_softmax(gate_logits, self.k, self.renormalize)
            return (ref_weights if weights is None else weights.copy_(ref_weights),
                    ref_indices if indices is None else indices.copy_(ref_indices))
        device = gate_logits.device
        if weights is None:
            weights = torch.empty((self.n_rows, self.k), dtype=torch.float32, device=device)
        if indices is None:
            indices = torch.empty((self.n_rows, self.k), dtype=torch.int32, device=device)
        if self.n_rows:
            self.kernel[self.grid](weights, indices, gate_logits, *self.args,
                                   num_warps=self.num_warps, **self.meta)
        return weights, indices


_cached_plan = plan_cache(TopkSoftmaxPlan)


def topk_softmax(gate_logits: torch.Tensor, k: int, *, renormalize: bool = False,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable experts of each token: ``(weights float32, indices int32)``, ``(num_tokens, k)``.

    ``gate_logits`` is ``(num_tokens, num_experts)`` in float16, bfloat16 or float32 with
    ``num_experts <= 4096``. See :class:`TopkSoftmaxPlan` for the full contract.

    Example
    -------
    >>> w, i = topk_softmax(torch.tensor([[0.0, 2.0, 1.0]]), 2, renormalize=True)
    >>> i.tolist(), round(w.sum().item(), 6)
    ([[1, 2]], 1.0)
    """
    check_tensor("gate_logits", gate_logits)
    _check_option_types(k, renormalize)
    plan = _cached_plan(TensorSpec.of(gate_logits), k, renormalize=renormalize, backend=backend)
    return plan(gate_logits)
