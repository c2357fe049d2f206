"""The client's ``load_balancing`` against two real in-process servers behind one target,
gRPC's address list ``ipv4:127.0.0.1:<p1>,127.0.0.1:<p2>`` (what a ``dns:///`` name resolving
to both would give, without DNS): round_robin spreads stateless calls over both and keeps
answering when one stops (its calls in flight come back UNAVAILABLE and the client's retries
send them to the other); regions and sequences, which belong to one server, are refused on a
round_robin client and work on a pick_first client of one server; pick_first (the default)
sends every call to one server. Which server served a call: each one's batcher count.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from logitserve.client import AsyncClient, Client, regions
from logitserve.client.balancing import service_config
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

VOCAB = 64


def _server() -> ServerThread:
    return ServerThread(ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=()))


@pytest.fixture
def servers():
    """Two servers; a test may stop one (close() twice is a no-op)."""
    first = _server()
    try:
        second = _server()
    except BaseException:
        first.close()
        raise
    yield first, second
    first.close()
    second.close()


def _target(servers) -> str:
    return "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


def _served(servers) -> list[int]:
    """How many Sample calls each server has served."""
    return [s.service.batcher.batched_requests if s.service is not None else None for s in servers]


def _greedy_call(client, rng) -> None:
    """One stateless Sample call (logits as bytes), checked: greedy picks each row's argmax."""
    logits = rng.standard_normal((2, VOCAB)).astype(np.float32)
    tokens = client.sample(logits, temperature=0.0).token_ids
    np.testing.assert_array_equal(tokens, logits.argmax(axis=1))


def test_round_robin_spreads_stateless_calls_over_both_servers(servers):
    rng = np.random.default_rng(0)
    before = _served(servers)
    with Client(_target(servers), load_balancing="round_robin", timeout=10) as client:
        assert client.load_balancing == "round_robin"
        for _ in range(20):
            _greedy_call(client, rng)
    served = [after - b for after, b in zip(_served(servers), before)]
    assert sum(served) == 20 and min(served) >= 5, f"calls per server: {served}"


def test_pick_first_default_sends_every_call_to_one_server(servers):
    rng = np.random.default_rng(1)
    with Client(_target(servers), timeout=10) as client:
        assert client.load_balancing == "pick_first"
        for _ in range(10):
            _greedy_call(client, rng)
    assert _served(servers) == [10, 0]  # the first address that answers: the first server


def test_calls_keep_succeeding_when_a_server_stops(servers):
    """Two threads call without pause; one server stops (no grace: its calls in flight fail
    UNAVAILABLE); every call still answers, correctly, the later ones all from the other."""
    first, second = servers
    errors: list[BaseException] = []
    done = [0, 0]
    stop = threading.Event()

    def calls(worker: int, client: Client) -> None:
        rng = np.random.default_rng(worker)
        while not stop.is_set():
            try:
                _greedy_call(client, rng)
                done[worker] += 1
            except BaseException as exc:  # noqa: BLE001  reported by the assertion below
                errors.append(exc)
                return

    with Client(_target(servers), load_balancing="round_robin", timeout=10, retries=3) as client:
        threads = [threading.Thread(target=calls, args=(w, client)) for w in range(2)]
        for t in threads:
            t.start()
        try:
            _wait(lambda: min(_served(servers)) >= 10, "both servers serving")
            second.close()
            served_by_first = first.service.batcher.batched_requests
            at_stop = sum(done)
            _wait(lambda: sum(done) >= at_stop + 40 or errors, "40 calls after the stop")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
    assert not errors, f"{len(errors)} calls failed after the stop, first: {errors[0]!r}"
    assert first.service.batcher.batched_requests >= served_by_first + 40


