"""The health probe (logitserve.server.healthcheck) against real in-process servers: exit 0 on
SERVING, 1 on NOT_SERVING (warm-up), no server, or TLS it cannot verify, 2 on a usage error; the
port from --port, --address or LOGITSERVE_PORT as the server reads it; TLS with --ca, or pinned
to LOGITSERVE_TLS_CERT's certificate, and mutual TLS with a client certificate. The image runs
the file by its path (Dockerfile): that run imports no torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from logitserve.server import ServerConfig, healthcheck
from logitserve.server.cli import env_name
from logitserve.server.testing import ServerThread
from test_tls import pki  # noqa: F401 (fixture: a CA, server and client certificates, a rogue CA)


def _config(**kw) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(), **kw)


def probe(capsys, *argv: str, environ: dict | None = None) -> tuple[int, str]:
    """(exit status, the line it printed) of the probe run with ``argv`` and only ``environ``."""
    try:
        code = healthcheck.main(["--timeout", "10", *argv], environ or {})
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    out = capsys.readouterr()
    return code, (out.out + out.err).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server():
    with ServerThread(_config()) as running:
        yield running


@pytest.fixture(scope="module")
def tls_server(pki):  # noqa: F811
    with ServerThread(_config(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))) as running:
        yield running


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket closes


def test_the_probe_reads_the_variables_the_server_reads():
    assert (healthcheck.HOST_VARIABLE, healthcheck.PORT_VARIABLE, healthcheck.TLS_CERT_VARIABLE) == \
        (env_name("--host"), env_name("--port"), env_name("--tls-cert"))


def test_not_serving_during_warm_up_then_serving(capsys):
    with ServerThread(_config(), warm_up=False) as warming:
        assert probe(capsys, "--port", str(warming.port)) == (1, f"127.0.0.1:{warming.port}: NOT_SERVING")
        warming.run(warming.service.warm_up())
        assert probe(capsys, "--port", str(warming.port)) == (0, f"127.0.0.1:{warming.port}: SERVING")


def test_the_port_from_an_argument_or_the_environment(server, capsys):
    serving = f"127.0.0.1:{server.port}: SERVING"
    assert probe(capsys, "--address", f"127.0.0.1:{server.port}") == (0, serving)
    assert probe(capsys, environ={"LOGITSERVE_PORT": str(server.port)}) == (0, serving)
    # A wildcard host is asked on the loopback; --port wins over the variable, as in the server.
    assert probe(capsys, environ={"LOGITSERVE_PORT": str(server.port), "LOGITSERVE_HOST": "0.0.0.0"}) == (0, serving)
    assert probe(capsys, "--port", str(server.port), environ={"LOGITSERVE_PORT": "1"}) == (0, serving)


def test_no_server_is_unhealthy(capsys):
    port = _closed_port()
    code, line = probe(capsys, "--port", str(port))
    assert code == 1 and line.startswith(f"127.0.0.1:{port}: UNAVAILABLE"), line
    # Without arguments or variables it asks the server's default port (whatever answers there).
    assert probe(capsys, "--timeout", "0.1")[1].startswith("127.0.0.1:50051: ")


@pytest.mark.parametrize("argv, environ, message", [
    # What a Kubernetes Service named logitserve puts into the variable (cli.py says the same).
    ([], {"LOGITSERVE_PORT": "tcp://10.0.0.1:50051"}, "LOGITSERVE_PORT: 'tcp://10.0.0.1:50051' is not a port"),
    ([], {"LOGITSERVE_PORT": "0"}, "LOGITSERVE_PORT: '0' is not a port from 1 to 65535: give --port"),
    (["--port", "70000"], {}, "argument --port: '70000' is not a port from 1 to 65535"),
    (["--address", "127.0.0.1:1", "--port", "2"], {}, "--address: not with --host or --port"),
    (["--client-cert", "c.pem"], {}, "--client-cert and --client-key: give both or neither"),
    (["--server-name", "logitserve"], {}, "--server-name and --client-cert are for TLS: give --ca"),
    (["--ca", "/no/such/ca.pem"], {}, "--ca: cannot read /no/such/ca.pem: No such file or directory"),
    ([], {"LOGITSERVE_TLS_CERT": "/no/such/tls.crt"},
     "LOGITSERVE_TLS_CERT: cannot read /no/such/tls.crt: No such file or directory"),
])
def test_usage_errors_exit_2_naming_the_argument(argv, environ, message, capsys):
    code, line = probe(capsys, *argv, environ=environ)
    assert code == 2 and message in line, line


def test_tls_with_the_ca_or_pinned_to_the_servers_certificate(tls_server, pki, capsys):  # noqa: F811
    port, serving = str(tls_server.port), f"127.0.0.1:{tls_server.port}: SERVING"
    assert probe(capsys, "--port", port, "--ca", str(pki.ca)) == (0, serving)
    # In the server's container: its variables alone (the certificate names 127.0.0.1).
    assert probe(capsys, environ={"LOGITSERVE_PORT": port, "LOGITSERVE_TLS_CERT": str(pki.server_cert)}) == \
        (0, serving)
    assert probe(capsys, "--port", port, "--ca", str(pki.ca), "--server-name", "localhost") == (0, serving)
    # It does verify: another CA, a name the certificate lacks, or plaintext all fail.
    for refused in (("--ca", str(pki.rogue_ca)), ("--ca", str(pki.ca), "--server-name", "elsewhere.example"), ()):
        code, line = probe(capsys, "--port", port, *refused)
        assert code == 1 and "UNAVAILABLE" in line, (refused, line)


def test_mutual_tls_with_a_client_certificate(pki, capsys):  # noqa: F811
    config = _config(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))
    with ServerThread(config) as mtls:
        tls = ("--port", str(mtls.port), "--ca", str(pki.ca))
        assert probe(capsys, *tls, "--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)) == \
            (0, f"127.0.0.1:{mtls.port}: SERVING")
        code, line = probe(capsys, *tls)
        assert code == 1 and "UNAVAILABLE" in line, line


def test_the_file_run_by_its_path_imports_no_torch(server):
    """As the image's HEALTHCHECK runs it: ``python .../healthcheck.py``, the port from the variable;
    ``-X importtime`` lists every module it imports."""
    done = subprocess.run([sys.executable, "-X", "importtime", healthcheck.__file__], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "LOGITSERVE_PORT": str(server.port)})
    assert (done.returncode, done.stdout.strip()) == (0, f"127.0.0.1:{server.port}: SERVING"), done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "grpc" in imported and "torch" not in imported
