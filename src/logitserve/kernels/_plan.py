"""What every descriptor (plan) shares: the tensor layout it was made for and a bounded cache.

A plan is made once from a layout (:class:`TensorSpec`) and static options, validates them,
and then launches with no further checks. The functional API finds plans through
:func:`plan_cache`, keyed by everything the plan was made from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Plans are small (a few Python objects); the bound only stops a stream of distinct shapes
# from growing memory without limit. 512 holds every (op, dtype, shape class) a server warms.
PLAN_CACHE_SIZE = 512

_caches: list = []


@dataclass(frozen=True)
class TensorSpec:
    """The layout of one tensor: what a plan is created from, and part of its cache key."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def check_dtype(name: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise ``TypeError`` naming the argument when its dtype is not one of ``allowed``."""
    if dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: dtype must be one of {names}, got {str(dtype).removeprefix('torch.')}")


def check_same_device(name: str, spec: TensorSpec, device: torch.device) -> None:
    if spec.device != device:
        raise ValueError(f"{name}: must be on {device}, got {spec.device}")


def check_out_like_x(out: TensorSpec, x: TensorSpec) -> None:
    """An elementwise-shaped ``out``: x's device, dtype and shape, and no element written twice."""
    check_same_device("out", out, x.device)
    if out.dtype != x.dtype:
        raise ValueError(f"out: dtype must equal x's ({x.dtype}), got {out.dtype}")
    if out.shape != x.shape:
        raise ValueError(f"out: shape must equal x's {x.shape}, got {out.shape}")
    if any(st == 0 and size > 1 for size, st in zip(out.shape, out.strides)):
        raise ValueError(f"out: must not overlap itself, got strides {out.strides} for shape {out.shape}")


def check_tensor(name: str, value) -> None:
    """Raise ``TypeError`` naming the argument when it is not a tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: must be a torch.Tensor, got {type(value).__name__}")


def check_out_aliasing(out: torch.Tensor, name: str, t: torch.Tensor) -> None:
    """``out`` may be ``t`` itself (the same view: in place) or memory disjoint from it; a partial
    overlap would have programs read what others already wrote."""
    if out.numel() == 0 or t.numel() == 0 or out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return
    if out.data_ptr() == t.data_ptr() and out.shape == t.shape and out.stride() == t.stride():
        return

    def span(v: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(v.shape, v.stride()))
        return v.data_ptr(), v.data_ptr() + (last + 1) * v.element_size()

    (a0, a1), (b0, b1) = span(out), span(t)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"out: must be {name} itself (in place) or not overlap {name}; it overlaps {name} "
                         "without being the same view")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels compute in float32, and in float64 for float64 input."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def plan_cache(plan_cls):
    """Wrap a plan class in a bounded LRU cache: equal arguments give the same plan object."""
    cached = functools.lru_cache(maxsize=PLAN_CACHE_SIZE)(plan_cls)
    _caches.append(cached)
    return cached


def clear_plan_caches() -> None:
    for cached in _caches:
        cached.cache_clear()


def plan_cache_size() -> int:
    """Plans held across every op's cache (the server reports it as a metric)."""
    return sum(cached.cache_info().currsize for cached in _caches)
