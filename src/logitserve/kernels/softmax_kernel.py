"""The softmax kernel and its launch: any axis of any strided tensor (also the causal softmax's kernel).

The kernel sees a tensor as ``[outer..., position, reduce]`` through strides: up to three outer
dims (indexed per program), one *position* dim tiled ``BLOCK_P`` at a time, and the *reduce*
axis, of which a program holds one chunk of ``BLOCK_R`` in registers. A last-axis softmax is
"row mode" (the reduce axis is contiguous, a program owns ``BLOCK_P`` whole rows); any other
axis is "column mode" (the position dim is the contiguous one, a program owns a tile of
``BLOCK_P`` neighbouring columns and their whole reduce extent). Both read each input once and
write each output once.

A reduce axis wider than one block (vocabulary rows: 128256, 151936) is cut into ``SPLIT``
chunks held by ``SPLIT`` programs. Each computes its chunk's ``(max, sum of exp)``, publishes it
in a workspace, waits until all chunks of its rows have published, combines them (online
softmax, Milakov and Gimelshein, arXiv:1805.02867) and rescales the values it still holds in
registers: one read and one write of HBM, where a single program per row would have to read
the row twice. Waiting needs the chunks co-resident: programs take their tile from a ticket
counter in start order (as CUB's decoupled look-back does), so a group only waits for programs
already running or about to start, and any GPU that fits ``SPLIT`` programs at once makes
progress. Where that cannot hold (Triton's interpreter runs programs one after another, or
``SPLIT`` exceeds the SM count) the same kernel runs twice: a stats pass, then an apply pass
that re-reads the input.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch

from ._backend import launchable
from ._launch import row_block_settings
from ._plan import compute_dtype

# Kernel modes: a whole reduce axis per program; chunks that wait for each other; the two
# passes of the fallback.
_WHOLE = tl.constexpr(0)
_COOPERATIVE = tl.constexpr(1)
_STATS = tl.constexpr(2)
_APPLY = tl.constexpr(3)

# The sizes below are the fastest of H100 sweeps over the shapes named.
# Row mode: rows up to this wide are held whole by one program (a 32000-wide row ran faster
# whole than in 4 chunks); wider rows are split.
WHOLE_ROW_MAX = 32768
# Split rows: elements per chunk (8192 beat 4096 and 16384 on 256 x 128256, float32 and
# bfloat16, and is best or close to it on 1 to 64 vocabulary rows).
SPLIT_BLOCK = 8192
# Row mode: elements per program when rows are narrow (several rows share a program); on the
# causal 32 x 2048 x 2048, a row a program beat two.
ROW_TILE = 2048
# Column mode: neighbouring columns per program, and elements per program (best of 16/32/64
# columns by 4096/8192/16384 elements over [4096, 4096] dim 0 and [32 or 64, 4096, 64 or 8] dim 1).
COLUMN_WIDTH = 32
COLUMN_TILE = 8192
# Partials combined per step when chunks gather their group's statistics.
COMBINE_TILE = 4096
# Cooperative tiles from a ticket counter, in start order (see the module docstring). It costs
# a few percent on 256 x 128256 against program order and buys progress that does not depend on
# the hardware dispatching programs in order.
USE_TICKET = True


def tile_settings(n_pos: int, n_red: int, red_contiguous: bool, max_block: int, *,
                  itemsize: int = 4) -> tuple[int, int, int]:
    """``(BLOCK_P, BLOCK_R, num_warps)`` for a program holding ``BLOCK_P`` positions by ``BLOCK_R`` reduce elements.

    Row mode (contiguous reduce axis) takes the row's next power of two up to ``WHOLE_ROW_MAX``
    (and ``max_block``), packing rows until the tile holds ``ROW_TILE`` elements, as the Triton
    fused-softmax tutorial packs short rows; wider rows are split in chunks of ``SPLIT_BLOCK``.
    Column mode takes ``COLUMN_WIDTH`` neighbouring positions (128 contiguous bytes in float32:
    whole sectors per warp) and as much of the reduce axis as fits ``COLUMN_TILE``. Warps follow
    ``row_block_settings`` on the tile's element count (Liger-Kernel ``calculate_settings``),
    except split row chunks, which take one warp per 4 KB of input (H100: 8 warps for 8192
    float32, 4 for 8192 bfloat16 measured best; more warps for the same tile run slower).
    """
    if red_contiguous:
        block_r = min(triton.next_power_of_2(n_red), max_block, WHOLE_ROW_MAX)
        if block_r < n_red:
            block_r = min(SPLIT_BLOCK, max_block)
            warps = max(4, min(32, block_r * itemsize // 4096))
            return 1, block_r, warps
        block_p = min(triton.next_power_of_2(n_pos), max(1, ROW_TILE // block_r))
    else:
        block_p = min(triton.next_power_of_2(n_pos), COLUMN_WIDTH)
        block_r = min(triton.next_power_of_2(n_red), max(1, COLUMN_TILE // block_p), max_block)
    _, warps = row_block_settings(block_p * block_r)
    return block_p, block_r, warps


@triton.jit
def _combine_partials(stats_ptr, group, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_SPLIT: tl.constexpr, VOLATILE: tl.constexpr):
    # The group's SPLIT partial (max m_c, sum s_c) pairs -> the row max m and
    # sum s = sum_c s_c * exp(m_c - m). Chunks with no finite entry hold (-inf, 0) and add 0;
    # a row with no finite entry keeps m = -inf and s = NaN, as torch.softmax gives.
    base = stats_ptr + group * (2 * SPLIT * BLOCK_P)
    offs_c = tl.arange(0, BLOCK_SPLIT)
    offs_p = tl.arange(0, BLOCK_P)
    m = tl.full([BLOCK_P], float("-inf"), stats_ptr.dtype.element_ty)
    for c0 in range(0, SPLIT, BLOCK_SPLIT):
        c = c0 + offs_c
        ptrs = base + c[:, None] * BLOCK_P + offs_p[None, :]
        m_c = tl.load(ptrs, mask=(c < SPLIT)[:, None], other=float("-inf"), volatile=VOLATILE)
        m = tl.maximum(m, tl.max(m_c, axis=0))
    s = tl.zeros([BLOCK_P], stats_ptr.dtype.element_ty)
    for c0 in range(0, SPLIT, BLOCK_SPLIT):
        c = c0 + offs_c
        ptrs = base + c[:, None] * BLOCK_P + offs_p[None, :]
        m_c = tl.load(ptrs, mask=(c < SPLIT)[:, None], other=float("-inf"), volatile=VOLATILE)
        s_c = tl.load(ptrs + SPLIT * BLOCK_P, mask=(c < SPLIT)[:, None], other=0.0, volatile=VOLATILE)
        s += tl.sum(tl.where((c < SPLIT)[:, None], s_c * tl.exp(m_c - m[None, :]), 0.0), axis=0)
    return m, s


@triton.jit
def _wait_for_group(count_ptr, SPLIT: tl.constexpr):
    # Arrive, then spin until every chunk of the group has arrived. The barrier orders every
    # thread's statistics stores before the release; the acquire and the barrier after it order
    # the spin before the loads of the other chunks' statistics (as cooperative groups' grid
    # sync: __syncthreads, one thread's fenced atomic, __syncthreads).
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release")
    arrived = tl.atomic_add(count_ptr, 0, sem="acquire")
    while arrived < SPLIT:
        arrived = tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _leave_group(count_ptr, SPLIT: tl.constexpr):
    # The counter reaches 2 * SPLIT once every chunk has passed its spin; the last one out
    # sets it back to 0 for the next launch (so the workspace never needs clearing).
    departed = tl.atomic_add(count_ptr, 1, sem="relaxed")
    if departed == 2 * SPLIT - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")


@triton.jit
def _tile_coords(tile, n_pos_tiles, n_o1, n_o2, chunk_len,
                 SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr):
    # Tile -> (group, chunk); group -> (outer index, position tile); outer -> (o0, o1, o2).
    tile = tile.to(tl.int64)
    group = tile // SPLIT
    chunk = tile % SPLIT
    outer = group // n_pos_tiles
    o2 = outer % n_o2
    o1 = (outer // n_o2) % n_o1
    o0 = outer // n_o2 // n_o1
    offs_p = (group % n_pos_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    r_local = tl.arange(0, BLOCK_R)
    offs_r = chunk * chunk_len + r_local
    return group, chunk, o0, o1, o2, offs_p, r_local, offs_r


@triton.jit
def _tile_masks(offs_p, r_local, offs_r, n_pos, n_red, chunk_len, CAUSAL: tl.constexpr, LOAD_ALIGN: tl.constexpr):
    # (in bounds, visible, loaded). Causal row p sees columns j <= n_red - n_pos + p (bottom-right
    # aligned); its loads stop at the LOAD_ALIGN-element vector holding the diagonal, so masked
    # cells past it are never read.
    mask = (offs_p < n_pos)[:, None] & ((r_local < chunk_len) & (offs_r < n_red))[None, :]
    if CAUSAL:
        n_visible = n_red - n_pos + 1 + offs_p
        n_loaded = (n_visible + LOAD_ALIGN - 1) // LOAD_ALIGN * LOAD_ALIGN
        visible = mask & (offs_r[None, :] < n_visible[:, None])
        load_mask = mask & (offs_r[None, :] < n_loaded[:, None])
    else:
        visible = mask
        load_mask = mask
    return mask, visible, load_mask


@triton.jit
def _chunk_stats(x, stats_ptr, group, chunk, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr):
    # This chunk's max m_c and sum s_c of exp(x - m_c), published for the group; a chunk with no
    # finite entry publishes (-inf, 0). Returns e = exp(x - m_c) for reuse.
    m_c = tl.max(x, axis=1)
    e = tl.exp(x - tl.where(m_c == float("-inf"), 0.0, m_c)[:, None])
    s_c = tl.sum(e, axis=1)
    stats = stats_ptr + group * (2 * SPLIT * BLOCK_P) + chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    tl.store(stats, m_c)
    tl.store(stats + SPLIT * BLOCK_P, s_c)
    return m_c, e


@triton.jit
def _rescale_after_group(e, m_c, stats_ptr, sync_ptr, group, SPLIT: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_SPLIT: tl.constexpr):
    # Wait for the group's other chunks, then exp(x - m) / s = exp(x - m_c) * exp(m_c - m) / s.
    _wait_for_group(sync_ptr + group, SPLIT)
    m, s = _combine_partials(stats_ptr, group, SPLIT, BLOCK_P, BLOCK_SPLIT, True)
    _leave_group(sync_ptr + group, SPLIT)
    return e * (tl.exp(m_c - m) * (1.0 / s))[:, None]


@launchable
@triton.jit
def _softmax_kernel(
    out_ptr, x_ptr, stats_ptr, sync_ptr,
    x_stride_o0, x_stride_o1, x_stride_o2, x_stride_p, x_stride_r,
    out_stride_o0, out_stride_o1, out_stride_o2, out_stride_p, out_stride_r,
    n_o1, n_o2, n_pos, n_red, n_pos_tiles, n_tiles, chunk_len,
    MODE: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr, TICKET: tl.constexpr,
    LOAD_ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SPLIT: tl.constexpr,
):
    if MODE == _COOPERATIVE and TICKET:
        # Tiles in start order (CUB's decoupled look-back): a group waits only for programs
        # already running; the last ticket sets the counter back to 0.
        tile = tl.atomic_add(sync_ptr + n_tiles // SPLIT, 1)
        if tile == n_tiles - 1:
            tl.atomic_xchg(sync_ptr + n_tiles // SPLIT, 0)
    else:
        tile = tl.program_id(0)
    group, chunk, o0, o1, o2, offs_p, r_local, offs_r = _tile_coords(
        tile, n_pos_tiles, n_o1, n_o2, chunk_len, SPLIT, BLOCK_P, BLOCK_R)
    mask, visible, load_mask = _tile_masks(offs_p, r_local, offs_r, n_pos, n_red, chunk_len, CAUSAL, LOAD_ALIGN)
    x_ptrs = (x_ptr + o0 * x_stride_o0 + o1 * x_stride_o1 + o2 * x_stride_o2
              + offs_p[:, None] * x_stride_p + offs_r[None, :] * x_stride_r)
    x = tl.load(x_ptrs, mask=load_mask, other=float("-inf")).to(stats_ptr.dtype.element_ty)
    if CAUSAL:
        x = tl.where(visible, x, float("-inf"))
    if MODE == _WHOLE:
        # softmax(x) = exp(x - max) / sum(exp(x - max)); a row of -inf gives NaN, as torch.
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    elif MODE == _APPLY:
        m, s = _combine_partials(stats_ptr, group, SPLIT, BLOCK_P, BLOCK_SPLIT, False)
        y = tl.exp(x - m[:, None]) * (1.0 / s)[:, None]
    else:
        m_c, e = _chunk_stats(x, stats_ptr, group, chunk, SPLIT, BLOCK_P)
        if MODE == _COOPERATIVE:
            y = _rescale_after_group(e, m_c, stats_ptr, sync_ptr, group, SPLIT, BLOCK_P, BLOCK_SPLIT)
    if MODE != _STATS:
        if CAUSAL:
            y = tl.where(visible, y, 0.0)
        out_ptrs = (out_ptr + o0 * out_stride_o0 + o1 * out_stride_o1 + o2 * out_stride_o2
                    + offs_p[:, None] * out_stride_p + offs_r[None, :] * out_stride_r)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class SoftmaxLaunch:
    """One launch of ``_softmax_kernel`` over ``[outer..., position, reduce]`` dims given as ``(size, x_stride, out_stride)``.

    Shared by :class:`SoftmaxPlan` and the causal softmax's plan; it chooses the tile, the
    split of the reduce axis and the mode, and owns the workspace (partial statistics and the
    cooperative counters, which the kernel leaves at zero after every launch). A plan's
    launches must be ordered (one stream), as InfiniCore's descriptors with a workspace are.
    """

    def __init__(self, outer: list[tuple[int, int, int]], pos: tuple[int, int, int], red: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, backend: str, *, causal: bool = False,
                 max_block: int | None = None, cooperative: bool = True, load_align: int = 8):
        self.outer = [(1, 0, 0)] * (3 - len(outer)) + list(outer)
        self.pos, self.red, self.causal, self.load_align = pos, red, causal, load_align
        n_outer = 1
        for size, _, _ in self.outer:
            n_outer *= size
        red_contiguous = red[1] == 1 or pos[1] != 1
        self.block_p, self.block_r, self.num_warps = tile_settings(
            pos[0], red[0], red_contiguous, max_block or (1 << 30), itemsize=dtype.itemsize)
        self.split = triton.cdiv(red[0], self.block_r)
        align = min(16, self.block_r)  # chunk starts on 16-element boundaries, for vector loads
        self.chunk_len = triton.cdiv(triton.cdiv(red[0], self.split), align) * align
        self.n_pos_tiles = triton.cdiv(pos[0], self.block_p)
        self.n_groups = n_outer * self.n_pos_tiles
        self.n_tiles = self.n_groups * self.split
        self.grid = (self.n_tiles,)
        if self.split == 1:
            self.modes = (_WHOLE,)
        elif backend == "triton" and cooperative and self.split <= _sm_count(device):
            self.modes = (_COOPERATIVE,)
        else:
            self.modes = (_STATS, _APPLY)
        self.block_split = min(triton.next_power_of_2(self.split), max(1, COMBINE_TILE // self.block_p))
        stats_dtype = compute_dtype(dtype)
        n_stats = 2 * self.n_tiles * self.block_p if self.split > 1 else 1
        self.stats = torch.empty(n_stats, dtype=stats_dtype, device=device)
        n_sync = self.n_groups + 1 if self.modes == (_COOPERATIVE,) else 1
        self.sync = torch.zeros(n_sync, dtype=torch.int32, device=device)
        self.workspace_size = self.stats.nbytes + self.sync.nbytes
        self.kernel = _softmax_kernel.for_backend(backend)

    def args(self, x: torch.Tensor, out: torch.Tensor) -> tuple:
        """The kernel's positional arguments for one launch over ``x`` and ``out``."""
        (_, xs0, os0), (n_o1, xs1, os1), (n_o2, xs2, os2) = self.outer
        return (out, x, self.stats, self.sync,
                xs0, xs1, xs2, self.pos[1], self.red[1],
                os0, os1, os2, self.pos[2], self.red[2],
                n_o1, n_o2, self.pos[0], self.red[0], self.n_pos_tiles, self.n_tiles, self.chunk_len)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        args = self.args(x, out)
        for mode in self.modes:
            self.kernel[self.grid](
                *args, MODE=mode, CAUSAL=self.causal, SPLIT=self.split, TICKET=USE_TICKET,
                LOAD_ALIGN=self.load_align, BLOCK_P=self.block_p, BLOCK_R=self.block_r,
                BLOCK_SPLIT=self.block_split, num_warps=self.num_warps)
