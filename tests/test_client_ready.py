"""``wait_for_ready``: a client made before its server listens, whose calls wait for it (the
client's option, or one call's) instead of failing UNAVAILABLE after their retries (the
default, gRPC's and tritonclient's), against a real server started on the port a moment later;
over a same-host channel too, whose OpenChannel is what waits.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import numpy as np
import pytest

from logitserve.client import AsyncClient, Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

LOGITS = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]], np.float32)


def test_calls_made_before_the_server_listens_wait_for_it():
    """Over gRPC and over a same-host channel (whose OpenChannel waits), blocking and asyncio,
    with the client's option and with one call's."""
    holder = socket.socket()  # the port, bound and not listening: connections are refused
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    target = f"127.0.0.1:{port}"
    answers: dict = {}

    async def one_call_waits(channel):
        async with AsyncClient(target, timeout=60, channel=channel) as client:
            return await client.sample(LOGITS, temperature=0.0, wait_for_ready=True)

    with Client(target, timeout=60, wait_for_ready=True) as waiting, \
            Client(target, timeout=60, wait_for_ready=True, channel="shm") as waiting_shm, \
            Client(target, timeout=60) as default:
        started = time.monotonic()
        with pytest.raises(LogitServeError) as info:
            default.server_info()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5.0

        calls = {"grpc": lambda: waiting.sample(LOGITS, temperature=0.0),
                 "shm": lambda: waiting_shm.sample(LOGITS, temperature=0.0),
                 "grpc, one call": lambda: asyncio.run(one_call_waits("grpc")),
                 "shm, one call": lambda: asyncio.run(one_call_waits("shm"))}
        callers = [threading.Thread(target=lambda name=name, call=call: answers.update({name: call()}))
                   for name, call in calls.items()]
        for caller in callers:
            caller.start()
        time.sleep(1.0)
        assert all(caller.is_alive() for caller in callers) and not answers  # waiting, not failed
        holder.close()
        with ServerThread(ServerConfig(host="127.0.0.1", port=port, device="cpu", backend="torch",
                                       warmup_dtypes=())) as server:
            for caller in callers:
                caller.join(60)
            assert default.server_info(wait_for_ready=True).backend == "torch"
            opened = server.service.metrics.registry.get_sample_value("logitserve_requests_total",
                                                                     {"rpc": "OpenChannel"})
            assert opened == 2  # the same-host clients' calls went through their channels
    assert set(answers) == set(calls)
    for result in answers.values():
        np.testing.assert_array_equal(result.token_ids, [1, 0])


def test_a_waiting_call_still_ends_at_its_deadline():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        with Client(f"127.0.0.1:{holder.getsockname()[1]}", wait_for_ready=True) as client:
            started = time.monotonic()
            with pytest.raises(LogitServeError) as info:
                client.server_info(timeout=0.5)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0.4 < time.monotonic() - started < 3.0


def test_wait_for_ready_is_a_bool():
    with pytest.raises(TypeError, match=r"^wait_for_ready: must be True or False, got 'yes'$"):
        Client("127.0.0.1:1", wait_for_ready="yes")
    with Client("127.0.0.1:1") as client, pytest.raises(TypeError, match=r"^wait_for_ready: must be True or False"):
        client.server_info(wait_for_ready=1)
