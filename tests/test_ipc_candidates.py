"""bench.ipc_candidates: each same-host channel it compares answers a few hundred real round trips
between two spawned processes with sane figures, and its idle-CPU figure tells a server that
sleeps from one that spins."""

import dataclasses
import math
import os
import time

import pytest

from bench.ipc_candidates import CANDIDATES, measure, poll_then_block, process_cpu_seconds

# pyzmq and iceoryx2 are not dependencies of the project; their rows run where they are installed.
CANDIDATE_NAMES = sorted(CANDIDATES)


@pytest.mark.parametrize("name", CANDIDATE_NAMES)
def test_candidate_answers_round_trips_with_sane_figures(name):
    pytest.importorskip(CANDIDATES[name].module, reason=f"{name}: its library is not installed here")
    figures = measure(name, round_trips=300, warmup=30, poll_us=50, idle_s=0.3)
    assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"] < 1e6, figures  # us: under a second
    assert all(math.isfinite(v) and v >= 0 for v in figures.values()), figures
    assert figures["client_cpu_us"] > 0, figures  # the client's own clock sees its calls
    assert 0 <= figures["server_idle_pct"] < 50, figures  # grpc's timers and poll-then-block both sleep


def test_idle_figure_shows_a_server_that_spins():
    # A poll budget far past the idle period: the server polls through it and holds a core.
    figures = measure("shm-reference", round_trips=100, warmup=10, poll_us=30e6, idle_s=0.5)
    assert figures["server_idle_pct"] > 30, figures


def test_missing_library_is_named_not_faked(monkeypatch):
    monkeypatch.setitem(CANDIDATES, "shm-reference", dataclasses.replace(CANDIDATES["shm-reference"],
                                                                        module="no_such_ipc_library"))
    with pytest.raises(ModuleNotFoundError, match="no_such_ipc_library: not installed"):
        measure("shm-reference", round_trips=10, warmup=0, poll_us=0)


def test_poll_then_block_polls_within_its_budget_then_blocks():
    arrivals = iter([None, None, b"message"])
    blocks = []
    # A budget far longer than three tries: the message is found by polling, no block.
    assert poll_then_block(lambda: next(arrivals), lambda: blocks.append(1), poll_ns=10**9) == b"message"
    assert blocks == []
    # No budget: one try, then block; the wake is stale once (nothing there), so it blocks again.
    arrivals = iter([None, None, b"message"])
    assert poll_then_block(lambda: next(arrivals), lambda: blocks.append(1), poll_ns=0) == b"message"
    assert blocks == [1, 1]


def test_process_cpu_seconds_counts_this_process_work():
    before, start = process_cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - start < 0.05:
        pass
    assert process_cpu_seconds(os.getpid()) - before >= 0.04
