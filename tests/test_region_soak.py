"""Several client processes sharing one caller (no bearer tokens) register, use and unregister
regions at once, for a while (issue 37's soak, on the CPU server with system regions).

Each process (spawned) loops: logits in a new shared-memory object registered as ``"logits"``
(the same name in every process) and a poisoned output object under a fresh name per loop;
Sample (greedy, tokens written into the output region; and top-k with a seed) and Softmax
(written into the output region) through them, each answer checked against torch;
``unregister()``; the objects unlinked and dropped (unmapped once nothing keeps them).

Before the fix the processes' ``"logits"`` collided (ALREADY_EXISTS); with names of their own,
one process's ``unregister()`` dropped the others' regions mid-use (NOT_FOUND), and the regions
a process lost stayed in its table, their objects still mapped. Now: no error, every answer
right, each table back to empty after every loop and never over two, no object left mapped,
RSS flat. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import collections
import multiprocessing
import queue
import time

import numpy as np
import pytest

CLIENTS = 3
# Each client loops for SECONDS, and on until it made MIN_LOOPS loops (a slow, shared machine),
# never past MAX_SECONDS.
SECONDS = 12.0
MIN_LOOPS = 20
MAX_SECONDS = 60.0
B, V = 8, 4096  # 128 KiB of logits and 128 KiB of outputs a loop, touched: a buffer kept alive shows in RSS
# RSS is first taken after WARM_LOOPS loops or a quarter of SECONDS, whichever comes first
# (imports, gRPC's buffers and the allocator settle first).
WARM_LOOPS = 10
RSS_GROWTH_MIB = 16


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _still_mapped(keys: set[str]) -> int:
    """How many of the shared-memory objects ``keys`` this process still maps (buffers something
    keeps alive: dropped ones are unmapped)."""
    with open("/proc/self/maps") as f:
        fields = (line.split() for line in f)
        return sum(len(parts) > 5 and parts[5].startswith("/dev/shm/") and parts[5][9:] in keys for parts in fields)


def _one_loop(client, logits, out, loop: int) -> tuple[int, int, bool]:
    """Register, call, check and unregister once; returns the number of wrong answers, the size
    of the client's table while both regions were registered, and whether ``unregister()``
    answered other names than this loop's two."""
    import torch

    client.register("logits", logits)
    client.register(f"out-{loop}", out)
    peak = len(client.registered)
    x = torch.from_numpy(logits.array.copy())
    probs = out.array[:B * V * 4].view(np.float32).reshape(B, V)
    tokens = out.array[B * V * 4:].view(np.int64)
    wrong = 0
    client.sample(logits.array, temperature=0, out={"token_ids": tokens})
    wrong += not np.array_equal(tokens, torch.argmax(x, dim=-1).numpy())
    drawn = client.sample(logits.array, temperature=1.0, top_k=4, seed=loop).token_ids
    allowed = torch.topk(x, 4, dim=-1).indices.numpy()
    wrong += not all(token in row for token, row in zip(drawn, allowed))
    client.softmax(logits.array, out=probs)
    wrong += not torch.allclose(torch.from_numpy(probs), torch.softmax(x, dim=-1), atol=1e-6, rtol=1e-5)
    strays = client.unregister() != sorted(["logits", f"out-{loop}"])
    return wrong, peak, strays


