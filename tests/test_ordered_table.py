"""Stream-ordered sessions' table and enqueue path off the GPU: the launch thread's work and the
session's marks replaced by stand-ins (a handle whose `enqueue` records each step and answers an
event the test passes), the rest real: bounds, the watcher retiring steps and ending a session
past its wait limit, closing, the marks freed only while no session waits, and a call serving
several marks (`repeat`) topped up as steps finish, its regions held exactly as long as needed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from logitserve.server.errors import TooLarge
from logitserve.server.ops.limits import Limits
from logitserve.server.ops.sample import SampleCall
from logitserve.server.ordered import MarkEnqueued, SessionTable, enqueue_sample
from logitserve.server.ordered import table as table_module
from logitserve.v1 import logitserve_pb2 as pb


class Event:
    def __init__(self):
        self.passed = False

    def query(self):
        return self.passed


class Gpu:
    """A session's GPU side: what was released, freed, given back."""

    class device:
        index = 0

    ipc_handle = bytes(64)

    def __init__(self, *_):
        self.released = self.freed = self.returned = 0

    def release(self):
        self.released += 1

    def give_back_streams(self):
        self.returned += 1

    def free(self):
        self.freed += 1


class Handle:
    """The device handle: `run` makes the session's Gpu, `enqueue` records each step."""

    device = torch.device("cuda", 0)
    backend = "triton"

    def __init__(self):
        self.steps: list[tuple[int, object]] = []  # (mark, step as the kernels would get it)
        self.events: dict[tuple[int, int], Event] = {}  # by (session's gpu, mark)

    async def run(self, fn, *args):
        return Gpu() if fn.__name__ == "SessionGpu" else fn(*args)

    async def enqueue(self, _fn, call, gpu, mark, _handle):
        self.steps.append((mark, call.step))
        event = self.events[id(gpu), mark] = Event()
        return event, None

    def pass_step(self, session, mark: int) -> None:
        self.events[id(session.gpu), mark].passed = True


class Regions:
    def __init__(self):
        self.holds = 1  # the handler's

    def hold(self):
        assert self.holds > 0, "held after its last holder let go"
        self.holds += 1

    def release(self):
        self.holds -= 1


def _call(step=0) -> SampleCall:
    logits = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 8], data=np.zeros((2, 8), np.float32).tobytes())
    call = SampleCall.from_pb(pb.SampleRequest(logits=logits, step=step, seed=5), Limits(max_rows=64, max_vocab=1024))
    call.regions = Regions()
    return call


@pytest.fixture
def fast_watcher(monkeypatch):
    monkeypatch.setattr(table_module, "POLL_S", 0.001)


