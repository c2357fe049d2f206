"""Copies in and out of a captured graph done by a kernel, not the copy engine.

Page-locked host memory has a device address (CUDA's unified addressing), so a kernel can read a
call's input buffer from the host and write its outputs there. In a graph that trades each
memcpy node for a kernel node, which took less GPU time and a shorter replay call on the H100 for
the buffers a call moves (a few hundred kilobytes in, a few hundred bytes out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import launchable

# Words each program copies: 8 KB of 32-bit words, 32 programs for a 256 KB buffer.
BLOCK_WORDS = 2048


@launchable
@triton.jit
def _copy_words(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (``t`` contiguous) as 32-bit words (or bytes, when their count is not a
    multiple of 4)."""
    # as_strided, not reshape: torch calls a one-element column of a wider tensor contiguous
    # while its stride stays the row's, and a dtype view refuses that stride.
    flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
    return flat.view(torch.int32) if flat.numel() % 4 == 0 else flat


def copy_by_kernel(src: torch.Tensor, dst: torch.Tensor, backend: str = "triton") -> None:
    """Copy ``src``'s bytes into ``dst`` (contiguous, same byte size; each on the CUDA device or
    page-locked on the host) by a kernel on the current stream (``backend="interpret"``: CPU
    tensors, through Triton's interpreter)."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_by_kernel: src and dst must be contiguous")
    if src.nbytes != dst.nbytes:
        raise ValueError(f"copy_by_kernel: src has {src.nbytes} bytes, dst {dst.nbytes}")
    if src.nbytes == 0:
        return
    src_words, dst_words = _words(src), _words(dst)
    n = src_words.numel()
    _copy_words.for_backend(backend)[(triton.cdiv(n, BLOCK_WORDS),)](src_words, dst_words, n, BLOCK=BLOCK_WORDS)
