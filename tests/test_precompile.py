"""Warm-up compiled side by side in spawned processes (server/precompile.py): each (dtype, width)
share runs the server's warm-up cases in a process of its own; a share that fails is logged and
leaves the server's own warm-up to compile it. Interpreted kernels here (nothing to cache: the
mechanics); on a GPU host the point is Triton's on-disk cache (docs/PERFORMANCE.md, cold start).
"""

from __future__ import annotations

import logging
import os

from logitserve.server.precompile import precompile, processes_for


def test_processes_for():
    assert processes_for(3, 9) == 3
    assert processes_for(12, 9) == 9
    assert processes_for(None, 9) == max(1, min(9, len(os.sched_getaffinity(0)) - 1))
    assert processes_for(None, 1) == 1


def test_each_share_runs_in_a_process_and_a_failed_one_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="logitserve.precompile"):
        precompile("cpu", "interpret", ("float32", "no_such_dtype"), (48,), processes=2)
    events = {r.getMessage(): r.fields for r in caplog.records}
    assert events["precompile share failed"]["dtype"] == "no_such_dtype", events
    assert events["precompiled"] | {"seconds": None} == dict(processes=2, shares=2, failed=1, seconds=None), events


def test_one_process_compiles_nothing_ahead(caplog):
    with caplog.at_level(logging.INFO, logger="logitserve.precompile"):
        precompile("cpu", "interpret", ("float32",), (48,), processes=1)
    assert not caplog.records
