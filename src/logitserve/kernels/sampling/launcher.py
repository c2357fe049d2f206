"""Relaunching a compiled Triton kernel without ``JITFunction.run``'s per-call work.

``JITFunction.run`` binds and specialises every argument, hashes the key and checks globals on
each call; for the sampling kernels' ~20 arguments and ~15 constexprs that cost more host time
than the GPU spends on a one-row batch (H100, triton 3.6). The compiled kernel's own launcher
needs none of that once the kernel exists.

:class:`FastLauncher` belongs to one plan, whose layout fixes what Triton specialises on
besides the call's values: tensor dtypes, the logits' strides and width (integers equal to 1 or
divisible by 16). Of the per-call values the kernels leave only tensor alignment specialised
(every other integer is ``do_not_specialize`` and within int32 by construction; floats are
fp32). So it keys the compiled kernel by (constexprs, ``num_warps``, each tensor's 16-byte
alignment); a miss costs one ordinary launch. It then relaunches the compiled kernel directly
(``_triton_internals.relaunch``). The interpreter, and a Triton without the internals that
relaunch needs, take the ordinary path.
"""

from __future__ import annotations

import torch

from .._backend import Launchable
from .._triton_internals import can_relaunch, compiled_of, relaunch


def _alignment(args) -> tuple:
    """The per-call part of Triton's specialisation: each tensor's 16-byte alignment."""
    return tuple(a.data_ptr() & 15 == 0 for a in args if isinstance(a, torch.Tensor))


class FastLauncher:
    """``launcher(grid, args, constexprs, num_warps, device_index)`` for one kernel of one plan.

    ``args`` are the kernel's leading (runtime) parameters in order; ``constexprs`` the rest, by name.
    """

    def __init__(self, kernel: Launchable, backend: str):
        self._launch = kernel.for_backend(backend)
        self._fast = backend == "triton"
        self._names = kernel._jit_fn.arg_names
        self._compiled: dict = {}

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int, device_index: int = 0):
        if not self._fast:
            self._launch[grid](*args, **constexprs, num_warps=num_warps)
            return
        key = (num_warps, *constexprs.values(), *_alignment(args))
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = compiled_of(self._launch[grid](*args, **constexprs, num_warps=num_warps))
            if can_relaunch(kernel):
                self._compiled[key] = kernel
            return
        bound = (*args, *(constexprs[name] for name in self._names[len(args):]))
        g = tuple(grid) + (1,) * (3 - len(grid))
        relaunch(kernel, g, torch._C._cuda_getCurrentRawStream(device_index), bound)  # the stream triton's driver asks for
