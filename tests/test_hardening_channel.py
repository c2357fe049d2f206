"""Same-host channels under attack (issue 43 items 2 and 3) and an answer a drain lost (issue 42).

- Idle live clients kept their iceoryx2 nodes after their channels were swept: with
  --max-channels 1 the third client met a raw ``RequestResponseOpenError:
  ExceedsMaxNumberOfNodes``, and the channel opened for it stayed taken until its idle time.
- One token took every channel: another token's ``Client(channel="shm")`` then failed every
  call. A token holds at most its share (--token-share); a client that cannot have a channel
  calls over gRPC and says so once; /metrics counts channels by owner.
- A drain lost a channel call's answer: the server closed its ports right after answering, and
  iceoryx2 drops the answers its callers have not received yet with the ports (the issue's
  ``KeyError: 'got'`` on a loaded machine).

/dev/shm too small for a message (item 1): test_hardening_channel_shm.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest
from channel_raw import RawChannel, assert_same, close_channel, open_channel
from prometheus_client import generate_latest

from logitserve.client import AsyncClient, Client, LogitServeError, same_host
from logitserve.server import ServerConfig
from logitserve.server.regions import owner_of
from logitserve.server.testing import ServerThread

X = np.random.default_rng(43).standard_normal((2, 16)).astype(np.float32)
TOKEN_A, TOKEN_B = "tok-hardening-a-7d1e", "tok-hardening-b-20c4"


def _server(**options) -> ServerThread:
    return ServerThread(ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                                     **options))


def _wait_until(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _said(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "logitserve.client"]


def test_idle_live_clients_let_go_of_their_places():
    """--max-channels 1 and clients that stay alive, idle, never closed: each lets go of its
    ports when the server sweeps its channel, so the next client gets a channel."""
    with _server(max_channels=1, channel_idle_s=0.3) as server:
        clients = [Client(server.target, channel="shm", retries=0, timeout=20) for _ in range(4)]
        try:
            for client in clients:
                assert client.sample(X, seed=1).valid.all()
                assert client._same_host.is_open  # by the channel
                _wait_until(lambda: not client._same_host.is_open and server.service.channels.open_channels == 0,
                            10, "an idle channel or its ports kept")
        finally:
            for client in clients:
                client.close()


def test_a_client_whose_ports_cannot_be_made_calls_over_grpc(caplog):
    """Callers that keep their ports (a frontend that never lets go, a stopped process) take the
    service's places for callers: a new client gets no iceoryx2 error, it calls over gRPC, and
    the channel the server opened for it is closed at once."""
    with _server(max_channels=1) as server, Client(server.target, timeout=20) as over_grpc:
        expected = over_grpc.sample(X, seed=2)
        holders = []
        for _ in range(2):  # --max-channels 1: room for 2 callers' nodes beside the server's
            opened = open_channel(server.target)
            holders.append(RawChannel(opened))
            assert close_channel(server.target, opened.key)
        with Client(server.target, channel="shm", retries=0, timeout=20) as client, \
                caplog.at_level(logging.WARNING, logger="logitserve.client"):
            for _ in range(2):
                assert_same(client.sample(X, seed=2), expected)
            assert not client._same_host.is_open
            assert server.service.channels.open_channels == 0
        [said] = _said(caplog)
        assert said.startswith("channel='shm': no same-host channel, calling over gRPC (the server's channel is of "
                               "no use here: its ports cannot be made here ("), said
        assert "ExceedsMaxNumberOfNodes" in said


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    return path


def test_one_token_holds_at_most_its_share(token_file):
    with _server(max_channels=4, token_share=0.5, auth_token_file=str(token_file)) as server:
        held = [open_channel(server.target, TOKEN_A) for _ in range(2)]
        with pytest.raises(grpc.RpcError) as info:
            open_channel(server.target, TOKEN_A)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == ("channels: this token holds 2, its share of this server's 4 (--max-channels, "
                                        "--token-share); close unused ones (CloseChannel) or call over gRPC")
        with Client(server.target, token=TOKEN_B, channel="shm", retries=0, timeout=20) as b:
            assert b.server_info().version
            assert b._same_host.is_open  # B has its channel
            metrics = generate_latest(server.service.metrics.registry).decode()
            assert f'logitserve_channels_open{{owner="{owner_of("Bearer " + TOKEN_A)}"}} 2.0' in metrics
            assert f'logitserve_channels_open{{owner="{owner_of("Bearer " + TOKEN_B)}"}} 1.0' in metrics
            assert TOKEN_A not in metrics and TOKEN_B not in metrics
        assert close_channel(server.target, held[0].key, TOKEN_A)
        assert open_channel(server.target, TOKEN_A).key  # its place is free again


def test_a_client_without_a_channel_calls_over_grpc(token_file, caplog):
    """Token A holds every channel (its share is all of them): token B's channel client answers
    every call over gRPC, server_info included, and says so once."""
    with _server(max_channels=2, token_share=1.0, auth_token_file=str(token_file)) as server, \
            Client(server.target, token=TOKEN_B, timeout=20) as over_grpc:
        expected = over_grpc.sample(X, seed=3)
        for _ in range(2):
            open_channel(server.target, TOKEN_A)
        with Client(server.target, token=TOKEN_B, channel="shm", retries=0, timeout=20) as b, \
                caplog.at_level(logging.WARNING, logger="logitserve.client"):
            assert b.server_info().version
            for _ in range(3):
                assert_same(b.sample(X, seed=3), expected)
            assert not b._same_host.is_open
        assert _said(caplog) == ["channel='shm': no same-host channel, calling over gRPC (OpenChannel: "
                                 "RESOURCE_EXHAUSTED: channels: 2 open, this server's limit is 2 (--max-channels); "
                                 "close unused ones (CloseChannel) or call over gRPC); asking again every 30 s"]


def test_an_async_client_without_a_channel_calls_over_grpc(caplog):
    """The same for AsyncClient, against a server that runs without channels."""
    with _server(channels=False) as server, Client(server.target, timeout=20) as over_grpc:
        expected = over_grpc.sample(X, seed=4)

        async def calls():
            async with AsyncClient(server.target, channel="shm", retries=0, timeout=20) as client:
                answers = [await client.sample(X, seed=4) for _ in range(3)]
                return answers, client._same_host.is_open
        with caplog.at_level(logging.WARNING, logger="logitserve.client"):
            answers, is_open = asyncio.run(calls())
        for answer in answers:
            assert_same(answer, expected)
        assert not is_open
        assert _said(caplog) == ["channel='shm': no same-host channel, calling over gRPC (OpenChannel: "
                                 "FAILED_PRECONDITION: channels: this server runs with --channels off; call over "
                                 "gRPC); asking again every 30 s"]


def test_an_answer_sent_as_the_server_stops_reaches_its_caller(monkeypatch, caplog):
    """A client's first call is answered, then the server stops before the caller has looked
    (the loaded machine of issue 42): its answer reaches it all the same. The caller looks once
    the stop is over, or once the server says it waits for its answers to be read."""
    caplog.set_level(logging.INFO, logger="logitserve.channel")
    server = _server()
    service = server.service
    client = Client(server.target, channel="shm", retries=0, timeout=20)
    stopper = threading.Thread(target=server.close)
    stopping, parked = threading.Event(), threading.Event()
    looks = same_host.SameHostChannel._wait

    def waits_for_answers() -> bool:
        return any(record.getMessage() == "answers unread at stop" for record in caplog.records)

    def looks_late(self, ports, pending, deadline):
        parked.set()
        stopping.wait(10)
        _wait_until(lambda: not stopper.is_alive() or waits_for_answers(), 10, "the server never stopped")
        return looks(self, ports, pending, deadline)
    monkeypatch.setattr(same_host.SameHostChannel, "_wait", looks_late)
    answers = {}

    def call():
        try:
            answers["got"] = client.sample(X, seed=1)
        except LogitServeError as exc:
            answers["error"] = exc
    caller = threading.Thread(target=call)
    try:
        caller.start()
        # Counted once answered (metrics are written after the answer is sent).
        _wait_until(lambda: parked.is_set() and service.metrics.registry.get_sample_value(
            "logitserve_requests_total", {"rpc": "Sample"}), 10, "the call was never answered")
        stopper.start()
        stopping.set()
        caller.join(20)
        assert "error" not in answers, answers
        assert answers["got"].valid.all()
        stopper.join(10)
        assert not stopper.is_alive()
    finally:
        stopping.set()
        caller.join(10)
        client.close()
        server.close()
