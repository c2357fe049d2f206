"""A same-host channel over its life: --max-channels and idle expiry (a client re-opens its
channel transparently), a drain with a channel call in flight, a server gone or restarted under
its clients, and client processes killed mid-call or holding channels (SIGKILL: no CloseChannel,
no unregistering), after which the server serves on and its counters come back to 0.

Dying clients are real processes, and so is the server that is killed; otherwise the server runs
in this process (its counters read directly), with the surviving clients.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from channel_raw import assert_same, close_channel, open_channel

from logitserve.client import Client, LogitServeError
from logitserve.client.same_host import SameHost
from logitserve.server import ServerConfig
from logitserve.server.process import ServerProcess
from logitserve.server.testing import ServerThread
from logitserve.v1 import channel_format as fmt
from logitserve.v1 import logitserve_pb2 as pb

X = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)


def _server(**options) -> ServerThread:
    return ServerThread(ServerConfig(host="127.0.0.1", port=options.pop("port", 0), device="cpu", backend="torch",
                                     warmup_dtypes=(), **options))


def _fails(call) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        call()
    return info.value


def _wait_until(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_max_channels(caplog):
    """Past --max-channels a client calls over gRPC, says so once, and takes a channel once one is free."""
    with _server(max_channels=2) as server, Client(server.target, timeout=20) as over_grpc:
        expected = over_grpc.sample(X, seed=1)
        first = Client(server.target, channel="shm", retries=0, timeout=20)
        second = Client(server.target, channel="shm", retries=0, timeout=20)
        third = Client(server.target, channel=SameHost(reopen_after_s=0.1), retries=0, timeout=20)
        try:
            for client in (first, second):
                assert_same(client.sample(X, seed=1), expected)
            with caplog.at_level(logging.WARNING, logger="logitserve.client"):
                for _ in range(3):
                    assert_same(third.sample(X, seed=1), expected)  # over gRPC
                    assert not third._same_host.is_open
            [said] = [record.getMessage() for record in caplog.records if record.name == "logitserve.client"]
            assert said == ("channel='shm': no same-host channel, calling over gRPC (OpenChannel: RESOURCE_EXHAUSTED: "
                            "channels: 2 open, this server's limit is 2 (--max-channels); close unused ones "
                            "(CloseChannel) or call over gRPC); asking again every 0.1 s")
            first.close()  # CloseChannel: its place is free, and the third takes it when it asks again
            _wait_until(lambda: third.sample(X, seed=1) and third._same_host.is_open, 10, "no channel taken")
            assert_same(third.sample(X, seed=1), expected)
            assert server.service.channels.open_channels == 2
        finally:
            for client in (first, second, third):
                client.close()
        assert server.service.channels.open_channels == 0


def test_an_idle_channel_is_closed_at_the_next_open_and_its_client_reopens():
    with _server(channel_idle_s=0.3) as server, Client(server.target, timeout=20) as over_grpc, \
            Client(server.target, channel="shm", retries=0, timeout=20) as idle, \
            Client(server.target, channel="shm", retries=0, timeout=20) as other:
        expected = over_grpc.sample(X, seed=2)
        assert_same(idle.sample(X, seed=2), expected)
        old_key = idle._same_host.key
        time.sleep(0.5)
        assert open_channel(server.target).idle_timeout_s == 0.3  # this open sweeps the idle channel
        assert server.service.channels.open_channels == 1
        # The server no longer knows its key: the client opens a new channel and the call succeeds.
        assert_same(idle.sample(X, seed=2), expected)
        assert idle._same_host.key not in (None, old_key)
        assert_same(other.sample(X, seed=2), expected)
        assert server.service.channels.open_channels == 3


def test_an_idle_channel_is_closed_without_another_open():
    """The server sweeps idle channels on its own (a quarter of the idle time apart), so a dead
    client's channel goes though no one opens another."""
    with _server(channel_idle_s=0.2) as server, Client(server.target, channel="shm", timeout=20) as client:
        client.server_info()
        assert server.service.channels.open_channels == 1
        time.sleep(0.6)
        assert server.service.channels.open_channels == 0
        assert client.server_info().version  # and its client opens a new one


