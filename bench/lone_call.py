"""A lone Sample call's Python path in a loop, on the CPU: where trimming the handler shows first.

    python -m bench.lone_call [--bare] [--calls 20000]

Each call is the bench's Sample 1x128256 bf16 request (bench/service.py's pool) taken the way
the server takes it, without gRPC's transport and without a GPU: the guarded handler's request
parser, the guard, the Sample handler, the batcher's launch-at-once path and the device handle's
lone-call replay into a captured graph, here a stand-in that takes the same 256 KB copy into
its input buffer and answers token 5 at once; then the reply is serialized. It prints the
median, 10th and 90th percentile time of a call and how many times Python's garbage collector
ran. ``--bare`` takes bench/service_ablation.py's bare Sample handler instead (the bound on
trimming). The whole server's handler on the H100 host costs about three times what this
measures (docs/PERFORMANCE.md), so a change reads here in minutes before it costs device time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

import grpc
import numpy as np

from bench.service import payloads
from logitserve.server import app, guard, ops, servicer
from logitserve.server.config import ServerConfig

SAMPLE = "/logitserve.v1.LogitServe/Sample"


class _Graph:
    """A captured graph's stand-in for one bf16 row of 128256: input buffers of the captured
    layout, an answer at once."""

    def __init__(self):
        self._part_bytes = [memoryview(bytearray(n)) for n in (2 * 128256, 3 * 4, 3 * 8)]
        self._graph = self  # what the bare handler replays
        self._token = np.array([5], dtype=np.int64)

    def start_alone(self, parts) -> None:
        for place, part in zip(self._part_bytes, parts, strict=True):
            place[:len(part.data)] = part.data

    def replay(self) -> None:
        pass

    def outputs(self, rows: int) -> list[np.ndarray]:
        return [self._token[:rows].copy()]


class _Graphs:
    replays = 0

    def __init__(self):
        self.graph = _Graph()

    def get(self, key, bucket):
        return self.graph


class _Stream:
    def query(self) -> bool:
        return True


class _Context:
    def invocation_metadata(self):
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def time_remaining(self):
        return None

    async def abort(self, code, message):
        raise RuntimeError(f"{code}: {message}")


def guarded_sample(service: app.Service) -> grpc.RpcMethodHandler:
    """``service``'s Sample handler as the server registers it: guarded, its requests read by the
    server's own parser, its batcher told the guard's occupancy (the lone-client rules)."""
    call_guard = guard.Guard(None)
    service.batcher.occupancy = call_guard.occupancy
    return call_guard.wrap(SAMPLE, grpc.unary_unary_rpc_method_handler(servicer.LogitServeServicer(service).Sample),
                           servicer.request_parsers()[SAMPLE])


async def measure(calls: int, bare: bool) -> tuple[list[int], int]:
    """Nanoseconds a call, after a tenth of ``calls`` as warm-up, and the collections run."""
    # Every call is a lone client's: no idle time or overlap to wait for between calls.
    guard.LONE_CLIENT_IDLE_S = guard.LONE_CLIENT_CROWD_S = 0.0
    if bare:
        from bench.service_ablation import _bare_sample
        _bare_sample(servicer, ops)
    service = app.Service(ServerConfig(device="cpu", port=0))
    handle = service.handle
    handle.graphs, handle.stream, handle._bind = _Graphs(), _Stream(), lambda: None
    handler = guarded_sample(service)
    requests, context = payloads(0)[0].requests, _Context()
    collections = [0]
    gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "stop")))
    times = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        response = await handler.unary_unary(handler.request_deserializer(requests[i % len(requests)]), context)
        response.SerializeToString()
        times.append(time.perf_counter_ns() - t0)
        await asyncio.sleep(0)  # the loop's next turn: metrics and the log line, off the call's way
    return times[calls // 10:], collections[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--bare", action="store_true", help="bench/service_ablation.py's bare Sample handler")
    args = parser.parse_args(argv)
    times, collections = asyncio.run(measure(args.calls, args.bare))
    print(f"lone Sample call ({'bare' if args.bare else 'full'}): median {statistics.median(times) / 1e3:.1f} us, "
          f"p10 {np.percentile(times, 10) / 1e3:.1f}, p90 {np.percentile(times, 90) / 1e3:.1f} "
          f"({len(times)} calls; garbage collections during all {args.calls}: {collections})")


if __name__ == "__main__":
    main()
