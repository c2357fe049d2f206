"""Who retries which call after UNAVAILABLE (client/retrying.py), against a fake server that fails
each method's first calls: gRPC's retry policy for the methods it can judge by name, large
requests included; the client's own loop for a Sample naming no sequences, or naming sequences
and their steps; never a Sample naming sequences without their steps (it advances them); the
attempts ``retries`` gives and the one deadline across them;
the service config the client composes (a given one's method configs kept), and deploy/'s for
other languages matching it; close() against a server that has gone.

The calls' basics (UNAVAILABLE only, ``retries`` attempts of GetServerInfo, the per-call timeout)
are tests/test_client.py's.
"""

from __future__ import annotations

import asyncio
import collections
import json
import pathlib
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from recording_server import fake_answer, recording_server

from logitserve.client import AsyncClient, Client, LogitServeError, balancing, regions, retrying
from logitserve.v1 import logitserve_pb2 as pb

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
DEPLOY_SERVICE_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "client" / "service-config.json"
LOGITS = np.zeros((2, 8), np.float32)


class Failing(grpc.GenericRpcHandler):
    """Fails the first ``failures`` calls of each method with ``code``, then answers as
    tests/recording_server.py's fake does; counts each method's calls."""

    def __init__(self, failures: int, code: grpc.StatusCode = UNAVAILABLE):
        self.failures, self.code = failures, code
        self.calls: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    def service(self, details):
        method = details.method.rsplit("/", 1)[1]

        def answer(raw, context):
            with self.lock:
                self.calls[method] += 1
                n = self.calls[method]
            if n <= self.failures:
                context.abort(self.code, f"attempt {n} fails")
            if method == "GetServerInfo":
                return pb.GetServerInfoResponse(version="fake").SerializeToString()
            return fake_answer(method, raw)

        return grpc.unary_unary_rpc_method_handler(answer)


@pytest.fixture
def failing():
    started = []

    def start(failures: int, code=UNAVAILABLE) -> tuple[Failing, str]:
        handler = Failing(failures, code)
        server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", -1)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append(server)
        return handler, f"127.0.0.1:{port}"

    yield start
    for server in started:
        server.stop(0)


def _fails(call) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        call()
    return info.value


# ------------------------------------------------------------------------------- Sample

def test_a_sample_naming_no_sequences_is_retried(failing):
    handler, target = failing(2)
    with Client(target, retries=3, timeout=30) as client:
        assert client.sample(LOGITS).token_ids.shape == (2,)
    assert handler.calls["Sample"] == 3


def test_a_sample_gets_retries_attempts_and_no_more(failing):
    handler, target = failing(5)
    with Client(target, retries=2, timeout=30) as client:
        error = _fails(lambda: client.sample(LOGITS))
    assert (error.code, error.details, handler.calls["Sample"]) == (UNAVAILABLE, "attempt 3 fails", 3)


def test_a_sample_naming_sequences_is_sent_once(failing):
    """It advances each sequence's step and output: after UNAVAILABLE the server may have drawn."""
    handler, target = failing(1)
    with Client(target, retries=3, timeout=30) as client:
        error = _fails(lambda: client.sample(LOGITS, sequence_ids=[1, 2]))
    assert (error.code, handler.calls["Sample"]) == (UNAVAILABLE, 1)

    async def main():
        async with AsyncClient(target, retries=3, timeout=30) as client:
            with pytest.raises(LogitServeError) as info:
                await client.sample(LOGITS, sequence_ids=[1, 2])
            assert info.value.code == UNAVAILABLE
            return await client.sample(LOGITS)  # the next one, naming none: retried

    handler.calls.clear()
    handler.failures = 2
    assert asyncio.run(main()).token_ids.shape == (2,)
    assert handler.calls["Sample"] == 3  # the one naming sequences; the next one's failure and its retry


def test_a_sample_naming_sequences_and_their_steps_is_retried(failing):
    """With ``sequence_steps`` the server answers a repeat with its first draw: safe to send again."""
    handler, target = failing(2)
    with Client(target, retries=3, timeout=30) as client:
        assert client.sample(LOGITS, sequence_ids=[1, 2], sequence_steps=[0, 4]).token_ids.shape == (2,)
    assert handler.calls["Sample"] == 3


# ------------------------------------------------------------------- gRPC's retry policy

def test_a_request_over_grpcs_default_retry_buffer_is_retried(failing):
    """gRPC keeps 256 KiB of a call to send it again by default: past that it would not retry."""
    handler, target = failing(1)
    x = np.ones((2, 65536), np.float32)  # 512 KiB
    with Client(target, retries=1, timeout=30) as client:
        assert client.softmax(x).shape == x.shape
    assert handler.calls["Softmax"] == 2


def test_the_deadline_covers_every_attempt(failing):
    """A deadline that passes before the next attempt ends the call DEADLINE_EXCEEDED, whoever
    retries it (gRPC for GetServerInfo, the client for Sample)."""
    handler, target = failing(100)
    with Client(target, retries=4, timeout=0.2) as client:
        for call in (client.server_info, lambda: client.sample(LOGITS)):
            started = time.monotonic()
            error = _fails(call)
            assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert time.monotonic() - started < 1.0
    # 50 ms, then 100 ms of backoff fit in 200 ms; the 200 ms after them does not: at most 3 attempts
    # (fewer where a loaded machine makes an attempt itself slow)
    assert 1 <= handler.calls["GetServerInfo"] <= 3 and 1 <= handler.calls["Sample"] <= 3


