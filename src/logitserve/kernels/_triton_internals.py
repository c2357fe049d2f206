"""Everything logitserve takes from Triton's internals, in one place.

Checked on triton 3.6 (the H100 host) and 3.9 (the CPU machine CI installs). Two uses:

- The interpreted twin of a compiled kernel (``_backend.py``) is built from the interpreter's
  classes: ``InterpretedFunction``, ``_patch_lang``, ``InterpreterError``, and ``JITFunction``.
- Relaunching a kernel already compiled (``sampling/launcher.py``) calls
  ``CompiledKernel.run`` positionally, with the launch hooks of ``triton.knobs``, as
  ``JITFunction.run`` does last. Where those are absent (:func:`can_relaunch` is false), callers
  launch through the ordinary ``kernel[grid](...)`` instead.
"""

from __future__ import annotations

from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

try:
    from triton import knobs as _knobs
except ImportError:  # before triton 3.4
    _knobs = None

__all__ = ["InterpretedFunction", "InterpreterError", "JITFunction", "_patch_lang", "can_relaunch", "compiled_of",
           "relaunch"]

_RELAUNCH_ATTRIBUTES = ("run", "function", "packed_metadata", "launch_metadata")


def compiled_of(launched):
    """The ``CompiledKernel`` that ``kernel[grid](...)`` returned (a future in some versions)."""
    return launched.result() if hasattr(launched, "result") else launched


def can_relaunch(compiled) -> bool:
    """Whether :func:`relaunch` can run ``compiled`` with this Triton."""
    return _knobs is not None and all(hasattr(compiled, name) for name in _RELAUNCH_ATTRIBUTES)


def relaunch(compiled, grid: tuple[int, int, int], stream: int, bound_args: tuple) -> None:
    """Launch ``compiled`` with every parameter given in order (runtime values, then constexprs),
    with the launch metadata and hooks exactly as ``JITFunction.run`` passes them (so profilers
    still see the launch)."""
    hooks = _knobs.runtime
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *bound_args), hooks.launch_enter_hook,
                 hooks.launch_exit_hook, *bound_args)
