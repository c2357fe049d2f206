"""Container health probe: exit 0 when the local server's grpc.health.v1 answers SERVING.

    python -m logitserve.server.healthcheck [--port P] [--host H] [--timeout S]

The Dockerfile's HEALTHCHECK runs this inside the container. Without ``--port`` it asks the
port the server was started with: the ``--port`` flag on PID 1's command line (the server is
the container's entry point), else ``LOGITSERVE_PORT``, else 50051. Exit status: 0 SERVING,
1 anything else (NOT_SERVING during warm-up and draining, unreachable, timed out), printing
why. Plaintext only: with TLS configured, replace the image's HEALTHCHECK.

The image runs this file by its path (``python .../healthcheck.py``), because importing
``logitserve.server`` imports torch (seconds per probe): keep it to the standard library and
grpc, with no imports from the package.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PORT = 50051


def port_from_cmdline(argv: list[str]) -> int | None:
    """The value of ``--port N`` / ``--port=N`` in a server's argv, if present."""
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return None


def server_port() -> int:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        port = port_from_cmdline(argv)
        if port is not None:
            return port
    except (OSError, ValueError):
        pass
    return int(os.environ.get("LOGITSERVE_PORT", DEFAULT_PORT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: the server's own --port")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--service", default="", help="health service name; '' is the whole server")
    args = parser.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = args.port if args.port is not None else server_port()
    target = f"{args.host}:{port}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