def test_drain_with_a_channel_call_in_flight():
    """The launch in flight is held on an event (not a sleep, which a loaded machine outran) until
    a late call has been refused; its answer, sent as the drain ends, reaches its caller."""
    server = _server(grace_period_s=5.0)
    service = server.service
    port = server.port
    in_flight = Client(server.target, channel="shm", retries=0, timeout=20)
    late = Client(server.target, channel="shm", retries=0, timeout=20)
    release = threading.Event()
    try:
        with Client(server.target, timeout=20) as over_grpc:
            expected = over_grpc.sample(X, seed=3)
        late.server_info()  # its channel open before the drain
        service.handle.before_launch = lambda calls: release.wait(20)
        answers = {}
        launches = service.batcher.launches

        def call_in_flight():
            try:
                answers["got"] = in_flight.sample(X, seed=3)
            except LogitServeError as exc:
                answers["error"] = exc
        call = threading.Thread(target=call_in_flight)
        call.start()
        _wait_until(lambda: service.guard.running == 1 and service.batcher.launches > launches, 10,
                    "no call in flight")
        stopper = threading.Thread(target=server.close, args=(5.0,))
        started = time.monotonic()
        stopper.start()
        _wait_until(lambda: service.draining, 5, "the drain did not start")
        error = _fails(lambda: late.sample(X, seed=3))
        assert (error.code, error.details) == (grpc.StatusCode.UNAVAILABLE,
                                               "server is draining; retry on another replica")
        assert call.is_alive()  # refused while the call in flight still ran
        release.set()
        call.join(10)
        assert "error" not in answers, answers
        assert_same(answers["got"], expected)  # answered within the grace period
        stopper.join(30)
        assert time.monotonic() - started < 5.0
        # The server is gone: UNAVAILABLE at once, over the channel and on re-opening it.
        for attempt in range(2):
            started = time.monotonic()
            error = _fails(lambda: late.sample(X, seed=3, timeout=10))
            assert error.code == grpc.StatusCode.UNAVAILABLE, error
            assert time.monotonic() - started < 2.0
        # A server started again on the port: the same client opens a channel to it (retrying
        # while gRPC's connection backs off from the refusals).
        late.retries = 10
        with _server(port=port) as again:
            assert_same(late.sample(X, seed=3), expected)
            assert again.service.channels.open_channels == 1
    finally:
        release.set()
        in_flight.close()
        late.close()
        server.close()


def test_a_call_past_the_grace_period_ends_as_over_grpc():
    """Calls still running when the drain's grace period ends: UNAVAILABLE with the guard's
    message over both transports (never CANCELLED, nor the channel's "server has gone")."""
    server = _server()
    service = server.service
    try:
        with Client(server.target, retries=0, timeout=20) as over_grpc, \
                Client(server.target, channel="shm", retries=0, timeout=20) as over_shm:
            over_shm.server_info()
            service.handle.before_launch = lambda calls: time.sleep(1.5)
            errors = {}

            def call(client):
                errors[client] = _fails(lambda: client.sample(X, seed=3))
            callers = [threading.Thread(target=call, args=(client,)) for client in (over_grpc, over_shm)]
            for caller in callers:
                caller.start()
            _wait_until(lambda: service.guard.running == 2, 10, "the calls never arrived")
            server.close(0.2)
            for caller in callers:
                caller.join(10)
            assert errors[over_shm].code == grpc.StatusCode.UNAVAILABLE
            assert errors[over_shm].details == errors[over_grpc].details
            assert "grace period ended" in errors[over_shm].details
    finally:
        server.close()


def test_a_killed_server_is_unavailable_not_a_hang():
    """A server process killed (SIGKILL: no drain, its ports never closed) with a channel call in
    flight: that call and the next end UNAVAILABLE soon, as over gRPC, not at their deadlines."""
    with ServerProcess("--warmup-dtypes", "none", launch_delay_ms=1500) as server, \
            Client(server.target, channel="shm", retries=0, timeout=6) as client:
        client.server_info()
        errors = {}
        caller = threading.Thread(target=lambda: errors.update(in_flight=_fails(lambda: client.sample(X, seed=1))))
        caller.start()
        time.sleep(0.3)
        killed = time.monotonic()
        server.kill()
        caller.join(30)
        assert errors["in_flight"].code == grpc.StatusCode.UNAVAILABLE, errors["in_flight"]
        assert time.monotonic() - killed < 3.0
        started = time.monotonic()
        assert _fails(lambda: client.sample(X, seed=1)).code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 3.0


class _LooksJustBeforeTheAnswer:
    """A real pending call whose first look for its answer finds none and returns just after the
    server has answered it: the thread switch that the drain test above met now and then (the
    server answers, then lets go of the request, which reads as not connected), made certain."""

    def __init__(self, pending):
        self._pending, self._looked = pending, False

    def receive(self):
        response = self._pending.receive()
        if response is None and not self._looked:
            self._looked = True
            _wait_until(lambda: self._pending.has_response, 5, "the server never answered")
        return response

    @property
    def is_connected(self) -> bool:
        return self._pending.is_connected


def test_an_answer_that_lands_just_after_a_look_is_not_lost():
    """A server that answers and lets go of the request is not a server that has gone."""
    with _server() as server, Client(server.target, channel="shm", retries=0, timeout=20) as client:
        expected = client.server_info()
        same_host = client._same_host
        ports = same_host._ports
        request = fmt.request(ports.key, fmt.METHOD_NUMBERS["GetServerInfo"], b"", 0, b"")
        out = ports.client.loan_slice_uninit(len(request))
        ctypes.memmove(out.payload().data_ptr, request, len(request))
        pending = out.assume_init().send()
        ports.wake.notify()
        try:
            answer = same_host._wait(ports, _LooksJustBeforeTheAnswer(pending), time.perf_counter() + 10)
        finally:
            pending.delete()
        code, _, details, message = fmt.read_answer(answer)
        assert (code, details) == (0, "")
        assert pb.GetServerInfoResponse.FromString(bytes(message)).version == expected.version
        assert same_host.is_open