def _wait(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


REFUSED = {
    "register": lambda c, buf: c.register("x", buf),
    "register_system": lambda c, buf: c.register_system("x", buf),
    "register_cuda": lambda c, buf: c.register_cuda("x", bytes(64), device_id=0, byte_size=64),
    "shared_memory_status": lambda c, buf: c.shared_memory_status(),
    "unregister": lambda c, buf: c.unregister(),
    "reconcile_regions": lambda c, buf: c.reconcile_regions(),
    "open_sequences": lambda c, buf: c.open_sequences([{"id": 1, "seed": 7}]),
    "update_sequences": lambda c, buf: c.update_sequences([{"id": 1, "top_k": 5}]),
    "close_sequences": lambda c, buf: c.close_sequences([1]),
    "sample(sequence_ids=)": lambda c, buf: c.sample(np.zeros((1, VOCAB), np.float32), sequence_ids=[1]),
}


@pytest.fixture
def host_buffer():
    with regions.shared_array((4, VOCAB), "float32") as buf:
        yield buf


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_round_robin_client_refuses_regions_and_sequences(servers, host_buffer, method):
    with Client(_target(servers), load_balancing="round_robin", timeout=10) as client:
        with pytest.raises(ValueError) as info:
            REFUSED[method](client, host_buffer)
        assert client.registered == []
    message = str(info.value)
    assert message.startswith(f"{method}: regions and sequences belong to one server")
    assert "load_balancing='round_robin'" in message and "load_balancing='pick_first'" in message
    assert 'Client(f"{host}:{port}")' in message
    for server in servers:  # refused before any call: neither server holds a region or a sequence
        assert server.service.regions.mapped_count == 0
        assert server.service.sequences.stats()["open_sequences"] == 0


def test_regions_and_sequences_work_on_a_pick_first_client_per_server(servers, host_buffer):
    """What the refusal points to: a pick_first client of each server, beside round_robin's."""
    logits = np.random.default_rng(2).standard_normal((4, VOCAB)).astype(np.float32)
    host_buffer.array[:] = logits
    for server in servers:
        with Client(server.target, timeout=10) as client:
            client.register("logits", host_buffer)
            np.testing.assert_array_equal(client.sample(host_buffer.array, temperature=0.0).token_ids,
                                          logits.argmax(axis=1))
            with client.open_sequences([{"id": 1, "temperature": 0.0}]) as seqs:
                np.testing.assert_array_equal(seqs.sample(logits[:1]).token_ids, logits[:1].argmax(axis=1))
            assert server.service.regions.mapped_count == 1
        assert server.service.regions.mapped_count == 0  # unregistered on close


def test_async_client_round_robin(servers):
    rng = np.random.default_rng(3)
    logits = [rng.standard_normal((2, VOCAB)).astype(np.float32) for _ in range(20)]

    async def main():
        async with AsyncClient(_target(servers), load_balancing="round_robin", timeout=10) as client:
            with pytest.raises(ValueError, match="^open_sequences: regions and sequences belong to one server"):
                await client.open_sequences([{"id": 1}])
            return [(await client.sample(x, temperature=0.0)).token_ids for x in logits]

    tokens = asyncio.run(main())
    for x, t in zip(logits, tokens):
        np.testing.assert_array_equal(t, x.argmax(axis=1))
    assert sum(_served(servers)) == 20 and min(_served(servers)) >= 5, _served(servers)


def test_load_balancing_errors_name_the_option():
    with pytest.raises(ValueError, match=r"^load_balancing: must be one of pick_first, round_robin, got 'random'$"):
        Client("127.0.0.1:1", load_balancing="random")
    with pytest.raises(ValueError, match=r"^options: grpc.lb_policy_name: set the policy with load_balancing="):
        Client("127.0.0.1:1", options=[("grpc.lb_policy_name", "round_robin")])
    given = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
    with pytest.raises(ValueError, match=r"^options: grpc.service_config: loadBalancingConfig: set the policy"):
        Client("127.0.0.1:1", options=[("grpc.service_config", given)])
    with pytest.raises(ValueError, match=r"^options: grpc.service_config: must be JSON"):
        Client("127.0.0.1:1", options=[("grpc.service_config", "{")])


def test_service_config_keeps_the_given_one_and_adds_the_policy(servers):
    method_config = {"methodConfig": [{"name": [{"service": "logitserve.v1.LogitServe"}], "timeout": "5s"}]}
    options = {"grpc.service_config": json.dumps(method_config)}
    assert json.loads(service_config("round_robin", options)) == {
        **method_config, "loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}
    assert json.loads(service_config("pick_first", {})) == {"loadBalancingConfig": [{"pick_first": {}}]}
    rng = np.random.default_rng(4)  # the merged config is one gRPC accepts: calls spread and answer
    with Client(_target(servers), load_balancing="round_robin", options=list(options.items()), timeout=10) as client:
        for _ in range(10):
            _greedy_call(client, rng)
    assert min(_served(servers)) >= 2, _served(servers)


def test_round_robin_over_a_dns_name(servers):
    """The ``dns:///`` resolver's path takes the same service config (localhost: one address here)."""
    first, _ = servers
    with Client(f"dns:///localhost:{first.port}", load_balancing="round_robin", timeout=10) as client:
        _greedy_call(client, np.random.default_rng(5))
    assert _served(servers) == [1, 0]
