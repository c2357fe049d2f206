"""Health probe: exit 0 when a logitserve server's grpc.health.v1 answers SERVING for the whole
server (service ""), else 1.

    python -m logitserve.server.healthcheck [--address HOST:PORT | --host H --port P] [--timeout S]
        [--ca PEM] [--server-name NAME] [--client-cert PEM --client-key PEM]

Where it asks: ``--address``, else ``--host`` and ``--port``, which default to what the server
reads, ``LOGITSERVE_HOST`` (a wildcard such as 0.0.0.0 is asked on 127.0.0.1) and
``LOGITSERVE_PORT`` (else 50051). So a probe in the server's container (the Dockerfile's
HEALTHCHECK, a Kubernetes exec probe) needs no arguments where the server is configured by
variables; a server given ``--port`` on its command line needs the probe given it too.

TLS, where the server serves it: with ``--ca``, the server's certificate must verify against that
CA bundle; without, but with ``LOGITSERVE_TLS_CERT`` set (the server's own certificate chain),
the probe trusts that certificate alone. Either way the certificate must name the host asked, or
the name ``--server-name`` gives (127.0.0.1 is seldom in a certificate). Under mutual TLS
(``--tls-client-ca``) the probe presents ``--client-cert`` and ``--client-key``.

Exit status: 0 SERVING; 1 NOT_SERVING (warm-up, draining, a lost device), no answer within
``--timeout``, or a certificate that does not verify, with the reason on stderr; 2 a usage error.

grpc, grpc_health and logitserve.server.config only, no torch: it runs every few seconds. The
image links this file (Dockerfile) and runs it by its path.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from logitserve.server.config import DEFAULT_PORT, address

# The variables the server reads for --host, --port and --tls-cert (cli.env_name).
HOST_VARIABLE, PORT_VARIABLE, TLS_CERT_VARIABLE = "LOGITSERVE_HOST", "LOGITSERVE_PORT", "LOGITSERVE_TLS_CERT"
# Hosts a server listens on that are no address to dial: the probe asks the loopback instead.
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _port_number(text: str) -> int:
    """A port a server listens on: 0 (a free one, chosen at start) is none the probe can ask."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port from 1 to 65535")
    return port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m logitserve.server.healthcheck",
                                     description="Exit 0 when a logitserve server's grpc.health.v1 answers SERVING.")
    parser.add_argument("--address", help="host:port of the server (not with --host or --port)")
    parser.add_argument("--host", help=f"default: {HOST_VARIABLE} as the server reads it (a wildcard: 127.0.0.1)")
    parser.add_argument("--port", type=_port_number, help=f"default: {PORT_VARIABLE}, else {DEFAULT_PORT}")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default: 3)")
    parser.add_argument("--ca", help=f"PEM CA bundle the server's certificate must verify against: ask over TLS "
                                     f"(default: {TLS_CERT_VARIABLE}'s certificate, where it is set)")
    parser.add_argument("--server-name", help="a DNS name in the server's certificate, where it lacks the host asked")
    parser.add_argument("--client-cert", help="PEM certificate chain to present under mutual TLS (with --client-key)")
    parser.add_argument("--client-key", help="PEM private key of --client-cert")
    return parser


def _target(args: argparse.Namespace, environ, parser: argparse.ArgumentParser) -> str:
    """``host:port`` to ask: ``--address``, else ``--host``/``--port`` or the server's variables."""
    if args.address is not None:
        if args.host is not None or args.port is not None:
            parser.error("--address: not with --host or --port")
        return args.address
    port = args.port
    if port is None and PORT_VARIABLE in environ:
        try:
            port = _port_number(environ[PORT_VARIABLE])
        except argparse.ArgumentTypeError as exc:
            parser.error(f"{PORT_VARIABLE}: {exc}: give --port")
    host = args.host if args.host is not None else environ.get(HOST_VARIABLE, "")
    return address("127.0.0.1" if host in _WILDCARDS else host, DEFAULT_PORT if port is None else port)


def _read(flag: str, path: str | None, parser: argparse.ArgumentParser) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        parser.error(f"{flag}: cannot read {path}: {exc.strerror}")


def _credentials(args: argparse.Namespace, environ, parser: argparse.ArgumentParser):
    """TLS channel credentials where the server serves TLS (``--ca``, or ``LOGITSERVE_TLS_CERT``
    set), else None (plaintext)."""
    if (args.client_cert is None) != (args.client_key is None):
        parser.error("--client-cert and --client-key: give both or neither")
    trusted = ("--ca", args.ca) if args.ca is not None else (TLS_CERT_VARIABLE, environ.get(TLS_CERT_VARIABLE))
    if trusted[1] is None:
        if args.server_name is not None or args.client_cert is not None:
            parser.error("--server-name and --client-cert are for TLS: give --ca (the server serves plaintext "
                         f"where {TLS_CERT_VARIABLE} is not set)")
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(*trusted, parser),
                                        private_key=_read("--client-key", args.client_key, parser),
                                        certificate_chain=_read("--client-cert", args.client_cert, parser))


def main(argv: list[str] | None = None, environ=os.environ) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    target = _target(args, environ, parser)
    credentials = _credentials(args, environ, parser)
    if credentials is None:
        channel = grpc.insecure_channel(target)
    else:
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
