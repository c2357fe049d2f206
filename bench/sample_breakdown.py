"""Issue 46's sampling call taken apart launch by launch: each launch's device time and the bytes of
the logits it reads, the passes over the row a case takes, beside the read-once limit.

    python -m bench.sample_breakdown [--out FILE] [--repeats 200]
    python -m bench.sample_breakdown --smoke [--out FILE]   # on the CPU, interpreted: no timings

For 1x128256 and 256x128256 logits (``torch.randn``), float32 and bfloat16, and each case of
``CASES``, a ``SamplePlan`` (kernels/sampling/plan.py) is called with its launchers wrapped, so the
tables list the launches the plan really takes (``_stats_merge``, ``_gather``, ``_check``,
``_finish``), each with:

- its device time: the kernel's duration as torch.profiler (CUPTI) records it, the median over
  ``--repeats`` calls with the L2 cache flushed before each (a 256 MB write, as
  ``triton.testing.do_bench`` does for bench/harness.py). CUDA events around each launch would
  time the host's launch work too where a kernel is shorter than it (a one-row call).
- the bytes of the logits it reads (:func:`reads`), from the plan's chunking and the rows' states
  the merge left in the workspace; its passes: those bytes over the logits' bytes.

Per case, the whole call: its CUDA graph's replay (bench.harness ``median_us``, L2 flushed), its
passes summed, and the read-once limit: the logits' bytes over the copy bandwidth measured in the
same run by a device-to-device copy of the logits' size (bytes read plus written over its median).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch

from logitserve.kernels._plan import TensorSpec
from logitserve.kernels.sampling import plan as plan_module
from logitserve.kernels.sampling.plan import SamplePlan
from logitserve.kernels.sampling import workspace
from logitserve.kernels.sampling.workspace import _host_layout

from .harness import median_us, print_table

SHAPES = ((1, 128256), (256, 128256))
SMOKE_SHAPES = ((2, 1000),)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
CASES = {
    "greedy": dict(temperature=0.0),
    "T .8": dict(temperature=0.8),
    "T .8 k 50 p .9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "T .8 p .9": dict(temperature=0.8, top_p=0.9),
    "T .8 min_p .1": dict(temperature=0.8, min_p=0.1),
}
SEEDS = dict(seed=1234, step=7)
# The plan's launchers, in the order SamplePlan.__init__ makes them.
KERNEL_NAMES = tuple(k._jit_fn.__name__ for k in (plan_module._stats_merge, plan_module._gather, plan_module._check,
                                                  plan_module._finish, plan_module._random_val))
FLUSH_BYTES = 256 << 20  # triton.testing.do_bench's L2 flush
# The workspace's constants, as Python ints (they are tl.constexpr for the kernels).
CAP, ROW_STATE_DONE, ROW_STATE_PASS1 = (c.value for c in (workspace.CAP, workspace.ROW_STATE_DONE,
                                                          workspace.ROW_STATE_PASS1))


@dataclass
class Launch:
    """One launch a call took: its kernel, grid and compile-time flags."""

    name: str
    grid: tuple
    flags: dict


@dataclass
class Reads:
    """The bytes of the logits a launch reads; ``at_least``: more where a walk rejects (data-dependent)."""

    nbytes: int
    what: str
    at_least: bool = False


class _Recorded:
    """A plan's launcher that notes each launch in ``log`` before making it."""

    def __init__(self, name: str, launcher, log: list):
        self.name, self.launcher, self.log = name, launcher, log

    def __call__(self, grid, args, constexprs, num_warps, device_index=0):
        self.log.append(Launch(self.name, tuple(grid), dict(constexprs)))
        self.launcher(grid, args, constexprs, num_warps, device_index)


