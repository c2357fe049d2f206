"""Source trees measured beside this one: another commit's ``src/`` put first on a subprocess's
path, and a per-call figure measured in each tree's subprocess, the trees in turn.

A tree is a directory holding ``src/logitserve`` (``bash scripts/tree_at.sh REV DIR``). A bench
module that measures in place of a tree answers ``--measure`` with one JSON line ``{"us": x}``;
:func:`interleaved` runs it a round at a time, each tree once a round, so that the host's drift
falls between rounds rather than between trees.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tree_env(src) -> dict:
    """This environment with ``src`` first on PYTHONPATH in place of this checkout's own src/ (the
    other entries stay: the lent GPU machine's wheels are found there, scripts/device_env.sh)."""
    own = str(ROOT / "src")
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != own]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), *kept]))


def interleaved(module: str, trees: list[pathlib.Path], rounds: int, args: list[str]) -> list[list[float]]:
    """Per tree, the ``us`` of ``python -m module --measure *args`` run in it once a round (one
    torch thread: the host work is measured, not OpenMP's scheduling on a shared machine)."""
    figures: list[list[float]] = [[] for _ in trees]
    for _ in range(rounds):
        for i, tree in enumerate(trees):
            out = subprocess.run([sys.executable, "-m", module, "--measure", *args],
                                 env=dict(tree_env(tree / "src"), OMP_NUM_THREADS="1"), cwd=ROOT,
                                 capture_output=True, text=True, check=True)
            figures[i].append(json.loads(out.stdout.splitlines()[-1])["us"])
    return figures


def table(trees: list[pathlib.Path], figures: list[list[float]], digits: int = 0) -> list[str]:
    """A row a tree: the median over its rounds, then every round's figure."""
    return [f"| {tree} | {statistics.median(values):,.{digits}f} | {' '.join(f'{v:.0f}' for v in values)} |"
            for tree, values in zip(trees, figures)]