# A client process: opens a channel, registers its logits in a region of its own, says so on
# stdout, then makes the call it is asked to (mode "call": killed during it; "hold": it waits).
CLIENT = """
import json, sys
import numpy as np
from logitserve.client import Client, regions
target, mode = sys.argv[1], sys.argv[2]
client = Client(target, channel="shm", retries=0, timeout=60)
buf = regions.shared_array((2, 32), "float32")
buf.array[:] = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
client.register("logits", buf)
answer = client.sample(buf.array, seed=3)
print(json.dumps({"key": buf.key, "region": client.server_name("logits"), "channel": client._same_host.key.hex(),
                  "tokens": answer.token_ids.tolist()}), flush=True)
if mode == "call":
    sys.stdin.readline()  # the go-ahead
    client.sample(buf.array, seed=3, logprobs=4)
    print("answered", flush=True)
sys.stdin.read()
"""


def _start_client(target: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLIENT, target, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen) -> dict:
    """What a client process said once its channel was open."""
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"client process failed: {proc.stderr.read()[-2000:]}")
    return json.loads(line)


def _client_process(target: str, mode: str) -> tuple[subprocess.Popen, dict]:
    proc = _start_client(target, mode)
    return proc, _said(proc)


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()
    proc.stdin.close()


def _forget(server: ServerThread, said: dict) -> None:
    """Unregister and remove what a killed client left: its region and shared-memory object."""
    server.run(_unregister(server, said["region"]))
    try:
        os.unlink(f"/dev/shm/{said['key']}")
    except FileNotFoundError:
        pass


async def _unregister(server, name):
    return server.service.regions.unregister(name, None)


def test_a_client_killed_mid_call():
    with _server() as server, Client(server.target, timeout=20) as over_grpc, \
            Client(server.target, channel="shm", retries=0, timeout=20) as over_shm:
        service = server.service
        expected = over_grpc.sample(X, seed=3)
        over_shm.server_info()
        proc, said = _client_process(server.target, "call")
        try:
            assert said["tokens"] == expected.token_ids.tolist()
            launches = service.batcher.launches
            service.handle.before_launch = lambda calls: time.sleep(1.0)
            proc.stdin.write("\n")  # go ahead
            proc.stdin.flush()
            _wait_until(lambda: service.guard.running == 1 and service.held.total > 0
                        and service.batcher.launches > launches, 10, "the child's call never launched")
            [in_use] = [r.in_use for r in service.regions.status("", None) if r.name == said["region"]]
            assert in_use == 1  # leased by the call in flight
            _kill(proc)
            service.handle.before_launch = None
        finally:
            if proc.poll() is None:
                _kill(proc)
        # The server serves on, over both transports, while and after the dead call ends.
        assert_same(over_shm.sample(X, seed=3), expected)
        assert_same(over_grpc.sample(X, seed=3), expected)
        _wait_until(lambda: service.held.total == 0 and service.guard.running == 0 and service.held.connections == 0,
                    5, f"held {service.held.total} bytes, {service.guard.running} calls running")
        [in_use] = [r.in_use for r in service.regions.status("", None) if r.name == said["region"]]
        assert in_use == 0
        # A new client process opens a channel and gets its answers.
        newcomer, said_again = _client_process(server.target, "hold")
        try:
            assert said_again["tokens"] == expected.token_ids.tolist()
        finally:
            _kill(newcomer)
        _forget(server, said)
        _forget(server, said_again)
        assert service.regions.mapped_count == 0


def test_channels_of_killed_clients_expire_when_idle():
    """Killed clients never close their channels; with --max-channels full of them, OpenChannel
    is RESOURCE_EXHAUSTED until they have been idle --channel-idle-s, then the next open frees them."""
    with _server(max_channels=2, channel_idle_s=1.5) as server, Client(server.target, timeout=20) as over_grpc:
        expected = over_grpc.sample(X, seed=3)
        killed = []
        try:
            started = [_start_client(server.target, "hold") for _ in range(2)]  # side by side: opened together
            for proc in started:
                killed.append(_said(proc))
                _kill(proc)
            assert server.service.channels.open_channels == 2
            with pytest.raises(grpc.RpcError) as info:
                open_channel(server.target)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(1.6)
            with Client(server.target, channel="shm", retries=0, timeout=20) as after:
                assert_same(after.sample(X, seed=3), expected)
                assert server.service.channels.open_channels == 1
            # More processes die after their calls (their channels closed for them by key): the
            # ports they leave, past the service's room for 2 * --max-channels callers, do not
            # keep the next ones out.
            for _ in range(3):
                proc, said = _client_process(server.target, "hold")
                killed.append(said)
                assert said["tokens"] == expected.token_ids.tolist()
                _kill(proc)
                assert close_channel(server.target, bytes.fromhex(said["channel"]))
        finally:
            for said in killed:
                _forget(server, said)
