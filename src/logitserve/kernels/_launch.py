"""Launch arithmetic shared by the row-wise kernels: block widths and warps, with their sources."""

from __future__ import annotations

import triton

# One program keeps a whole row in registers up to this many elements; wider rows loop over
# blocks of this width (online softmax). 64K float32 values over 32 warps is 64 registers a
# thread, under the 255 cap with room for the rest of the kernel.
MAX_ROW_BLOCK = 65536


def row_block_settings(n_cols: int, max_block: int = MAX_ROW_BLOCK) -> tuple[int, int]:
    """``(BLOCK_SIZE, num_warps)`` for a kernel where one program owns one row of ``n_cols``.

    The block is the next power of two of the row, capped at ``max_block`` (wider rows loop).
    Warps follow the Triton fused-softmax tutorial (python/tutorials/02-fused-softmax.py) and
    Liger-Kernel's ``calculate_settings``: 4 up to 2K elements, 8 up to 8K, 16 up to 32K, then 32,
    so each thread holds 8 to 64 elements of the block.
    """
    block = min(triton.next_power_of_2(max(n_cols, 1)), max_block)
    if block <= 2048:
        warps = 4
    elif block <= 8192:
        warps = 8
    elif block <= 32768:
        warps = 16
    else:
        warps = 32
    return block, warps
