"""Health through warm-up and drain, reflection, warm-up on the interpreter, TLS and token auth."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from logitserve.client import Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

SERVICE = "logitserve.v1.LogitServe"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def config(**kw) -> ServerConfig:
    base = dict(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
    base.update(kw)
    return ServerConfig(**base)


def check(channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_not_serving_until_warm_then_serving_then_not_serving_on_drain():
    server = ServerThread(config(warmup_dtypes=("float32", "bfloat16"), max_delay_us=5_000_000, grace_period_s=10),
                          warm_up=False)
    try:
        with grpc.insecure_channel(server.target) as channel:
            assert check(channel) == NOT_SERVING and check(channel, SERVICE) == NOT_SERVING
            server.run(server.service.warm_up())
            assert check(channel) == SERVING and check(channel, SERVICE) == SERVING
            with Client(server.target) as c:
                assert c.server_info().warmed_dtypes == ("float32", "bfloat16")

            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE),
                                                              timeout=30)
            assert next(watch).status == SERVING
            # A call in flight when the drain starts: it waits in the batcher (5 s delay) ...
            outcome = {}
            caller = threading.Thread(target=lambda: outcome.update(
                out=Client(server.target).softmax(np.ones((1, 4), np.float32), timeout=30)))
            caller.start()
            deadline = time.monotonic() + 10
            while server.service.batcher.queue_depth == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.service.batcher.queue_depth == 1
            t0 = time.monotonic()
            stopping = asyncio.run_coroutine_threadsafe(server.service.stop(10), server.loop)
            assert next(watch).status == NOT_SERVING
            watch.cancel()
            # ... new calls are turned away ...
            with pytest.raises(LogitServeError) as info:
                Client(server.target, retries=0).softmax(np.ones((1, 4), np.float32), timeout=5)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            # ... and the one in flight finishes (at once: draining launches waiting batches).
            caller.join(15)
            stopping.result(15)
            assert time.monotonic() - t0 < 4
            np.testing.assert_allclose(outcome["out"], 0.25)
        server.service = None  # stopped above
    finally:
        server.close()


def test_warm_up_compiles_on_the_interpreter(caplog):
    caplog.set_level(logging.DEBUG, logger="logitserve")  # the per-case lines are debug
    with ServerThread(config(backend="interpret", warmup_dtypes=("float32",))) as server:
        with grpc.insecure_channel(server.target) as channel:
            assert check(channel) == SERVING
        assert server.service.handle.warmed_dtypes
    progress = [r for r in caplog.records if r.getMessage() == "warmup"]
    assert progress and progress[-1].fields["step"].split("/")[0] == progress[-1].fields["step"].split("/")[1]
    assert {"sample 1x64", "sample joint 16x64", "sample random_val 2x64", "route_experts 2x8 k=2", "swiglu"} <= \
        {r.fields["op"] for r in progress}


def test_warm_up_compiles_the_configured_widths(caplog):
    caplog.set_level(logging.DEBUG, logger="logitserve")
    with ServerThread(config(backend="torch", warmup_dtypes=("float32",), warmup_widths=(48, 50))) as server:
        with grpc.insecure_channel(server.target) as channel:
            assert check(channel) == SERVING
    cases = [r for r in caplog.records if r.getMessage() == "warmup"]
    ops = {r.fields["op"] for r in cases}
    assert {"sample 1x48", "softmax 16x50"} <= ops and not any(op.endswith("x64") for op in ops)
    # At info, start-up shows one warm-up line, its summary, just before the serving line.
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert all(r.levelno == logging.DEBUG for r in cases) and "warmup" not in info
    assert info[info.index("serving") - 1] == "warmup done"
    [done] = [r for r in caplog.records if r.getMessage() == "warmup done"]
    assert done.fields["cases"] == len(cases) and done.fields["dtypes"] == ["float32"]
    assert done.fields["widths"] == [48, 50] and done.fields["seconds"] >= 0


def test_reflection_lists_the_services():
    with ServerThread(config()) as server, grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=10))
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
        db = ProtoReflectionDescriptorDatabase(channel)
        from google.protobuf.descriptor_pool import DescriptorPool

        service = DescriptorPool(db).FindServiceByName(SERVICE)
        assert {m.name for m in service.methods} == {"Sample", "RouteExperts", "Softmax", "CausalSoftmax", "Silu",
                                                     "VerifyDraft", "Step", "StreamSteps", "GetServerInfo",
                                                     "OpenSequences", "CloseSequences", "UpdateSequences",
                                                     "OpenChannel", "CloseChannel", "OrderedSession"}


# ----------------------------------------------------------------------------------------- TLS


def _certificates(tmp_path):
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(subject, key, issuer, issuer_key, *, ca=False, san=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(stem, cert, key):
        (tmp_path / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp_path / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("logitserve test CA", ca_key, "logitserve test CA", ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = build("localhost", server_key, "logitserve test CA", ca_key,
                   san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = build("a client", client_key, "logitserve test CA", ca_key)
    write("ca", ca, ca_key)
    write("server", server, server_key)
    write("client", client, client_key)
    return tmp_path


LOCALHOST = (("grpc.ssl_target_name_override", "localhost"),)


def test_tls(tmp_path):
    d = _certificates(tmp_path)
    with ServerThread(config(tls_cert=str(d / "server.pem"), tls_key=str(d / "server.key"))) as server:
        with Client(server.target, root_certificates=d / "ca.pem", options=LOCALHOST, timeout=30) as c:
            np.testing.assert_allclose(c.softmax(np.ones((1, 2), np.float32)), 0.5)
        with Client(server.target, retries=0, timeout=5) as plain:  # plaintext to a TLS port
            with pytest.raises(LogitServeError) as info:
                plain.softmax(np.ones((1, 2), np.float32))
            assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(tmp_path):
    d = _certificates(tmp_path)
    cfg = config(tls_cert=str(d / "server.pem"), tls_key=str(d / "server.key"), tls_client_ca=str(d / "ca.pem"))
    with ServerThread(cfg) as server:
        with Client(server.target, root_certificates=d / "ca.pem", certificate_chain=d / "client.pem",
                    private_key=d / "client.key", options=LOCALHOST, timeout=30) as c:
            np.testing.assert_allclose(c.softmax(np.ones((1, 2), np.float32)), 0.5)
        with Client(server.target, root_certificates=d / "ca.pem", options=LOCALHOST, retries=0, timeout=5) as anon:
            with pytest.raises(LogitServeError) as info:
                anon.softmax(np.ones((1, 2), np.float32))
            assert info.value.code == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------------------------------- auth


def test_token_auth(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="logitserve")
    tokens = tmp_path / "tokens"
    tokens.write_text("# one token per line\ns3cret-one\n\ns3cret-two\n")
    x = np.ones((1, 2), np.float32)
    with ServerThread(config(auth_token_file=str(tokens))) as server:
        for token in (None, "wrong", "s3cret-one-but-longer"):
            with Client(server.target, token=token, timeout=10) as c:
                with pytest.raises(LogitServeError) as info:
                    c.softmax(x)
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(LogitServeError) as info:
                    list(c.stream_steps([{"softmax": {"x": x}}]))
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        for token in ("s3cret-one", "s3cret-two"):
            with Client(server.target, token=token, timeout=10) as c:
                np.testing.assert_allclose(c.softmax(x), 0.5)
                assert [r.softmax.tolist() for r in c.stream_steps([{"softmax": {"x": x}}])] == [[[0.5, 0.5]]]
        with grpc.insecure_channel(server.target) as channel:
            assert check(channel) == SERVING  # health needs no token
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.RpcError) as info:  # reflection does
                next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        tokens.write_text("s3cret-three\n")
        server.service.reload_tokens()  # what SIGHUP does (tests/test_server_cli.py sends one)
        with Client(server.target, token="s3cret-three", timeout=10) as c:
            np.testing.assert_allclose(c.softmax(x), 0.5)
        with Client(server.target, token="s3cret-one", timeout=10) as c, pytest.raises(LogitServeError):
            c.softmax(x)
        tokens.write_text("")  # a bad reload keeps the tokens it had
        server.service.reload_tokens()
        with Client(server.target, token="s3cret-three", timeout=10) as c:
            np.testing.assert_allclose(c.softmax(x), 0.5)
    logged = " ".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records)
    assert "UNAUTHENTICATED" in logged and "s3cret" not in logged


def test_empty_token_file_is_refused(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no token"):
        ServerThread(config(auth_token_file=str(tokens)))
