"""A processors call's CPU path (issue 45, item 5): a list in a system region is read once, by
its checks, and launched from that copy; a region shrunk under a list is refused, not read."""

from __future__ import annotations

import collections
import os

import grpc
import numpy as np
import pytest

from logitserve.client import Client, LogitServeError, regions
from logitserve.server import ServerConfig
from logitserve.server.ops import processor_checks
from logitserve.server.regions.access import SystemSlice
from logitserve.server.testing import ServerThread

VOCAB = 40


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
    with ServerThread(config) as s:
        yield s


@pytest.fixture
def lists():
    """A shared-memory object of 64 int64s (512 bytes), unlinked after the test."""
    buf = regions.shared_array((64,), "int64")
    try:
        yield buf
    finally:
        buf.array = None
        buf.shm.close()
        buf.unlink()


def _all_but(token: int) -> np.ndarray:
    return np.delete(np.arange(VOCAB, dtype=np.int64), token)


def _banned_in(buf, token: int):
    """Every token but ``token`` banned, for one row: ids and offsets in ``buf``'s array."""
    ids, offsets = buf.array[:VOCAB - 1], buf.array[VOCAB:VOCAB + 2]
    ids[:] = _all_but(token)
    offsets[:] = [0, VOCAB - 1]
    return ids, offsets


def test_a_list_in_a_system_region_is_read_once(server, lists, monkeypatch):
    """Ids and offsets in a region are each read once through the descriptor: by their checks,
    whose copy the launch takes (the launch read them a second time)."""
    reads = collections.Counter()
    read_into = SystemSlice.read_into

    def counted(self, buffer):
        reads[self.field] += 1
        read_into(self, buffer)

    monkeypatch.setattr(SystemSlice, "read_into", counted)
    ids, offsets = _banned_in(lists, 5)
    with Client(server.target) as c:
        c.register("lists", lists)
        got = c.sample(np.zeros((1, VOCAB), np.float32), seed=1, banned_token_ids=ids, banned_offsets=offsets)
    assert got.token_ids.tolist() == [5]
    assert reads == {"banned_token_ids": 1, "banned_offsets": 1}


def test_the_launch_reads_the_checked_values(server, lists, monkeypatch):
    """A client rewriting its list between the call's checks and its launch: the launch reads
    what was checked (it read the region again, and launched the new list unchecked)."""
    run = processor_checks.BulkChecks.run
    ids, offsets = _banned_in(lists, 5)

    def then_rewritten(checks):
        run(checks)
        ids[:] = _all_but(9)

    monkeypatch.setattr(processor_checks.BulkChecks, "run", then_rewritten)
    with Client(server.target) as c:
        c.register("lists", lists)
        got = c.sample(np.zeros((1, VOCAB), np.float32), seed=1, banned_token_ids=ids, banned_offsets=offsets)
    assert got.token_ids.tolist() == [5]


@pytest.mark.parametrize("when", ("before the call", "before its checks"))
def test_a_list_in_a_shrunk_region_is_refused(server, lists, monkeypatch, when):
    """The object under a registered list cut short, before the call (its lease refuses it) or
    once the call holds its lease, before the checks read the list (the read comes short):
    INVALID_ARGUMENT naming the field and the shrink; the server answers the next call."""
    ids, offsets = _banned_in(lists, 5)
    fd = os.open(f"/dev/shm/{lists.shm.name.lstrip('/')}", os.O_RDWR)
    run = processor_checks.BulkChecks.run

    def shrunk_first(checks):
        os.ftruncate(fd, 64)
        run(checks)

    if when == "before its checks":
        monkeypatch.setattr(processor_checks.BulkChecks, "run", shrunk_first)
    try:
        with Client(server.target) as c:
            c.register("lists", lists)
            if when == "before the call":
                os.ftruncate(fd, 64)
            with pytest.raises(LogitServeError) as info:
                c.sample(np.zeros((1, VOCAB), np.float32), seed=1, banned_token_ids=ids, banned_offsets=offsets)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            field = "banned_token_ids" if when == "before the call" else "banned_offsets"
            assert info.value.details.startswith(f"{field}.region: the shared-memory object"), info.value.details
            assert "shrank to 64 bytes" in info.value.details
            monkeypatch.setattr(processor_checks.BulkChecks, "run", run)
            os.ftruncate(fd, 512)  # back, its bytes lost: written again
            ids, offsets = _banned_in(lists, 5)
            got = c.sample(np.zeros((1, VOCAB), np.float32), seed=1, banned_token_ids=ids, banned_offsets=offsets)
            assert got.token_ids.tolist() == [5]
    finally:
        os.close(fd)
