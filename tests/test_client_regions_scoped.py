"""Regions of clients that share a caller, against a real server process with no bearer tokens
(every client is then the same caller on the server). Issue 37: two clients that both register
"logits" collided (ALREADY_EXISTS); one client's ``unregister()`` dropped every region of the
caller, the other clients' included (NOT_FOUND mid-use); and a client kept regions the server
no longer had in its table, with the memory behind them.

Now each client scopes its names (the server's name is ``<scope>.<name>``), ``unregister()``
without a name unregisters what this client registered (``all_of_caller=True`` is the server's
empty-name unregister), a NOT_FOUND for a region registered through the client drops it from
the table and says so, and ``reconcile_regions()`` drops what the server no longer has.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import numpy as np
import pytest

from logitserve.client import AsyncClient, Client, LogitServeError, regions
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

B, V = 4, 64


@pytest.fixture(scope="module")
def server():
    from logitserve.server.process import ServerProcess

    with ServerProcess("--warmup-dtypes", "none") as s:
        yield s


@pytest.fixture
def host():
    """Shared buffers of random logits (``logits(seed)``) and of outputs (``outputs()``: room for
    B int64 tokens), closed and unlinked after the test."""
    made = []

    def logits(seed):
        buf = regions.shared_array((B, V), "float32")
        buf.array[:] = np.random.default_rng(seed).standard_normal((B, V)) * 3
        made.append(buf)
        return buf

    def outputs():
        buf = regions.shared_array((B,), "int64")
        made.append(buf)
        return buf

    yield logits, outputs
    for buf in made:
        buf.close()
        buf.unlink()


def test_two_clients_register_the_same_name_and_one_unregister_leaves_the_other(server, host):
    logits, outputs = host
    a_logits, b_logits, b_tokens = logits(1), logits(2), outputs()
    with Client(server.target, timeout=60) as a, Client(server.target, timeout=60) as b:
        a.register("logits", a_logits)
        b.register("logits", b_logits)  # before: ALREADY_EXISTS, the name was a's
        b.register("tokens", b_tokens)
        assert a.region_scope != b.region_scope
        assert [s.name for s in a.shared_memory_status()] == ["logits"]
        assert [(s.name, s.server_name) for s in b.shared_memory_status()] == [
            ("logits", f"{b.region_scope}.logits"), ("tokens", f"{b.region_scope}.tokens")]
        # Every region of the caller: a's under its own names, b's under the server's.
        assert sorted(s.name for s in a.shared_memory_status(all_of_caller=True)) == sorted([
            "logits", f"{b.region_scope}.logits", f"{b.region_scope}.tokens"])

        assert a.unregister() == ["logits"] and a.registered == []
        # b's regions are still there: its logits are read and its tokens written in place.
        got = b.sample(b_logits.array, temperature=0, out={"token_ids": b_tokens.array})
        assert got.token_ids is b_tokens.array
        assert b_tokens.array.tolist() == b_logits.array.argmax(axis=1).tolist()
        assert b.registered == ["logits", "tokens"]
        assert [s.name for s in b.shared_memory_status()] == ["logits", "tokens"]
        del got
    with Client(server.target, timeout=60) as c:
        assert c.shared_memory_status(all_of_caller=True) == []  # b's unregistered when it closed


def test_all_of_caller_drops_every_clients_regions_and_a_not_found_drops_the_entry(server, host):
    logits, outputs = host
    a_logits = logits(3)
    b_logits = regions.shared_array((B, V), "float32")  # the test keeps no other reference
    b_logits.array[:] = np.random.default_rng(4).standard_normal((B, V))
    expect = b_logits.array.argmax(axis=1).tolist()
    with Client(server.target, timeout=60) as a, Client(server.target, timeout=60) as b:
        a.register("logits", a_logits)
        b.register("logits", b_logits)
        b.register("tokens", outputs())
        assert a.unregister(all_of_caller=True) == sorted(
            ["logits", f"{b.region_scope}.logits", f"{b.region_scope}.tokens"])
        assert a.registered == [] and b.registered == ["logits", "tokens"]

        with pytest.raises(LogitServeError) as info:
            b.sample(b_logits.array, temperature=0)
        assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.dropped == ("logits",)
        assert "the server no longer has region 'logits': dropped from this client's registered" in str(info.value)
        del info
        assert b.registered == ["tokens"]
        # Now not in a region of the client: sent as bytes, and right.
        assert b.sample(b_logits.array, temperature=0).token_ids.tolist() == expect
        # The table no longer keeps the buffer alive.
        gone = weakref.ref(b_logits)
        b_logits.close()
        b_logits.unlink()
        del b_logits
        gc.collect()
        assert gone() is None

        assert b.reconcile_regions() == ["tokens"] and b.registered == []
        assert b.reconcile_regions() == [] and b.unregister() == []


def test_names_are_translated_everywhere_and_stale_ones_leave_the_table(server, host):
    logits, _ = host
    x, shared = logits(5), logits(6)
    with Client(server.target, timeout=60) as c, Client(server.target, timeout=60) as other, \
            grpc.insecure_channel(server.target) as channel:
        c.register("x", x)
        [status] = c.shared_memory_status("x")
        assert (status.name, status.server_name, status.byte_size) == ("x", f"{c.region_scope}.x", x.byte_size)
        # References the caller builds name its regions by its names: a Tensor, an operator's
        # request given whole to step, a StepRequest in a stream.
        ref = regions.region_tensor("x", "float32", [2, V], offset=V * 4)
        expect = c.softmax(np.array(x.array[1:3]))
        assert np.array_equal(c.softmax(ref), expect)
        assert np.array_equal(c.step(softmax=pb.SoftmaxRequest(x=ref)).softmax, expect)
        [streamed] = c.stream_steps([pb.StepRequest(id="s", softmax=pb.SoftmaxRequest(x=ref))])
        assert np.array_equal(streamed.softmax, expect)

        # A global name is the name itself: a raw stub names it too, and another client of the
        # caller reaches it only by asking for the global name.
        c.register("shared", shared, global_name=True)
        assert c.server_name("shared") == "shared" and c.registered == ["x", "shared"]
        raw = pb_grpc.LogitServeStub(channel).Softmax(
            pb.SoftmaxRequest(x=regions.region_tensor("shared", "float32", [B, V])))
        assert list(raw.out.shape) == [B, V]
        assert other.unregister("shared") == []
        assert other.shared_memory_status("shared", global_name=True)[0].server_name == "shared"

        # The server drops everything (another client, all_of_caller): a status or unregister by
        # name finds out, and the entry leaves the table; a stream step too.
        other.unregister(all_of_caller=True)
        with pytest.raises(LogitServeError) as info:
            c.shared_memory_status("x")
        assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.dropped == ("x",)
        assert c.unregister("shared") == [] and c.registered == []
        c.register("x", x)
        other.unregister(all_of_caller=True)
        with pytest.raises(LogitServeError) as info:
            list(c.stream_steps([{"softmax": {"x": x.array}}]))
        assert info.value.dropped == ("x",) and c.registered == []


def test_scopes_are_chosen_or_turned_off_and_names_are_checked(server):
    with Client(server.target, region_scope="frontend-1") as named, Client(server.target, region_scope=None) as bare:
        assert named.server_name("logits") == "frontend-1.logits"
        assert bare.server_name("logits") == "logits" and bare.region_scope is None
        assert named.server_name("logits", global_name=True) == "logits"
        with pytest.raises(ValueError, match=r"name: 120 characters; with this client's scope 'frontend-1\.' "
                                             r"the server's name would be 131, over its limit of 128"):
            named.register_system("n" * 120, "key", 8)
        assert bare.server_name("n" * 120) == "n" * 120
        with pytest.raises(ValueError, match=r"name: 'a/b' is not a valid region name"):
            named.shared_memory_status("a/b")
        with pytest.raises(ValueError, match="give a name or all_of_caller=True, not both"):
            bare.unregister("x", all_of_caller=True)
    with pytest.raises(ValueError, match="region_scope: '' is not a valid region name"):
        Client(server.target, region_scope="")


def test_async_client_unregisters_its_own_and_finds_what_the_server_dropped(server, host):
    logits, _ = host
    mine, theirs = logits(7), logits(8)

    async def main():
        with Client(server.target, timeout=60) as other:
            async with AsyncClient(server.target, timeout=60) as ac:
                await ac.register("logits", mine)
                other.register("logits", theirs)
                assert await ac.unregister() == ["logits"]
                assert [s.name for s in other.shared_memory_status()] == ["logits"]
                await ac.register("logits", mine)
                other.unregister(all_of_caller=True)
                with pytest.raises(LogitServeError) as info:
                    await ac.softmax(mine.array)
                assert info.value.dropped == ("logits",) and ac.registered == []
                await ac.register("a", mine)
                await ac.register("b", theirs)
                other.unregister(all_of_caller=True)
                assert await ac.reconcile_regions() == ["a", "b"] and ac.registered == []

    asyncio.run(main())


def test_a_not_found_quoting_two_long_names_alike_drops_neither(server):
    """The server quotes a name cut at 64 characters: two registrations whose quotes are alike
    cannot be told apart, so neither is dropped (reconcile_regions() settles it)."""
    with Client(server.target) as c:
        table = c._regions
        for suffix in ("a", "b"):
            table.add(("n" * 70) + suffix, regions.SYSTEM)
        named = table.registrations()
        quote = repr(c.server_name("n" * 70 + "a")[:64] + "...")
        error = LogitServeError(grpc.StatusCode.NOT_FOUND, f"x.region: no region {quote} registered (by this caller)")
        assert c._forgetting_missing(named)(error) is error and len(c.registered) == 2
        assert c.reconcile_regions() == ["n" * 70 + "a", "n" * 70 + "b"] and c.registered == []
