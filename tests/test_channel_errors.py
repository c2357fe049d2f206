"""The same-host channel's failures are gRPC's: a bad request, one over --max-rows / --max-vocab
/ --max-message-bytes, a region that does not exist, an answer over the limit, a deadline that
passes while the device is busy: the same status code and message over both transports (the
same bytes sent raw, and through the clients). Malformed channel requests (short, unknown
method, request id past the end, not the method's message, unknown key) are refused with a
message naming what is wrong, and the server serves on. ``--channels off``: OpenChannel is
FAILED_PRECONDITION and a channel client calls over gRPC, saying so once.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np
import pytest
from channel_raw import RawChannel, assert_same, grpc_raw, open_channel

from logitserve.client import Client, LogitServeError, messages, regions
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from logitserve.v1 import channel_format as fmt
from logitserve.v1 import logitserve_pb2 as pb

MAX_MESSAGE = 16384
X = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(), max_rows=8,
                          max_vocab=1024, max_message_bytes=MAX_MESSAGE)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def raw(server):
    return RawChannel(open_channel(server.target))


@pytest.fixture(scope="module")
def clients(server):
    with Client(server.target, timeout=20, retries=0) as over_grpc, \
            Client(server.target, timeout=20, retries=0, channel="shm") as over_shm:
        yield over_grpc, over_shm


def _tensor(shape, data=None, dtype=pb.DTYPE_FLOAT32):
    data = np.zeros(shape, np.float32).tobytes() if data is None else data
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data)


BAD_REQUESTS = {
    "empty logits": ("Sample", pb.SampleRequest(logits=_tensor((0, 8), b""))),
    "logits bytes short of the shape": ("Sample", pb.SampleRequest(logits=_tensor((2, 8), b"\0" * 60))),
    "top_p over 1": ("Sample", messages.sample_request(X, top_p=2.0)),
    "k over the experts": ("RouteExperts", messages.route_experts_request(X, 9)),
    "unknown scoring": ("RouteExperts", pb.RouteExpertsRequest(gate_logits=_tensor((2, 8)), k=2, scoring=7)),
    "softmax dim out of range": ("Softmax", messages.softmax_request(X, dim=3)),
    "causal softmax of a vector": ("CausalSoftmax", pb.CausalSoftmaxRequest(x=_tensor((8,)))),
    "swiglu shapes that do not broadcast": ("Silu", messages.swiglu_request(X, np.zeros((3, 5), np.float32))),
    "draft longer than the target": ("VerifyDraft", messages.verify_draft_request(
        np.zeros((1, 3), np.int64), np.zeros((1, 3, 8), np.float32), draft_probs=np.zeros((1, 3, 8), np.float32))),
    "an empty step": ("Step", pb.StepRequest(id="nothing")),
    "rows over --max-rows": ("Sample", messages.sample_request(np.zeros((9, 8), np.float32))),
    "rows over --max-vocab": ("Softmax", messages.softmax_request(np.zeros((1, 1025), np.float32))),
    "a region that does not exist": ("Sample", pb.SampleRequest(
        logits=regions.region_tensor("no-such-region", "float32", (2, 8)))),
    "an output region that does not exist": ("Softmax", pb.SoftmaxRequest(
        x=_tensor((2, 8)), output_regions={"out": regions.region_ref("nowhere", 64)})),
    "a sequence not open": ("Sample", pb.SampleRequest(logits=_tensor((1, 8)), sequence_ids=[424242])),
    "update of a sequence not open": ("UpdateSequences", pb.UpdateSequencesRequest(
        updates=[pb.SequenceUpdate(id=424243, temperature=0.5)])),
    "bytes that are no message": ("Sample", b"\x0a\xff\xff\xff\xff\x0f"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_fails_alike_over_both_transports(server, raw, case):
    rpc, request = BAD_REQUESTS[case]
    data = request if isinstance(request, bytes) else request.SerializeToString()
    code, details = grpc_raw(server.target, rpc, data)
    assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (code, details)
    got_code, request_id, got_details, body = raw.call(rpc, data)
    assert (got_code, got_details) == (code, details)
    assert request_id and body == b""  # the id the server gave the call; no message after a failure


def _fails(client, call) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        call(client)
    return info.value


CLIENT_ERRORS = {
    "empty logits": (grpc.StatusCode.INVALID_ARGUMENT, lambda c: c.sample(np.zeros((0, 8), np.float32))),
    "k over the experts": (grpc.StatusCode.INVALID_ARGUMENT, lambda c: c.route_experts(X, 9)),
    "bad top_p": (grpc.StatusCode.INVALID_ARGUMENT, lambda c: c.sample(X, top_p=0.0)),
    "over --max-rows": (grpc.StatusCode.RESOURCE_EXHAUSTED, lambda c: c.sample(np.zeros((9, 8), np.float32))),
    "over --max-vocab": (grpc.StatusCode.RESOURCE_EXHAUSTED, lambda c: c.silu(np.zeros((2, 1025), np.float32))),
    "no such region": (grpc.StatusCode.NOT_FOUND,
                       lambda c: c.softmax(regions.region_tensor("not-registered", "float32", (2, 8)))),
}


@pytest.mark.parametrize("case", sorted(CLIENT_ERRORS))
def test_the_clients_raise_the_same_error(clients, case):
    code, call = CLIENT_ERRORS[case]
    over_grpc, over_shm = clients
    expected, got = _fails(over_grpc, call), _fails(over_shm, call)
    assert (got.code, got.details) == (expected.code, expected.details)
    assert got.code == code
    assert over_shm._same_host.is_open  # the call went by the channel


def test_a_request_over_max_message_bytes_is_refused_resource_exhausted(server, clients, raw):
    """Requests past --max-message-bytes by a few bytes (within the channel's slack for a request
    id) and by far, through each client, and by the channel raw: RESOURCE_EXHAUSTED every way."""
    over_grpc, over_shm = clients
    just_over = np.zeros((4, MAX_MESSAGE // 16), np.float32)  # its tensor's header puts it over
    far_over = np.zeros((8, 1024), np.float32)
    at_limit = np.zeros((4, 1000), np.float32)
    assert over_shm.softmax(at_limit).shape == (4, 1000)
    for x in (just_over, far_over):
        for client in clients:
            assert _fails(client, lambda c: c.softmax(x)).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    data = messages.softmax_request(just_over).SerializeToString()
    code, _, details, _ = raw.call("Softmax", data)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == (f"request: a {len(data)}-byte message, over this server's limit of {MAX_MESSAGE} "
                       "(--max-message-bytes)")
    assert over_shm.softmax(at_limit).shape == (4, 1000)  # the channel serves on


def test_an_oversize_request_through_the_client_gets_grpcs_own_answer(clients):
    """The client sends by gRPC what the channel would refuse (OpenChannelResponse: "a larger
    request goes by gRPC"), so the two clients' errors are the same, message included. A request
    a few bytes over --max-message-bytes still fits the advertised max_request_bytes, which
    counts room for a request id the client never sends."""
    over_grpc, over_shm = clients
    just_over = np.zeros((4, MAX_MESSAGE // 16), np.float32)
    expected, got = _fails(over_grpc, lambda c: c.softmax(just_over)), _fails(over_shm, lambda c: c.softmax(just_over))
    assert (got.code, got.details) == (expected.code, expected.details)


def test_an_answer_over_max_message_bytes_fails_alike(server, clients):
    """A request naming its input in a region is small; its answer (inline) is not."""
    with regions.shared_array((8, 512), "float32") as buf:
        buf.array[:] = 1.0
        answers = []
        for client in clients:
            client.register("big", buf)
            try:
                answers.append(_fails(client, lambda c: c.softmax(buf.array)))
                answers.append(client.softmax(buf.array[:1]))  # one row's answer fits
            finally:
                client.unregister()
        buf.array = None
    grpc_error, grpc_row, shm_error, shm_row = answers
    assert (shm_error.code, shm_error.details) == (grpc_error.code, grpc_error.details)
    assert shm_error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-message-bytes" in shm_error.details
    assert_same(shm_row, grpc_row)
    _settled(server)


def _settled(server, within: float = 5.0) -> None:
    """No call running and no answer bytes held (a channel call lets go of its answer's bytes
    just after sending it, so a moment after its caller has it)."""
    deadline = time.monotonic() + within
    while server.service.held.total or server.service.guard.running:
        assert time.monotonic() < deadline, (server.service.held.total, server.service.guard.running)
        time.sleep(0.01)


@pytest.fixture
def slow_device(server):
    """Every launch takes 1 s (the device thread sleeps): calls queued behind one wait."""
    server.service.handle.before_launch = lambda calls: time.sleep(1.0)
    yield
    server.service.handle.before_launch = None


def _occupy(server, client):
    """A call in flight on the slow device (run by a thread); returns the thread."""
    launches = server.service.batcher.launches
    busy = threading.Thread(target=client.sample, args=(X,), kwargs=dict(seed=1))
    busy.start()
    deadline = time.monotonic() + 10
    while server.service.guard.running == 0 or server.service.batcher.launches == launches:
        assert time.monotonic() < deadline, "the first call never launched"
        time.sleep(0.005)
    return busy


def test_a_deadline_that_passes_behind_a_busy_device(server, clients, raw, slow_device):
    over_grpc, over_shm = clients
    over_shm.server_info()  # opened before the clock starts
    with Client(server.target, timeout=20) as occupier:
        busy = _occupy(server, occupier)
        started = time.monotonic()
        error = _fails(over_shm, lambda c: c.sample(X, seed=2, timeout=0.3))
        waited = time.monotonic() - started
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.25 < waited < 0.9, (error, waited)
        over_grpc_error = _fails(over_grpc, lambda c: c.sample(X, seed=2, timeout=0.3))
        assert (error.code, error.details) == (over_grpc_error.code, over_grpc_error.details)
        # The server keeps the caller's deadline: a raw caller, which waits for any answer, is
        # answered DEADLINE_EXCEEDED by the server itself.
        code, _, details, _ = raw.call("Sample", messages.sample_request(X, seed=3).SerializeToString(),
                                       timeout_us=300_000)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
        busy.join(10)
    # The next call gets its own answer, not the late one of the call that gave up.
    server.service.handle.before_launch = None
    assert_same(over_shm.sample(X, seed=4, timeout=10), over_grpc.sample(X, seed=4))
    _settled(server)


def test_calls_that_gave_up_do_not_hold_up_the_next(server, clients):
    """Two calls that passed their deadlines behind a busy device (the server holds both until
    the device frees: the first is in its launch), then a third: it is answered as soon as the
    device is free, as over gRPC, not left unread until its own deadline."""
    expected = clients[0].sample(X, seed=6)
    for client in clients:
        server.service.handle.before_launch = lambda calls: time.sleep(1.0)
        try:
            for _ in range(2):
                error = _fails(client, lambda c: c.sample(X, seed=6, timeout=0.15))
                assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            server.service.handle.before_launch = None
        started = time.monotonic()
        assert_same(client.sample(X, seed=6, timeout=6), expected)
        assert time.monotonic() - started < 3.0
        _settled(server)


def test_malformed_channel_requests_are_refused(server, raw, clients):
    key = raw.key
    sample = messages.sample_request(X, temperature=0.0).SerializeToString()
    refused = {
        "shorter than the header": (b"\x01" * 10, grpc.StatusCode.INVALID_ARGUMENT, "shorter than its 32-byte header"),
        "empty": (b"", grpc.StatusCode.INVALID_ARGUMENT, "0 bytes, shorter than its 32-byte header"),
        "unknown method": (fmt.request(key, 99, b"", 0, sample), grpc.StatusCode.INVALID_ARGUMENT,
                           "method 99 is none of the channel's (1 Sample"),
        "method 0": (fmt.request(key, 0, b"", 0, sample), grpc.StatusCode.INVALID_ARGUMENT, "method 0 is none"),
        "request id past the end": (fmt.REQUEST_HEADER.pack(key, 1, 50, 0) + b"abc", grpc.StatusCode.INVALID_ARGUMENT,
                                    "request_id_bytes 50 must be at most 128 and within the request's 35 bytes"),
        "request id longer than 128": (fmt.request(key, 1, b"r" * 129, 0, sample), grpc.StatusCode.INVALID_ARGUMENT,
                                       "request_id_bytes 129 must be at most 128"),
        "not the method's message": (fmt.request(key, 2, b"", 0, b"\xff" * 9), grpc.StatusCode.INVALID_ARGUMENT,
                                     "request: not a valid protobuf message for this method"),
        "a key no channel has": (fmt.request(b"\x00" * 16, 1, b"", 0, sample), grpc.StatusCode.UNAUTHENTICATED,
                                 fmt.UNKNOWN_KEY),
        "a truncated key": (key[:8], grpc.StatusCode.INVALID_ARGUMENT, "shorter than its 32-byte header"),
    }
    for case, (data, code, message) in refused.items():
        got_code, _, details, body = raw.send_bytes(data)
        assert (got_code, body) == (code.value[0], b""), (case, got_code, details)
        assert message in details, (case, details)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert details.startswith(fmt.UNKNOWN_KEY)
    # Well-formed ones around them: a request id echoed, a timeout of 2**64 - 1 us is none.
    code, request_id, details, body = raw.call("Sample", sample, request_id=b"call-42")
    assert (code, request_id, details) == (grpc.StatusCode.OK, "call-42", "")
    assert list(pb.SampleResponse.FromString(body).token_ids.data) != []
    assert raw.call("GetServerInfo", b"", timeout_us=2**64 - 1)[0] == grpc.StatusCode.OK
    _, over_shm = clients
    assert_same(over_shm.sample(X, seed=5), clients[0].sample(X, seed=5))
    _settled(server)


def test_channels_off(caplog):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(), channels=False)
    with ServerThread(config) as server, Client(server.target, timeout=10) as over_grpc:
        with pytest.raises(grpc.RpcError) as info:
            open_channel(server.target)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details() == "channels: this server runs with --channels off; call over gRPC"
        with Client(server.target, timeout=10, channel="shm") as client, \
                caplog.at_level(logging.WARNING, logger="logitserve.client"):
            for seed in range(3):
                assert_same(client.sample(X, seed=seed), over_grpc.sample(X, seed=seed))
            assert client.server_info().version
            assert not client._same_host.is_open
        [said] = [record.getMessage() for record in caplog.records if record.name == "logitserve.client"]
        assert said.startswith("channel='shm': no same-host channel, calling over gRPC (OpenChannel: "
                               "FAILED_PRECONDITION: channels: this server runs with --channels off; call over gRPC)")


def test_ports_that_cannot_be_made_leave_grpc_serving(monkeypatch):
    """iceoryx2 failing at start (no writable /dev/shm, say) takes channels off, not the server."""
    from logitserve.server.api.channel import transport

    def refuse(*_args, **_kwargs):
        raise OSError("no space left on /dev/shm")

    monkeypatch.setattr(transport, "Iceoryx2Transport", refuse)
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
    with ServerThread(config) as server:
        with pytest.raises(grpc.RpcError) as info:
            open_channel(server.target)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "iceoryx2 could not create this server's ports" in info.value.details()
        assert "no space left on /dev/shm" in info.value.details()
        with Client(server.target, timeout=10) as over_grpc:
            assert over_grpc.sample(X, seed=1).valid.all()


def test_without_the_wake_socket_a_thread_wakes_the_server(monkeypatch):
    """Where the wake event's socket is not found, a thread waits on the event instead: the
    channel answers as before."""
    from logitserve.server.api.channel import transport

    found = transport._listener_and_fd
    monkeypatch.setattr(transport, "_listener_and_fd", lambda service: (found(service)[0], None))
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(), busy_poll_us=0)
    with ServerThread(config) as server, Client(server.target, channel="shm", timeout=20) as over_shm, \
            Client(server.target, timeout=20) as over_grpc:
        assert server.service.channels._transport.wake_fd is None
        for seed in range(5):
            assert_same(over_shm.sample(X, seed=seed), over_grpc.sample(X, seed=seed))
