"""Backend selection and the two ways one Triton kernel runs: compiled on CUDA, interpreted on the CPU.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted (from
``TRITON_INTERPRET``). logitserve wants both in one process (tests compare them), so
:class:`Launchable` keeps the compiled kernel and builds an interpreted twin on first use.
"""

from __future__ import annotations

import contextlib
import types

import torch
import triton.language as tl

from ._triton_internals import InterpretedFunction, InterpreterError, JITFunction, _patch_lang

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


# Language modules (by id) already patched for the interpreted launch in progress.
_patched_in_launch: set = set()


class _DeviceFunction(InterpretedFunction):
    """An interpreted ``@triton.jit`` helper called from inside an interpreted launch.

    ``InterpretedFunction.__call__`` patches the ``triton.language`` modules in the helper's
    globals on every device-function call (about a millisecond each: inspect.getmembers over
    the modules). The patches stay in place for the rest of the launch, so this twin patches a
    given set of modules once per launch: kernels made of small helpers and reductions
    interpret several times faster.
    """

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self._langs = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def __call__(self, *args, **kwargs):
        if not self._langs <= _patched_in_launch:
            _patch_lang(self.fn)
            _patched_in_launch.update(self._langs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e


def _interpreted(jit_fn, memo: dict, nested: bool = False) -> InterpretedFunction:
    # The interpreter executes the kernel's source in its function's globals, where nested
    # @triton.jit helpers are compiled JITFunctions that refuse to run on the CPU. Give the
    # twin a copy of those globals with every JITFunction swapped for its own twin.
    if isinstance(jit_fn, InterpretedFunction):
        return jit_fn
    # Keyed by id (the entry keeps the function alive): hashing a JITFunction computes its
    # cache key, which fails while the interpreter has triton.language patched.
    if id(jit_fn) in memo:
        return memo[id(jit_fn)][1]
    fn = jit_fn.fn
    twin_globals = dict(fn.__globals__)
    clone = types.FunctionType(fn.__code__, twin_globals, fn.__name__, fn.__defaults__, fn.__closure__)
    twin = (_DeviceFunction if nested else InterpretedFunction)(clone)
    memo[id(jit_fn)] = (jit_fn, twin)
    for name, value in twin_globals.items():
        if isinstance(value, JITFunction):
            twin_globals[name] = _interpreted(value, memo, nested=True)
    return twin


def _language_namespaces() -> list:
    """Every object the interpreter's ``_patch_lang`` sets attributes on."""
    objects = [tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base]
    return objects + [c for c in (getattr(tl.core, "condition", None),) if c is not None]


@contextlib.contextmanager
def _language_restored():
    # A device-function call patches triton.language and drops the patch scope (upstream
    # InterpretedFunction.__call__ does the same): harmless under TRITON_INTERPRET=1, but here
    # compiled kernels share the process, and a leaked tl.core.program_id breaks their next
    # compilation. Snapshot the namespaces and put back whatever the launch changed.
    saved = [(obj, dict(vars(obj))) for obj in _language_namespaces()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _ABSENT) is not value:
                    setattr(obj, name, value)


_ABSENT = object()


@contextlib.contextmanager
def _jit_calls_interpreted(memo: dict):
    # Library helpers (tl.max, tl.sum, tl.topk, ...) are @triton.jit functions living in
    # triton.language's own globals, out of reach of the swap above; calling one outside a
    # compiled kernel raises. While an interpreted launch runs, route every JITFunction call
    # to its interpreted twin.
    # The library's own functions run unchanged (as under TRITON_INTERPRET=1), so its combine
    # functions keep their identity and the interpreter's vectorised reductions apply.
    def call(jit_fn, *args, **kwargs):
        if id(jit_fn) not in memo:
            memo[id(jit_fn)] = (jit_fn, _DeviceFunction(jit_fn.fn))
        return memo[id(jit_fn)][1](*args, **kwargs)

    original = JITFunction.__call__
    JITFunction.__call__ = call
    _patched_in_launch.clear()
    try:
        with _language_restored():
            yield
    finally:
        JITFunction.__call__ = original


class _InterpretedLauncher:
    """``launcher[grid](*args)`` for the interpreted twin, with library JIT helpers interpreted too."""

    def __init__(self, fn: InterpretedFunction, memo: dict):
        self._fn = fn
        self._memo = memo

    def __getitem__(self, grid):
        launch = self._fn[grid]

        def run(*args, **kwargs):
            with _jit_calls_interpreted(self._memo):
                return launch(*args, **kwargs)

        return run


class Launchable:
    """A ``@triton.jit`` kernel that launches compiled (``"triton"``) or interpreted (``"interpret"``)."""

    def __init__(self, jit_fn: JITFunction):
        self._jit_fn = jit_fn
        self._interpreted: _InterpretedLauncher | None = None

    def for_backend(self, backend: str):
        """The object to index with a grid: ``kernel.for_backend(b)[grid](*args)``."""
        if backend == "triton":
            if isinstance(self._jit_fn, InterpretedFunction):
                raise RuntimeError("TRITON_INTERPRET=1 is set: compiled Triton kernels are unavailable")
            return self._jit_fn
        if backend == "interpret":
            if self._interpreted is None:
                memo: dict = {}
                self._interpreted = _InterpretedLauncher(_interpreted(self._jit_fn, memo), memo)
            return self._interpreted
        raise ValueError(f"no Triton kernel for backend {backend!r}")


def launchable(jit_fn: JITFunction) -> Launchable:
    """Decorator, applied above ``@triton.jit``: makes the kernel launchable on either backend."""
    return Launchable(jit_fn)
