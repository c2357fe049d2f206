"""Bearer-token auth (``--auth-token-file``): every RPC but health needs
``authorization: Bearer <token>``; a missing, malformed or wrong token gets UNAUTHENTICATED with
one fixed message, before the request is even parsed; tokens are compared in constant time,
never logged, and re-read on SIGHUP (in a subprocess server; a bad file keeps the old tokens).

The RPCs checked are not a list kept here: the server's own reflection names the services it
serves and gives their file descriptors, whose methods (streaming ones included) are each called
without a token. A service or an RPC added later is checked without touching this file.
"""

from __future__ import annotations

import hmac
import logging
import signal

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from logitserve.server.process import ServerProcess
from logitserve.client import Client, LogitServeError
from logitserve.client import messages
from logitserve.server import ServerConfig
from logitserve.server.api import auth
from logitserve.server.testing import ServerThread
from logitserve.kserve import grpc_service_pb2 as kserve_pb
from logitserve.v1 import logitserve_pb2 as pb

TOKENS = ("tok-4f1c9a7e2b", "tok-second-88d0e1")
ROTATED = "tok-rotated-5a6b7c"
X = np.array([[1.0, 2.0, 3.0]], np.float32)
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
SERVICE = "/logitserve.v1.LogitServe/"
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# The services of our own wire contracts: reflection must list each (so none escapes the check).
OUR_SERVICES = {s.full_name for d in (pb.DESCRIPTOR, kserve_pb.DESCRIPTOR) for s in d.services_by_name.values()}
# Valid requests, serialized (sent through a raw channel, so metadata is all ours): a unary call,
# a streaming one and one that launches.
REQUESTS = {
    "Sample": messages.sample_request(X, temperature=0.0),
    "Softmax": messages.softmax_request(X),
    "StreamSteps": messages.step_request("s", softmax={"x": X}),
}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# serving tokens\n\n{TOKENS[0]}\r\n  {TOKENS[1]}  \n")  # comments, blanks, CRLF, spaces
    return path


@pytest.fixture(scope="module")
def server(token_file):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(),
                          auth_token_file=str(token_file))
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _call(channel, rpc: str, data: bytes, authorization: str | None):
    """(status, details, trailing metadata) of one raw call."""
    metadata = () if authorization is None else (("authorization", authorization),)
    kw = dict(request_serializer=None, response_deserializer=None)
    try:
        if rpc == "StreamSteps":
            call = channel.stream_stream(SERVICE + rpc, **kw)(iter([data]), timeout=10, metadata=metadata)
            list(call)
        else:
            _, call = channel.unary_unary(SERVICE + rpc, **kw).with_call(data, timeout=10, metadata=metadata)
        return grpc.StatusCode.OK, "", dict(call.trailing_metadata() or ())
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())


def _reflected_services(channel) -> dict[str, descriptor_pool.DescriptorPool]:
    """Every service the server lists through reflection (asked with a token), by full name, with
    a pool built from the file descriptors reflection gives for it (and their dependencies)."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    metadata = (("authorization", f"Bearer {TOKENS[0]}"),)

    def ask(**request) -> reflection_pb2.ServerReflectionResponse:
        requests = iter([reflection_pb2.ServerReflectionRequest(**request)])
        return next(stub.ServerReflectionInfo(requests, timeout=10, metadata=metadata))

    names = [s.name for s in ask(list_services="").list_services_response.service]
    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    for name in names:
        for raw in ask(file_containing_symbol=name).file_descriptor_response.file_descriptor_proto:
            proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
            files[proto.name] = proto
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file_name: str) -> None:  # a file's dependencies go into the pool before it
        if file_name not in added:
            added.add(file_name)
            for dependency in files[file_name].dependency:
                add(dependency)
            pool.Add(files[file_name])

    for file_name in files:
        add(file_name)
    return {name: pool for name in names}


def _call_method(channel, method, authorization: str | None) -> tuple[grpc.StatusCode, str, dict]:
    """(status, details, trailing metadata) of one call of ``method`` (a MethodDescriptor) with an
    empty request, made the way gRPC allows for its streaming kind: auth comes before parsing, so
    the request's content does not matter without a token."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    metadata = () if authorization is None else (("authorization", authorization),)
    kw = dict(request_serializer=None, response_deserializer=None)
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kw)(iter([b""]), timeout=10, metadata=metadata)
            list(call)
        elif method.server_streaming:
            call = channel.unary_stream(path, **kw)(b"", timeout=10, metadata=metadata)
            list(call)
        elif method.client_streaming:
            _, call = channel.stream_unary(path, **kw).with_call(iter([b""]), timeout=10, metadata=metadata)
        else:
            _, call = channel.unary_unary(path, **kw).with_call(b"", timeout=10, metadata=metadata)
        return grpc.StatusCode.OK, "", dict(call.trailing_metadata() or ())
    except grpc.RpcError as exc:
        return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())


