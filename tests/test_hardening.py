"""Issue 25: memory a hostile client can pin, the answer-size check, drain, start-up and
operator defects. Each test fails on the code before the fix (figures in docs/RELIABILITY.md)."""

from __future__ import annotations

import secrets

import grpc
import pytest

from logitserve.server.guard import Guard, _GuardedGenericHandler
from logitserve.server.process import ServerProcess


def _echo(request, context):
    return request


def test_unknown_methods_are_not_cached():
    """A path the service does not know leaves nothing in the guard's method cache."""
    inner = grpc.method_handlers_generic_handler(
        "t.S", {"Known": grpc.unary_unary_rpc_method_handler(_echo)})
    handler = _GuardedGenericHandler(inner, Guard(), {})

    class Details:
        def __init__(self, method):
            self.method = method

    for _ in range(1000):
        assert handler.service(Details(f"/t.S/{secrets.token_hex(64)}")) is None
    assert handler.service(Details("/t.S/Known")) is not None
    assert len(handler._by_method) == 1


def test_unknown_method_paths_do_not_pin_memory():
    """3,000 calls to random 8 KB method paths with no token: UNIMPLEMENTED each, and the
    server's RSS grows by less than 12 MiB (it grew by ~24 MiB, one path kept per call)."""
    with ServerProcess("--warmup-dtypes", "none", "--busy-poll-us", "0") as server:
        with grpc.insecure_channel(server.target) as channel:
            def call(path):
                try:
                    channel.unary_unary(path)(b"", timeout=10)
                except grpc.RpcError as exc:
                    return exc.code()
            for _ in range(200):  # warm gRPC's own per-connection state first
                call("/x/" + secrets.token_hex(4000))
            before = server.rss_kib()
            codes = {call("/x/" + secrets.token_hex(4000)) for _ in range(3000)}
            grown = (server.rss_kib() - before) / 1024
    print(f"unknown paths: RSS +{grown:.1f} MiB")
    assert codes == {grpc.StatusCode.UNIMPLEMENTED}
    assert grown < 12, f"RSS grew {grown:.1f} MiB over 3,000 unknown 8 KB paths"