async def _until(predicate, timeout_s=2.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def _run_steps(handle: Handle, session, marks: int) -> None:
    """The device runs marks 1 .. ``marks`` in turn (two unfinished at a time: max_steps_ahead
    2), the watcher retiring each and topping the session up."""
    for mark in range(1, marks + 1):
        handle.pass_step(session, mark)
        await _until(lambda: len(handle.steps) >= min(mark + 2, marks))
    await _until(lambda: not session.pending)


def test_bounds_per_server_and_per_token():
    async def scenario():
        table = SessionTable(Handle(), max_sessions=3, per_token=2, wait_timeout_s=5)
        await table.open("a", 0, 0)
        await table.open("a", 0, 0)
        with pytest.raises(TooLarge, match="this token holds 2"):
            await table.open("a", 0, 0)
        await table.open("b", 0, 0)
        with pytest.raises(TooLarge, match="3 open, this server's limit is 3"):
            await table.open("c", 0, 0)
        with pytest.raises(ValueError, match="max_steps_ahead: 65, must be <= 64"):
            await table.open("c", 0, 65)
        granted = await SessionTable(Handle(), 3, 3, wait_timeout_s=5).open("d", 30.0, 0)
        assert (granted.wait_timeout_s, granted.max_steps_ahead) == (5, 8)  # at most the server's

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_standing_call_is_topped_up_as_steps_finish_and_its_regions_go_at_the_end(fast_watcher):
    async def scenario():
        handle = Handle()
        table = SessionTable(handle, 4, 4, wait_timeout_s=5)
        session = await table.open("a", 0, 2)
        call = _call(step=10)
        await enqueue_sample(table, session, call, 1, repeat=5)
        call.regions.release()  # the handler lets go once answered
        await _until(lambda: len(handle.steps) == 2)  # max_steps_ahead: 2 unfinished
        await _run_steps(handle, session, 5)
        assert handle.steps == [(1, 10), (2, 11), (3, 12), (4, 13), (5, 14)]  # step + k
        assert call.regions.holds == 0 and session.next_mark == 6
        with pytest.raises(MarkEnqueued):
            await enqueue_sample(table, session, _call(), 5)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_step_waiting_past_the_limit_ends_its_session_and_closing_frees_it(fast_watcher):
    async def scenario():
        handle = Handle()
        table = SessionTable(handle, 4, 4, wait_timeout_s=0.05)
        session, other = await table.open("a", 0, 0), await table.open("b", 0, 0)
        await enqueue_sample(table, session, _call(), 1)
        await enqueue_sample(table, other, _call(), 1)
        await _until(lambda: session.ended is not None)  # neither mark came
        assert "waited" in session.ended and session.gpu.released == 1
        assert session.events.get_nowait().ended.first_broken_mark == 1
        handle.pass_step(session, 1)  # the released stream ran its step
        handle.pass_step(other, 1)
        await table.close(session, "its call ended")
        assert session.gpu.returned == 1 and len(table) == 1
        await _until(lambda: session.gpu.freed == 1)  # the other session's step had ended too: none waits

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_call_ahead_returns_at_once_and_takes_over_at_its_mark(fast_watcher):
    async def scenario():
        handle = Handle()
        table = SessionTable(handle, 4, 4, wait_timeout_s=5)
        session = await table.open("a", 0, 2)
        first, ahead = _call(step=0), _call(step=100)
        await enqueue_sample(table, session, first, 1, repeat=50)
        first.regions.release()
        await _until(lambda: len(handle.steps) == 2)
        await asyncio.wait_for(enqueue_sample(table, session, ahead, 4, repeat=2), 0.5)  # no room: promised
        ahead.regions.release()
        await _run_steps(handle, session, 5)
        assert handle.steps == [(1, 0), (2, 1), (3, 2), (4, 100), (5, 101)]
        assert first.regions.holds == 0 and ahead.regions.holds == 0 and session.next_mark == 6

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_the_regions_a_session_owns_are_unregistered_when_its_call_ends(monkeypatch, fast_watcher):
    """A real registry and system regions: the session's call ending (as a dead caller's does)
    unregisters what it owns, not the caller's other regions nor a name registered anew; an
    unknown name opens nothing."""
    from multiprocessing import shared_memory

    from logitserve.server.api.ordered import session_events
    from logitserve.server.regions import RegionNotFound, RegionRegistry

    monkeypatch.setattr(table_module, "available", lambda: None)
    objects = [shared_memory.SharedMemory(create=True, size=64) for _ in range(3)]
    registry = RegionRegistry()
    for name, shm in zip(("logits", "tokens", "other"), objects):
        registry.register_system(name, shm.name, 0, 64, owner="a")
    registry.register_system("logits", objects[0].name, 0, 64, owner="b")  # another caller's, same name

    async def scenario():
        table = SessionTable(Handle(), 4, 4, wait_timeout_s=5)
        refused = session_events(table, registry, pb.OrderedSessionRequest(owned_regions=["logits", "nope"]), "a")
        with pytest.raises(RegionNotFound, match=r"owned_regions\[1\]: no region 'nope'"):
            await refused.__anext__()
        assert not table._sessions
        events = session_events(table, registry, pb.OrderedSessionRequest(owned_regions=["logits", "tokens"]), "a")
        assert (await events.__anext__()).HasField("opened")
        registry.unregister("tokens", "a")
        registry.register_system("tokens", objects[1].name, 0, 32, owner="a")  # another region now
        await events.aclose()  # the call ends: its caller left
        names = lambda owner: [info.name for info in registry.status(owner=owner)]  # noqa: E731
        assert names("a") == ["other", "tokens"] and names("b") == ["logits"]
        await _until(lambda: not table._sessions)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        registry.close()
        for shm in objects:
            shm.close()
            shm.unlink()
