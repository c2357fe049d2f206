"""Backend selection and the two ways one Triton kernel runs: compiled on CUDA, interpreted on the CPU.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted (from
``TRITON_INTERPRET``). logitserve wants both in one process (tests compare them), so
:class:`Launchable` keeps the compiled kernel and builds an interpreted twin on first use.
"""

from __future__ import annotations

import types

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

BACKENDS = ("auto", "triton", "interpret", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map a requested backend to the one that runs: ``"auto"`` is triton on CUDA, torch elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda":
        raise ValueError(f"backend 'triton' needs CUDA tensors, got device {device}")
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(f"backend 'interpret' needs CPU tensors, got device {device}")
    return backend


def _interpreted(jit_fn, memo: dict) -> InterpretedFunction:
    # The interpreter executes the kernel's source in its function's globals, where nested
    # @triton.jit helpers are compiled JITFunctions that refuse to run on the CPU. Give the
    # twin a copy of those globals with every JITFunction swapped for its own twin.
    if isinstance(jit_fn, InterpretedFunction):
        return jit_fn
    if jit_fn in memo:
        return memo[jit_fn]
    fn = jit_fn.fn
    twin_globals = dict(fn.__globals__)
    clone = types.FunctionType(fn.__code__, twin_globals, fn.__name__, fn.__defaults__, fn.__closure__)
    memo[jit_fn] = InterpretedFunction(clone)
    for name, value in twin_globals.items():
        if isinstance(value, JITFunction):
            twin_globals[name] = _interpreted(value, memo)
    return memo[jit_fn]


class Launchable:
    """A ``@triton.jit`` kernel that launches compiled (``"triton"``) or interpreted (``"interpret"``)."""

    def __init__(self, jit_fn: JITFunction):
        self._jit_fn = jit_fn
        self._interpreted: InterpretedFunction | None = None

    def for_backend(self, backend: str):
        """The object to index with a grid: ``kernel.for_backend(b)[grid](*args)``."""
        if backend == "triton":
            if isinstance(self._jit_fn, InterpretedFunction):
                raise RuntimeError("TRITON_INTERPRET=1 is set: compiled Triton kernels are unavailable")
            return self._jit_fn
        if backend == "interpret":
            if self._interpreted is None:
                self._interpreted = _interpreted(self._jit_fn, {})
            return self._interpreted
        raise ValueError(f"no Triton kernel for backend {backend!r}")


def launchable(jit_fn: JITFunction) -> Launchable:
    """Decorator, applied above ``@triton.jit``: makes the kernel launchable on either backend."""
    return Launchable(jit_fn)