class Call:
    """One case's call: a plan over ``logits`` with its launchers recorded and its own workspace,
    whose rows' states are read back after a call (:meth:`row_states`)."""

    def __init__(self, logits: torch.Tensor, params: dict, backend: str):
        self.logits, self.params = logits, params
        self.plan = SamplePlan(TensorSpec.of(logits), backend=backend)
        self.log: list[Launch] = []
        self.plan.kernels = [_Recorded(name, k, self.log) for name, k in zip(KERNEL_NAMES, self.plan.kernels)]
        self.out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        self.workspace = self.new_workspace()

    def new_workspace(self) -> torch.Tensor:
        return torch.zeros(self.plan.workspace_size, dtype=torch.uint8, device=self.logits.device)

    def __call__(self, workspace: torch.Tensor | None = None) -> torch.Tensor:
        ws = self.workspace if workspace is None else workspace
        return self.plan(self.logits, self.out, **self.params, **SEEDS, workspace=ws)

    def launches(self) -> list[Launch]:
        """The launches of one call (made now)."""
        self.log.clear()
        self()
        return list(self.log)

    def row_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's state and candidate count as the last call left them (workspace.py's layout)."""
        plan = self.plan
        o_count, o_rowi, *_ = _host_layout(plan.n_rows, plan.n_chunks, plan.groups, 8 if plan.is_f64 else 4)
        ws = self.workspace.cpu()
        counts = ws[o_count:o_count + 4 * plan.n_rows].view(torch.int32)
        states = ws[o_rowi:o_rowi + 16 * plan.n_rows].view(torch.int64).view(plan.n_rows, 2)[:, 0]
        return states, counts


def reads(launch: Launch, plan: SamplePlan, states: torch.Tensor, counts: torch.Tensor, itemsize: int,
          top_p: float) -> Reads:
    """The bytes of the logits ``launch`` reads, from what each kernel's docstring says it reads:

    - ``_stats_merge``: every row, whole (the chunk statistics).
    - ``_gather``: the rows the merge marked ROW_STATE_PASS1, whole (the draw's first pass, chunk
      by chunk); of the others, with ``GATHER``, only the groups whose max reaches the row's
      bound (runs of 8 tokens repeating every ``8 NG``: ``CH / NG`` tokens a group), at most one
      a candidate it gathered (counted so: an upper bound).
    - ``_check``: the PASS1 rows, whole (the walk's first check); the others leave at once.
    - ``_finish``: the candidate list (workspace, not the logits) where it decides the row; a
      PASS1 row's chunk winners (workspace), and with top_p a pass more per rejection of the
      walk (data-dependent: ``at_least``); a row past the list (over CAP candidates), whole, at
      least (top_k over the row).
    """
    row = plan.n_cols * itemsize
    live = states != ROW_STATE_DONE
    pass1 = int((states == ROW_STATE_PASS1).sum())
    if launch.name == "_stats_merge":
        return Reads(plan.n_rows * row, "every row")
    if launch.name == "_gather":
        nbytes, what = 0, []
        if launch.flags.get("WITH_PASS1") and pass1:
            nbytes, what = pass1 * row, [f"{pass1} PASS1 rows"]
        if launch.flags.get("GATHER"):
            listed = live & (states != ROW_STATE_PASS1) & (counts <= CAP)
            groups = counts[listed].clamp(max=plan.n_chunks * plan.groups)
            group_bytes = plan.chunk // plan.groups * itemsize
            nbytes += int(groups.sum()) * group_bytes
            if int(listed.sum()):
                what.append(f"<= {float(groups.float().mean()):.0f} groups of {group_bytes} B a row")
        return Reads(nbytes, ", ".join(what) or "none")
    if launch.name == "_check":
        return Reads(pass1 * row, f"{pass1} PASS1 rows")
    if launch.name == "_finish":
        listed = live & (states != ROW_STATE_PASS1)
        whole, rejections = int((listed & (counts > CAP)).sum()), pass1 > 0 and top_p < 1
        what = [f"{n} {label}" for n, label in ((int(listed.sum()) - whole, "rows' lists"),
                                                (pass1, "PASS1 rows' chunk winners"),
                                                (whole, "rows past the list, whole")) if n]
        if rejections:
            what.append("a pass a walk rejection")
        return Reads(whole * row, ", ".join(what), at_least=whole > 0 or rejections)
    raise ValueError(f"{launch.name}: no read model (random_val mode is not a case of this bench)")


def kernel_times(call: Call, repeats: int) -> dict[tuple[str, int], float]:
    """Median device us of each launch of ``call`` (by kernel and its turn in the call), from
    torch.profiler's kernel records over ``repeats`` calls, L2 flushed before each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    names = {launch.name for launch in call.launches()}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=call.logits.device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            flush.zero_()
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not any(e.name.startswith(tuple(names)) for e in kernels):  # said, not left as empty cells
        print(f"no kernel of {sorted(names)} among the profiled: {sorted({e.name for e in kernels})[:10]}",
              file=sys.stderr)
    times, turn = defaultdict(list), defaultdict(int)
    for e in kernels:
        name = next((n for n in names if e.name == n or e.name.startswith(n + "_")), None)
        if name is None:
            continue
        if name == KERNEL_NAMES[0]:  # every call starts with the merge
            turn.clear()
        times[(name, turn[name])].append(e.time_range.elapsed_us())
        turn[name] += 1
    return {key: statistics.median(values) for key, values in times.items()}


def graph_us(call: Call) -> float:
    """Device us of the call's CUDA graph replayed (median, L2 flushed: bench.harness)."""
    workspace = call.new_workspace()
    call(workspace)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(workspace)
    return median_us(graph.replay)


def copy_us(logits: torch.Tensor) -> float:
    """Median us of a device-to-device copy of ``logits``' size (bench.harness)."""
    src, dst = logits.clone(), torch.empty_like(logits)
    return median_us(lambda: dst.copy_(src))


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _passes(r: Reads, logits_bytes: int) -> str:
    return f"{'>= ' if r.at_least else ''}{r.nbytes / logits_bytes:.2f}"


def breakdown(shapes, backend: str, device: torch.device, repeats: int | None) -> list[str]:
    """The two Markdown tables (per launch, per call) for ``shapes`` x DTYPES x CASES; ``repeats``
    None: no timings (the smoke run)."""
    gen = torch.Generator(device=device).manual_seed(0)
    launch_rows = ["| shape | dtype | case | launch | grid | reads | of the logits | passes | device us |",
                   "|---|---|---|---|---|---|---:|---:|---:|"]
    call_rows = ["| shape | dtype | case | launches | passes | launches' sum us | graph replay us | "
                 "read-once limit us | x limit |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for rows, vocab in shapes:
        for dtype_name, dtype in DTYPES.items():
            logits = torch.randn(rows, vocab, device=device, generator=gen).to(dtype)
            logits_bytes = logits.numel() * logits.element_size()
            shape = f"{rows}x{vocab}"
            limit = copy_us(logits) / 2 if repeats else None  # the copy reads and writes the bytes
            for case, params in CASES.items():
                call = Call(logits, params, backend)
                launches = call.launches()
                states, counts = call.row_states()
                times = kernel_times(call, repeats) if repeats else {}
                turns, total, summed, at_least = defaultdict(int), 0, 0.0, False
                for launch in launches:
                    r = reads(launch, call.plan, states, counts, logits.element_size(), params.get("top_p", 1.0))
                    us = times.get((launch.name, turns[launch.name]))
                    turns[launch.name] += 1
                    total, at_least = total + r.nbytes, at_least or r.at_least
                    summed += us or 0.0
                    launch_rows.append(f"| {shape} | {dtype_name} | {case} | {launch.name} | {list(launch.grid)} | "
                                       f"{r.what} | {_bytes(r.nbytes)} | {_passes(r, logits_bytes)} | "
                                       f"{'-' if us is None else f'{us:.1f}'} |")
                passes = _passes(Reads(total, "", at_least), logits_bytes)
                if repeats:
                    replay = graph_us(call)
                    timing = f"{summed:.1f} | {replay:.1f} | {limit:.1f} | {replay / limit:.1f}"
                else:
                    timing = "- | - | - | -"
                call_rows.append(f"| {shape} | {dtype_name} | {case} | {len(launches)} | {passes} | {timing} |")
                print(call_rows[-1], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return launch_rows + [""] + call_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the tables to this file")
    parser.add_argument("--repeats", type=int, default=200, help="profiled calls a case (median)")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU, interpreted, at 2x1000: the launches and their reads, no timings")
    args = parser.parse_args(argv)
    if args.smoke:
        device, backend, shapes, repeats = torch.device("cpu"), "interpret", SMOKE_SHAPES, None
        title = "smoke run (CPU, interpreted): launches and reads only, no timings"
    else:
        if not torch.cuda.is_available():
            print("bench.sample_breakdown needs a CUDA device (or --smoke)", file=sys.stderr)
            return 2
        device, backend, shapes, repeats = torch.device("cuda"), "triton", SHAPES, args.repeats
        title = (f"{torch.cuda.get_device_name(device)}, {datetime.date.today()}, torch {torch.__version__}; "
                 f"device us: torch.profiler kernel medians of {repeats} calls, L2 flushed before each; graph "
                 f"replay: bench.harness median_us; read-once limit: logits bytes / copy bandwidth (a "
                 f"device-to-device copy of the logits' size)")
    lines = [title, ""] + breakdown(shapes, backend, device, repeats)
    print_table(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
