"""``wait_for_ready``: a client made before its server listens, whose calls wait for it (the
client's option, or one call's) instead of failing UNAVAILABLE after their retries (the
default, gRPC's and tritonclient's), against a real server started on the port a moment later.
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
    holder = socket.socket()  # the port, bound and not listening: connections are refused
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    target = f"127.0.0.1:{port}"
    answers: dict = {}

    async def one_call_waits():
        async with AsyncClient(target, timeout=60) as client:
            return await client.sample(LOGITS, temperature=0.0, wait_for_ready=True)

    with Client(target, timeout=60, wait_for_ready=True) as waiting, Client(target, timeout=60) as default:
        started = time.monotonic()
        with pytest.raises(LogitServeError) as info:
            default.server_info()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5.0

        callers = [threading.Thread(target=lambda: answers.update(sync=waiting.sample(LOGITS, temperature=0.0))),
                   threading.Thread(target=lambda: answers.update(per_call=asyncio.run(one_call_waits())))]
        for caller in callers:
            caller.start()
        time.sleep(1.0)
        assert all(caller.is_alive() for caller in callers) and not answers  # waiting, not failed
        holder.close()
        with ServerThread(ServerConfig(host="127.0.0.1", port=port, device="cpu", backend="torch",
                                       warmup_dtypes=())):
            for caller in callers:
                caller.join(60)
            assert default.server_info(wait_for_ready=True).backend == "torch"
    assert set(answers) == {"sync", "per_call"}
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
