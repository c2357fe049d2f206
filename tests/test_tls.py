"""TLS and mutual TLS: ``--tls-cert`` / ``--tls-key`` serve over TLS, ``--tls-client-ca`` also
requires client certificates. Refused: a plaintext client, a client that does not trust the
server's CA (or expects another name), and under mutual TLS a client with no certificate, one
signed by another CA, or an expired one. Served: every RPC of the trusting clients, sync and
asyncio, in process and through the CLI flags.

The certificates are made here (``cryptography``): a CA, a server certificate for 127.0.0.1 and
localhost, client certificates, and a rogue CA with its own server and client certificates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import pathlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logitserve.server.process import ServerProcess
from logitserve.client import AsyncClient, Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

X = np.array([[1.0, 2.0, 3.0]], np.float32)
SOFTMAX_X = np.exp(X - 3) / np.exp(X - 3).sum()
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@dataclasses.dataclass
class Pki:
    ca: pathlib.Path
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path
    expired_client_cert: pathlib.Path
    expired_client_key: pathlib.Path
    rogue_ca: pathlib.Path
    rogue_client_cert: pathlib.Path
    rogue_client_key: pathlib.Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False,
          valid_days: tuple[float, float] = (-1, 30)) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now + datetime.timedelta(days=valid_days[0]))
         .not_valid_after(now + datetime.timedelta(days=valid_days[1]))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    paths = {}

    def write(stem: str, cert, key) -> None:
        (d / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
        paths[stem] = (d / f"{stem}.pem", d / f"{stem}.key")

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    for ca_name in ("ca", "rogue_ca"):
        ca_key = key()
        write(ca_name, _cert(ca_name, ca_key, ca_name, ca_key, ca=True), ca_key)
        prefix = "" if ca_name == "ca" else "rogue_"
        k = key()
        write(prefix + "server", _cert("localhost", k, ca_name, ca_key, server=True), k)
        k = key()
        write(prefix + "client", _cert(prefix + "client", k, ca_name, ca_key), k)
        if ca_name == "ca":
            k = key()
            write("expired_client", _cert("expired", k, ca_name, ca_key, valid_days=(-10, -1)), k)
    return Pki(ca=paths["ca"][0], server_cert=paths["server"][0], server_key=paths["server"][1],
               client_cert=paths["client"][0], client_key=paths["client"][1],
               expired_client_cert=paths["expired_client"][0], expired_client_key=paths["expired_client"][1],
               rogue_ca=paths["rogue_ca"][0], rogue_client_cert=paths["rogue_client"][0],
               rogue_client_key=paths["rogue_client"][1])


def _config(**kw) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(), **kw)


@pytest.fixture(scope="module")
def tls_server(pki):
    with ServerThread(_config(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(pki):
    cfg = _config(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))
    with ServerThread(cfg) as server:
        yield server


def _every_rpc(c: Client) -> None:
    """One call of each kind, answers checked."""
    np.testing.assert_allclose(c.softmax(X), SOFTMAX_X, rtol=1e-6)
    assert c.sample(X, temperature=0.0).token_ids.tolist() == [2]
    weights, indices = c.route_experts(X, 2, renormalize=True)
    assert indices.tolist() == [[2, 1]]
    step = c.step(id="a", softmax={"x": X}, sample={"logits": X, "temperature": 0.0})
    assert step.id == "a" and step.sample.token_ids.tolist() == [2]
    assert [r.sample.token_ids.tolist() for r in c.stream_steps([{"sample": {"logits": X, "temperature": 0.0}}] * 2)] \
        == [[2], [2]]
    assert c.server_info().version


def _refused(make_client) -> LogitServeError:
    with make_client() as c:
        with pytest.raises(LogitServeError) as info:
            c.softmax(X)
    return info.value


# ----------------------------------------------------------------------------------------- TLS


def test_tls_trusting_client_is_served(pki, tls_server):
    with Client(tls_server.target, root_certificates=pki.ca, timeout=30) as c:
        _every_rpc(c)


def test_tls_asyncio_client_is_served(pki, tls_server):
    async def go():
        async with AsyncClient(tls_server.target, root_certificates=pki.ca.read_bytes(), timeout=30) as c:
            out = await c.softmax(X)
            got = [r.softmax async for r in c.stream_steps([{"softmax": {"x": X}}])]
            return out, got
    out, got = asyncio.run(go())
    np.testing.assert_allclose(out, SOFTMAX_X, rtol=1e-6)
    np.testing.assert_allclose(got[0], SOFTMAX_X, rtol=1e-6)


def test_tls_health_check_over_tls(pki, tls_server):
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    with grpc.secure_channel(tls_server.target, creds) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_plaintext_client_is_refused(tls_server):
    error = _refused(lambda: Client(tls_server.target, retries=0, timeout=10))
    assert error.code == UNAVAILABLE


def test_tls_client_that_does_not_trust_the_server_is_refused(pki, tls_server):
    error = _refused(lambda: Client(tls_server.target, root_certificates=pki.rogue_ca, retries=0, timeout=10))
    assert error.code == UNAVAILABLE
    # Nor does the system's trust store know the test CA.
    with grpc.secure_channel(tls_server.target, grpc.ssl_channel_credentials()) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert info.value.code() == UNAVAILABLE


def test_tls_client_expecting_another_name_is_refused(pki, tls_server):
    options = (("grpc.ssl_target_name_override", "not-this-server.example"),)
    error = _refused(lambda: Client(tls_server.target, root_certificates=pki.ca, options=options, retries=0,
                                    timeout=10))
    assert error.code == UNAVAILABLE


def test_tls_server_does_not_ask_for_client_certificates(pki, tls_server):
    # Without --tls-client-ca a client certificate is neither needed nor harmful.
    with Client(tls_server.target, root_certificates=pki.ca, certificate_chain=pki.rogue_client_cert,
                private_key=pki.rogue_client_key, timeout=30) as c:
        np.testing.assert_allclose(c.softmax(X), SOFTMAX_X, rtol=1e-6)


# ---------------------------------------------------------------------------------- mutual TLS


def test_mtls_client_with_certificate_is_served(pki, mtls_server):
    with Client(mtls_server.target, root_certificates=pki.ca, certificate_chain=pki.client_cert,
                private_key=pki.client_key, timeout=30) as c:
        _every_rpc(c)


@pytest.mark.parametrize("who", ["no certificate", "certificate of another CA", "expired certificate",
                                 "plaintext", "untrusting"])
def test_mtls_refuses(pki, mtls_server, who):
    kw = {
        "no certificate": dict(root_certificates=pki.ca),
        "certificate of another CA": dict(root_certificates=pki.ca, certificate_chain=pki.rogue_client_cert,
                                          private_key=pki.rogue_client_key),
        "expired certificate": dict(root_certificates=pki.ca, certificate_chain=pki.expired_client_cert,
                                    private_key=pki.expired_client_key),
        "plaintext": {},
        "untrusting": dict(root_certificates=pki.rogue_ca, certificate_chain=pki.client_cert,
                           private_key=pki.client_key),
    }[who]
    error = _refused(lambda: Client(mtls_server.target, retries=0, timeout=10, **kw))
    assert error.code == UNAVAILABLE
    # ...and the server goes on serving the good client.
    with Client(mtls_server.target, root_certificates=pki.ca, certificate_chain=pki.client_cert,
                private_key=pki.client_key, timeout=30) as c:
        np.testing.assert_allclose(c.softmax(X), SOFTMAX_X, rtol=1e-6)


# ------------------------------------------------------------------------------ flags and files


def test_cli_flags_serve_mutual_tls(pki):
    args = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca),
            "--warmup-dtypes", "none")
    with ServerProcess(*args) as server:
        listening = next(e for e in server.events if e["event"] == "listening")
        assert listening["tls"] is True and listening["mutual_tls"] is True
        with Client(server.target, root_certificates=pki.ca, certificate_chain=pki.client_cert,
                    private_key=pki.client_key, timeout=30) as c:
            np.testing.assert_allclose(c.softmax(X), SOFTMAX_X, rtol=1e-6)
        assert _refused(lambda: Client(server.target, root_certificates=pki.ca, retries=0, timeout=10)).code \
            == UNAVAILABLE
        assert _refused(lambda: Client(server.target, retries=0, timeout=10)).code == UNAVAILABLE


def test_tls_configuration_errors(pki, tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        _config(tls_cert=str(pki.server_cert))
    with pytest.raises(ValueError, match="tls_client_ca: needs tls_cert"):
        _config(tls_client_ca=str(pki.ca))
    with pytest.raises(OSError):  # a missing key file stops the start, never serves plaintext
        ServerThread(_config(tls_cert=str(pki.server_cert), tls_key=str(tmp_path / "missing.key")))
    # Broken PEM, and a key that is not the certificate's: named as TLS files, not as a taken port.
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    for cert, key in ((garbage, pki.server_key), (pki.server_cert, garbage), (pki.ca, pki.server_key)):
        with pytest.raises(OSError, match="--tls-cert / --tls-key"):
            ServerThread(_config(tls_cert=str(cert), tls_key=str(key)))