def test_every_rpc_of_every_service_but_health_needs_a_token(channel):
    services = _reflected_services(channel)
    assert OUR_SERVICES <= set(services), f"reflection does not list {sorted(OUR_SERVICES - set(services))}"
    methods = [pool.FindServiceByName(name).methods for name, pool in services.items() if name != HEALTH]
    methods = [m for service_methods in methods for m in service_methods]
    wrong = []
    for method in methods:
        name = f"{method.containing_service.full_name}/{method.name}"
        code, details, trailing = _call_method(channel, method, None)
        if code != UNAUTH or "authorization: Bearer" not in details or not set(trailing) <= {"x-request-id"}:
            wrong.append(f"{name} without a token: {code.name} {details!r}, trailers {sorted(trailing)}")
        # With a token the same call gets past the check (it may fail for its empty request), and
        # reaches a handler: gRPC's own "Method not found!" would mean reflection lists a method
        # the server does not serve.
        code, details, _ = _call_method(channel, method, f"Bearer {TOKENS[1]}")
        if code == UNAUTH or details == "Method not found!":
            wrong.append(f"{name} with a token: {code.name} {details!r}")
    assert not wrong, f"{len(wrong)} of {len(methods)} RPCs:\n" + "\n".join(wrong)


@pytest.mark.parametrize("rpc", sorted(REQUESTS))
def test_valid_calls_answer_ok_with_either_token(channel, rpc):
    data = REQUESTS[rpc].SerializeToString()
    assert _call(channel, rpc, data, None)[0] == UNAUTH
    for token in TOKENS:
        assert _call(channel, rpc, data, f"Bearer {token}")[0] == grpc.StatusCode.OK


BAD_AUTHORIZATION = {
    "empty": "",
    "scheme only": "Bearer",
    "scheme and space": "Bearer ",
    "no scheme": TOKENS[0],
    "basic scheme": f"Basic {TOKENS[0]}",
    "token plus a character": f"Bearer {TOKENS[0]}x",
    "a character plus token": f"Bearer x{TOKENS[0]}",
    "prefix of a token": f"Bearer {TOKENS[0][:-1]}",
    "two tokens": f"Bearer {TOKENS[0]} {TOKENS[1]}",
    "token with inner space": f"Bearer {TOKENS[0][:4]} {TOKENS[0][4:]}",
    "a comment line": "Bearer # serving tokens",
    "a 8 KiB token": "Bearer " + "k" * 8192,
}


def test_malformed_or_wrong_tokens_get_one_fixed_answer(server, channel):
    data = REQUESTS["Softmax"].SerializeToString()
    launches = server.service.batcher.launches
    answers = set()
    for name, value in BAD_AUTHORIZATION.items():
        code, details, _ = _call(channel, "Softmax", data, value)
        assert code == UNAUTH, name
        answers.add(details)
        for token in TOKENS:
            assert token not in details and token[:6] not in details.replace("Bearer", "")
    assert len(answers) == 1  # every refusal reads the same: nothing to learn from it
    assert server.service.batcher.launches == launches  # refused calls never reach the device


def test_scheme_is_case_insensitive_and_spaces_are_trimmed(channel):
    data = REQUESTS["Softmax"].SerializeToString()
    for value in (f"bearer {TOKENS[0]}", f"BEARER {TOKENS[1]}", f"Bearer  {TOKENS[0]}  "):
        assert _call(channel, "Softmax", data, value)[0] == grpc.StatusCode.OK, value