def client_process(target: str, seed: int, start, results) -> None:
    """One client's loops from ``start`` (a barrier all processes pass together) on."""
    import torch  # noqa: F401  (imported before the clock starts)

    from logitserve.client import Client, LogitServeError, regions

    rng = np.random.default_rng(seed)
    errors: collections.Counter = collections.Counter()
    wrong = loops = table_max = left_max = strays = 0
    rss_before = None
    made: set[str] = set()  # the keys of every object the loops made
    with Client(target, timeout=60) as client:
        start.wait()
        began = time.monotonic()
        while (time.monotonic() < began + SECONDS or loops < MIN_LOOPS) and time.monotonic() < began + MAX_SECONDS:
            if rss_before is None and (loops == WARM_LOOPS or time.monotonic() > began + SECONDS / 4):
                rss_before = _rss_kib()
            logits = regions.shared_array((B, V), "float32")
            out = regions.shared_array((B * V * 4 + B * 8,), "uint8")
            logits.array[:] = rng.standard_normal((B, V), dtype=np.float32) * 3
            out.array[:] = 0xFF  # poisoned (NaN probabilities, token -1): every output must be written
            made.update((logits.key, out.key))
            left_max = max(left_max, len(client.registered))  # what earlier loops left in the table
            try:
                bad, peak, stray = _one_loop(client, logits, out, loops)
                wrong, strays = wrong + bad, strays + stray
                table_max = max(table_max, peak)
            except LogitServeError as exc:
                errors[exc.code.name] += 1
            if client.registered:  # only after an error: leave nothing behind for the next loop
                client.unregister()
            logits.unlink()
            out.unlink()
            # Dropped, not closed, as a CUDA tensor would be: the mapping goes when nothing keeps
            # the buffer any more, which the client's table must not do once the region is gone.
            del logits, out
            loops += 1
        seconds = time.monotonic() - began
        table_after = len(client.registered)
        rss_after, mapped_after = _rss_kib(), _still_mapped(made)
    results.put({"seed": seed, "seconds": seconds, "loops": loops, "errors": dict(errors), "wrong": wrong,
                 "strays": strays, "table_max": table_max, "left_max": left_max, "table_after": table_after,
                 "rss_before_kib": rss_before or rss_after, "rss_after_kib": rss_after,
                 "mapped_after": mapped_after})


@pytest.fixture(scope="module")
def server():
    from logitserve.server.process import ServerProcess

    with ServerProcess("--warmup-dtypes", "none") as s:
        yield s


def test_client_processes_sharing_a_caller_never_see_each_others_regions(server):
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(CLIENTS)
    results = spawn.Queue()
    procs = [spawn.Process(target=client_process, args=(server.target, seed, start, results), daemon=True)
             for seed in range(CLIENTS)]
    for proc in procs:
        proc.start()
    reports: list[dict] = []
    deadline = time.monotonic() + MAX_SECONDS + 180
    try:
        while len(reports) < CLIENTS:
            try:
                reports.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
                assert not failed, f"client processes exited with {failed}"
                assert time.monotonic() < deadline, f"{CLIENTS - len(reports)} client processes never reported"
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for r in sorted(reports, key=lambda r: r["seed"]):
        before, after = r["rss_before_kib"] / 1024, r["rss_after_kib"] / 1024
        print(f"client {r['seed']}: {r['loops']} loops in {r['seconds']:.1f} s, errors {r['errors'] or 'none'}, "
              f"{r['wrong']} wrong answers, "
              f"{r['strays']} unregister() answers naming other regions; table: {r['table_max']} at most, "
              f"{r['left_max']} left by a loop at most, {r['table_after']} at the end; "
              f"RSS {before:.1f} -> {after:.1f} MiB ({after - before:+.1f}), "
              f"{r['mapped_after']} shared-memory objects still mapped at the end")
    print(f"{CLIENTS} clients at once: {sum(r['loops'] for r in reports)} loops, "
          f"{sum(sum(r['errors'].values()) for r in reports)} errors, {sum(r['wrong'] for r in reports)} wrong answers")
    for r in reports:
        assert r["errors"] == {}, r
        assert r["wrong"] == 0 and r["strays"] == 0, r
        assert r["table_max"] == 2 and r["left_max"] == 0 and r["table_after"] == 0, r
        assert r["loops"] >= MIN_LOOPS, r
        assert r["rss_after_kib"] - r["rss_before_kib"] < RSS_GROWTH_MIB * 1024, r
        assert r["mapped_after"] == 0, r
    from logitserve.client import Client

    with Client(server.target, timeout=60) as c:
        assert c.shared_memory_status(all_of_caller=True) == []  # each client unregistered its own