def test_retries_0_sends_each_call_once(failing):
    handler, target = failing(1)
    with Client(target, retries=0, timeout=30) as client:
        assert _fails(client.server_info).code == UNAVAILABLE
        assert _fails(lambda: client.sample(LOGITS)).code == UNAVAILABLE
    assert handler.calls == {"GetServerInfo": 1, "Sample": 1}


@pytest.mark.parametrize("given", [5, -1, True, 2.0])
def test_retries_must_fit_grpcs_policy(given):
    with pytest.raises(ValueError, match=r"^retries: must be an int in \[0, 4\] \(gRPC's retry policy makes at most "
                                         rf"5 attempts\), got {given!r}$"):
        Client("127.0.0.1:1", retries=given)


def test_a_given_method_config_is_kept_and_may_not_set_retries(failing):
    given = {"methodConfig": [{"name": [{"service": "logitserve.v1.LogitServe"}], "timeout": "7s"},
                              {"name": [{"service": "logitserve.v1.SharedMemory", "method": "SharedMemoryStatus"},
                                        {"service": "other.Service"}], "waitForReady": False}]}
    composed = json.loads(retrying.with_retry_policy(
        balancing.service_config("pick_first", {"grpc.service_config": json.dumps(given)}), 3,
        retrying.retried_by_hand(())))
    by_name = {(n["service"], n.get("method")): {k: v for k, v in c.items() if k != "name"}
               for c in composed["methodConfig"] for n in c["name"]}
    policy = retrying.retry_policy(3)
    assert by_name[("logitserve.v1.LogitServe", None)] == {"timeout": "7s"}  # Sample's: no retryPolicy
    assert by_name[("logitserve.v1.LogitServe", "Softmax")] == {"timeout": "7s", "retryPolicy": policy}
    assert by_name[("logitserve.v1.SharedMemory", "SharedMemoryStatus")] == {"waitForReady": False,
                                                                            "retryPolicy": policy}
    assert by_name[("other.Service", None)] == {"waitForReady": False}
    assert ("logitserve.v1.LogitServe", "Sample") not in by_name and ("logitserve.v1.LogitServe", "StreamSteps") \
        not in by_name
    handler, target = failing(1)  # a config gRPC takes: each method is named once
    with Client(target, options=[("grpc.service_config", json.dumps(given))], timeout=30) as client:
        assert client.server_info().version == "fake"
    assert handler.calls["GetServerInfo"] == 2

    with_policy = {"methodConfig": [{"name": [{"service": "logitserve.v1.LogitServe"}], "retryPolicy": policy}]}
    with pytest.raises(ValueError, match=r"^options: grpc.service_config: methodConfig\[0\].retryPolicy: set retries "
                                         r"with retries=, not in the service config$"):
        Client("127.0.0.1:1", options=[("grpc.service_config", json.dumps(with_policy))])


def test_a_same_host_client_retries_its_channels_calls_itself():
    """Its channel's calls do not go through gRPC's retrying, and OpenChannel is part of them:
    gRPC's policy covers the SharedMemory service and CloseChannel (tests/test_channel*.py run them)."""
    from logitserve.v1 import channel_format as fmt

    by_hand = retrying.retried_by_hand(fmt.METHOD_NUMBERS)
    composed = json.loads(retrying.with_retry_policy(balancing.service_config("pick_first", {}), 3, by_hand))
    (config,) = composed["methodConfig"]
    assert {(n["service"], n["method"]) for n in config["name"]} == {
        ("logitserve.v1.LogitServe", "CloseChannel"), *(("logitserve.v1.SharedMemory", method) for method in (
            "RegisterSystemSharedMemory", "RegisterCudaSharedMemory", "SharedMemoryStatus", "UnregisterSharedMemory"))}
    assert {"Sample", "GetServerInfo", "OpenChannel"} <= by_hand and "CloseChannel" not in by_hand


def test_deploys_service_config_retries_as_the_client_does():
    """deploy/client/service-config.json, for other languages' clients: the Python client's
    default policy. It retries every Sample: it is round_robin, under which no sequence is opened."""
    config = json.loads(DEPLOY_SERVICE_CONFIG.read_text())
    (method,) = config["methodConfig"]
    assert method["retryPolicy"] == retrying.retry_policy(3)
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]


# ------------------------------------------------------------------------------- closing

def test_close_stops_unregistering_once_the_server_is_gone():
    """One UNAVAILABLE (after gRPC's retries) says the server is gone or draining: its regions go
    with it, and close() does not spend the others' retries on it."""
    buffers = [regions.shared_array((4,), "float32") for _ in range(3)]
    try:
        with recording_server() as recorder:
            client = Client(recorder.target, timeout=30)
            for name, buf in zip("abc", buffers):
                client.register(name, buf)
            recorder.fail_unregister = True
            started = time.monotonic()
            client.close()
            assert time.monotonic() - started < 3.0
            assert client.registered == []
            assert len(recorder.requests("UnregisterSharedMemory")) == 1 + client.retries
    finally:
        for buf in buffers:
            buf.array = buf.tensor = None
            buf.shm.close()
            buf.unlink()
