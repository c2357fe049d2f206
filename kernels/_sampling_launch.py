"""Relaunching a compiled Triton kernel without ``JITFunction.run``'s per-call work.

Measured on the H100 host with triton 3.6 (bench/ops/sample.py's session notes): a launch
through ``kernel[grid](...)`` costs 18 us of host time for 4 arguments, 31 us for 24, and about
75 us for the sampling kernels' ~20 arguments and ~15 constexprs, so ``sample`` spent more time
launching than the GPU spent running a one-row batch. ``JITFunction.run`` binds and specialises
every argument, hashes the key and checks globals on each call; the compiled kernel's own
launcher needs none of that once the kernel exists.

:class:`FastLauncher` belongs to one plan, whose layout fixes what Triton specialises on
besides the call's values: tensor dtypes, the logits' strides and width (integers equal to 1 or
divisible by 16). Of the per-call values the kernels leave only tensor alignment specialised
(every other integer is ``do_not_specialize`` and within int32 by construction; floats are
fp32). So it keys the compiled kernel by (constexprs, ``num_warps``, each tensor's 16-byte
alignment); a miss costs one ordinary launch. It then calls ``CompiledKernel.run`` directly,
with the launch metadata and hooks exactly as ``JITFunction.run`` passes them last (so
profilers still see the launch). The interpreter takes the ordinary path.
"""

from __future__ import annotations

import torch
import triton

from ._backend import Launchable


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
            kernel = self._launch[grid](*args, **constexprs, num_warps=num_warps)
            self._compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel
            return
        bound = (*args, *(constexprs[name] for name in self._names[len(args):]))
        g = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch._C._cuda_getCurrentRawStream(device_index)  # what triton's driver asks too
        knobs = triton.knobs.runtime
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(g, stream, *bound), knobs.launch_enter_hook, knobs.launch_exit_hook,
                   *bound)
