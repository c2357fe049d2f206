"""The noise behind ``sample``: a counter-based hash of ``(seed, step, token index)``.

Randomness is a pure function of those three numbers, so a row draws the same token whatever
batch it sits in and whichever backend runs it. The torch twin of every function here is in
``reference/sample.py`` and the tests hold the two to bit-identical uniforms.

The hash is two rounds of MurmurHash3's 32-bit finaliser ``fmix32`` (Austin Appleby,
MurmurHash3.cpp, public domain) over the token index, keyed by two words absorbed from the
seed and the step. Everything is uint32 arithmetic (multiplication wraps modulo 2**32), which
Triton compiles and interprets identically. Per token it costs 4 integer multiplies and 12
shifts or xors, a tenth of Philox-4x32-10's 20 wide multiplies; the statistical tests in
tests/test_sample_statistics.py are its quality check.

The uniform takes the top 23 bits: ``u = (b + 0.5) * 2**-23`` lies strictly inside (0, 1) and is
exact in float32 (built from the bits as a float's mantissa: no int-to-float conversion, which
runs at a quarter of the FP32 rate on Hopper). ``E = -log2(u)`` is an exponential draw; the
Gumbel-max trick (Gumbel 1954; Maddison et al., "A* sampling", 2014) in its exponential-race
form picks ``argmax_i p_i / E_i``, distributed exactly as ``p``; in base-2 logs that is
``argmax_i log2(p_i) - log2(E_i)``. For u close to 1, ``-log2(u)`` loses relative precision, so
there ``E = -log1p(-v) / ln 2`` with ``v = 1 - u`` (also exact) comes from its series.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import launchable

# Absorbed before the seed and the step so that a zero seed or step still mixes (fmix32(0) == 0).
# The first two 32-bit words of the fractional part of pi (as in Blowfish's P-array).
SEED_MIX = 0x243F6A88
STEP_MIX = 0x85A308D3


@triton.jit
def fmix32(h):
    """MurmurHash3's finaliser on uint32: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    return h


@triton.jit
def row_keys(seed_lo, seed_hi, step_lo, step_hi):
    """Two uint32 keys from a row's 64-bit seed and 64-bit step (each given as uint32 halves)."""
    k0 = fmix32(fmix32(seed_lo ^ 0x243F6A88) ^ seed_hi)
    k1 = fmix32(fmix32(step_lo ^ k0 ^ 0x85A308D3) ^ step_hi)
    return k0, k1


@triton.jit
def _u32(v):
    """An int32 scalar argument's bit pattern as uint32."""
    return tl.cast(v, tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def u64_halves(arg, hi_arg, row, stride, IS_TENSOR: tl.constexpr):
    """A row's 64-bit value as (lo, hi) uint32: from an int tensor, or from two int32 scalars."""
    if IS_TENSOR:
        v = tl.load(arg + row * stride).to(tl.int64)
        return v.to(tl.uint32), (v >> 32).to(tl.uint32)
    else:
        return _u32(arg), _u32(hi_arg)


@triton.jit
def uniform_bits(idx, k0, k1):
    """uint32 hash of token indices ``idx`` under a row's keys."""
    return fmix32(fmix32(idx.to(tl.uint32) ^ k1) ^ k0)


@triton.jit
def uniform(bits):
    """The uniform ``u = (b + 0.5) * 2**-23`` in (0, 1), float32, of hash bits' top 23 ``b``."""
    # Without an int-to-float conversion: the 23 bits as the mantissa of a float in [1, 2),
    # minus 1, plus half a step. Both operations are exact.
    return ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0 + 5.9604644775390625e-08


@triton.jit
def gumbel(bits):
    """Base-2 Gumbel draws ``-log2(E)`` (float32) from hash bits, with ``E = -log2(u)``.

    ``E`` is an exponential draw (``Exp(1) / ln 2``), so ``argmax_i log2(p_i) + gumbel_i`` picks
    ``argmax_i p_i / E_i``: the exponential race, in logs (no exp, no division per token).
    """
    u = uniform(bits)
    v = 1.0 - u  # exact
    # -log2(1 - v) = (v + v^2/2 + v^3/3 + v^4/4 + ...) / ln 2; for v < 2**-6 the v^5/5 term is under 2**-31 v.
    series = v * (1.0 + v * (0.5 + v * (0.3333333432674408 + v * 0.25))) * 1.4426950408889634
    return -tl.log2(tl.where(v < 0.015625, series, -tl.log2(u)))


@launchable
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "step_lo", "step_hi"])
def _noise_kernel(bits_ptr, gumbel_ptr, seed_lo, seed_hi, step_lo, step_hi, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    k0, k1 = row_keys(_u32(seed_lo), _u32(seed_hi), _u32(step_lo), _u32(step_hi))
    bits = uniform_bits(offs, k0, k1)
    tl.store(bits_ptr + offs, bits.to(tl.int64), mask=mask)
    tl.store(gumbel_ptr + offs, gumbel(bits), mask=mask)


def split_u64(value: int) -> tuple[int, int]:
    """A Python int taken modulo 2**64, as (lo, hi) int32 bit patterns (kernel scalar arguments)."""
    value &= (1 << 64) - 1
    lo, hi = value & 0xFFFFFFFF, value >> 32
    return lo - (1 << 32) * (lo >> 31), hi - (1 << 32) * (hi >> 31)


def noise(seed: int, step: int, n: int, *, device: torch.device | str = "cpu",
          backend: str = "interpret") -> tuple[torch.Tensor, torch.Tensor]:
    """The hash bits (int64 holding uint32) and base-2 Gumbel draws for tokens ``0..n-1`` of one row.

    For tests and for replaying a draw: ``reference.sample.noise`` computes the same in torch.
    """
    bits = torch.empty(n, dtype=torch.int64, device=device)
    draws = torch.empty(n, dtype=torch.float32, device=device)
    block = 1024
    _noise_kernel.for_backend(backend)[(triton.cdiv(n, block),)](
        bits, draws, *split_u64(seed), *split_u64(step), n, BLOCK=block)
    return bits, draws
