"""The gRPC transport floor: a grpc.aio server that takes any unary call and answers 8 bytes.

    python -m bench.echo_server --port 50052

Every method name is accepted (a generic handler), the request arrives as raw bytes (no
protobuf parsing) and the reply is 8 fixed bytes, so a load generator that sends the bytes of
a real ``Sample`` request here measures what gRPC itself costs for that payload: framing,
HTTP/2 flow control, the event loops on both sides. ``bench.service`` runs it beside the real
server. It serves grpc.health.v1 (SERVING once bound) so the same readiness check works.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from logitserve.server.engine.busy_poll import event_loop_factory

REPLY = b"\x00" * 8


async def _answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return REPLY


class _AnyMethod(grpc.GenericRpcHandler):
    """Answers every unary method not otherwise registered; raw bytes in, raw bytes out."""

    def service(self, handler_call_details):
        # No deserializer / serializer: the handler sees and returns bytes.
        return grpc.unary_unary_rpc_method_handler(_answer)


# The server's own default (--max-message-bytes): the echo of a 256x128256 float32 request (131 MB) fits.
def create_server(host: str = "127.0.0.1", port: int = 0, max_message_bytes: int = 256 << 20):
    """The echo server, bound but not started: ``(server, port)``."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Registered after the health service: generic handlers are consulted in order.
    server.add_generic_rpc_handlers((_AnyMethod(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    return server, bound, health_servicer


async def serve(host: str, port: int) -> None:
    server, bound, health_servicer = create_server(host, port)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"echo server listening on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop instead of asyncio's")
    parser.add_argument("--busy-poll-us", type=int, default=0,
                        help="poll this long before the event loop sleeps, as the server's flag does (0: never)")
    args = parser.parse_args(argv)
    if args.uvloop and args.busy_poll_us:
        parser.error("--uvloop and --busy-poll-us: the busy poll is asyncio's selector loop, choose one")
    loop_factory = event_loop_factory(args.busy_poll_us)
    if args.uvloop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