def test_auth_comes_before_parsing(channel):
    # Garbage bytes without a token say nothing about the request: UNAUTHENTICATED, not INVALID_ARGUMENT.
    assert _call(channel, "Sample", b"\xff\xfe garbage", None)[0] == UNAUTH
    assert _call(channel, "Sample", b"\xff\xfe garbage", f"Bearer {TOKENS[0]}")[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_health_needs_no_token(channel):
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_client_token_argument(server):
    with Client(server.target, token=TOKENS[1], timeout=10) as c:
        np.testing.assert_allclose(c.softmax(X).sum(), 1.0, rtol=1e-6)
    with Client(server.target, token="nope", timeout=10) as c, pytest.raises(LogitServeError) as info:
        c.softmax(X)
    assert info.value.code == UNAUTH


def test_comparison_is_constant_time(token_file, monkeypatch):
    """Every known token is compared on every check, as equal-length digests, whatever matches."""
    store = auth.TokenStore(str(token_file))
    seen = []
    real = hmac.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    for value, expected in ((f"Bearer {TOKENS[0]}", True), (f"Bearer {TOKENS[1]}", True), ("Bearer x", False),
                            ("Bearer " + "y" * 10_000, False)):
        seen.clear()
        assert store.check(value) is expected
        assert len(seen) == len(TOKENS)  # no early exit on the first match
        assert {pair for pair in seen} == {(32, 32)}  # no length to time either


def test_tokens_never_reach_the_logs(server, channel, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, grpc's included
    data = REQUESTS["Softmax"].SerializeToString()
    for value in [f"Bearer {t}" for t in TOKENS] + list(BAD_AUTHORIZATION.values()):
        _call(channel, "Softmax", data, value)
        _call(channel, "StreamSteps", REQUESTS["StreamSteps"].SerializeToString(), value)
    text = "\n".join(f"{r.getMessage()} {r.args} {getattr(r, 'fields', '')}" for r in caplog.records)
    assert "UNAUTHENTICATED" in text and "'OK'" in text  # the calls were logged, with their status
    for token in (*TOKENS, *BAD_AUTHORIZATION.values()):
        if len(token) >= 8:
            assert token not in text


# ------------------------------------------------------------------ SIGHUP, in a subprocess


def test_sighup_reloads_the_token_file(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKENS[0]}\n")
    with ServerProcess("--auth-token-file", str(tokens), "--warmup-dtypes", "none", "--log-level", "debug") as server:
        def status(token: str) -> grpc.StatusCode:
            with Client(server.target, token=token, retries=0, timeout=30) as c:
                try:
                    c.softmax(X)
                    return grpc.StatusCode.OK
                except LogitServeError as exc:
                    return exc.code

        assert status(TOKENS[0]) == grpc.StatusCode.OK and status(ROTATED) == UNAUTH
        tokens.write_text(f"{ROTATED}\n")
        server.proc.send_signal(signal.SIGHUP)
        assert server.wait_for("tokens reloaded")["count"] == 1
        assert status(ROTATED) == grpc.StatusCode.OK and status(TOKENS[0]) == UNAUTH

        tokens.write_text("# emptied by mistake\n")  # a bad file keeps the tokens in force
        server.proc.send_signal(signal.SIGHUP)
        server.wait_for("token reload failed, keeping the previous tokens")
        assert status(ROTATED) == grpc.StatusCode.OK

        tokens.unlink()  # so does a missing one
        server.proc.send_signal(signal.SIGHUP)
        server.wait_for("token reload failed, keeping the previous tokens")
        assert status(ROTATED) == grpc.StatusCode.OK

        tokens.write_text(f"{TOKENS[1]}\n{ROTATED}\n")
        server.proc.send_signal(signal.SIGHUP)
        assert server.wait_for("tokens reloaded")["count"] == 2
        assert status(TOKENS[1]) == grpc.StatusCode.OK and status(ROTATED) == grpc.StatusCode.OK
        assert status(TOKENS[0]) == UNAUTH
        assert server.terminate() == 0
    log = "".join(server.lines)
    assert '"status": "UNAUTHENTICATED"' in log and '"status": "OK"' in log
    for token in (*TOKENS, ROTATED):
        assert token not in log
