"""The service with parts cut out, beside the echo server: what each part of a call costs under load.

    python -m bench.service_ablation --device cuda:0 --variants echo,const,noop,full,full+thread,full+eager

Each variant is ``logitserve serve`` with patches applied in its own process (``+`` joins them),
driven like ``bench.service`` (Sample 1x128256 bf16, one channel, concurrency 1, 8 and 64),
one p50 / p99 / calls-per-second line per case:

- ``echo``: ``bench.echo_server``, the transport floor;
- ``const``: the Sample handler answers a fixed reply at once (gRPC, the guard, nothing else);
- ``noop``: the whole path (decode, batcher, reply) but the launch returns zeros at once,
  without touching the device;
- ``full``: the server as it is; ``eager``: with ``--cuda-graphs off``;
- ``thread`` / ``poll``: every graph replay waited for on the launch thread / polled on the
  event loop (the server polls only a batch that holds every call in the server);
- ``swN``: a GIL switch interval of N us in the server.

The host is shared: compare variants within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.service import ServerSpec, drive, payloads, running

CASES = ((1, 1000), (8, 2000), (64, 3000))  # (concurrency, calls)


def serve_patched(variants: set[str], argv: list[str]) -> int:
    """Apply ``variants`` to the server's modules, then run ``logitserve serve argv``."""
    from logitserve.server import device, ops, servicer
    from logitserve.server.cli import main

    if "noop" in variants:
        async def run_batch(calls, handle):
            return [ops.SampleResult([0] * c.rows, c.seeds()) for c in calls]
        ops.SampleCall.run_batch = staticmethod(run_batch)
    if "const" in variants:
        reply = ops.SampleResult([0], [1]).to_pb()

        async def answer(self, request, context):
            return reply
        servicer.LogitServeServicer.Sample = answer
    if "thread" in variants or "poll" in variants:
        launch, forced = device.DeviceHandle.launch, "poll" in variants

        async def launch_forced(self, *args, poll=False):
            return await launch(self, *args, poll=forced)
        device.DeviceHandle.launch = launch_forced
    for v in variants:
        if v.startswith("sw"):
            sys.setswitchinterval(int(v[2:]) * 1e-6)
    if "eager" in variants:
        argv = [*argv, "--cuda-graphs", "off"]
    return main(argv)


def spec(variant: str, device: str) -> ServerSpec:
    if variant == "echo":
        return ServerSpec("echo", [sys.executable, "-m", "bench.echo_server", "--host", "127.0.0.1"], is_echo=True)
    warm = "bfloat16" if "full" in variant.split("+") else "none"
    return ServerSpec(variant, [sys.executable, "-m", "bench.service_ablation", "--serve", variant, "serve", "--host",
                                "127.0.0.1", "--device", device, "--warmup-dtypes", warm])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve_patched(set(argv[1].split("+")), argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default="echo,const,noop,full")
    parser.add_argument("--max-seconds", type=float, default=5.0, help="time bound per case")
    args = parser.parse_args(argv)
    payload = next(p for p in payloads() if p.name == "Sample 1x128256 bf16")
    for variant in args.variants.split(","):
        with running(spec(variant, args.device), 900) as server:
            for concurrency, calls in CASES:
                lat, errors, wall, _, _ = asyncio.run(drive(server.target, payload, concurrency, calls, 50,
                                                            args.max_seconds, False))
                lat.sort()
                print(f"{variant:16s} c={concurrency:3d} p50={lat[len(lat) // 2]:8.0f} us "
                      f"p99={lat[int(len(lat) * 0.99)]:8.0f} us {len(lat) / wall:7.0f} calls/s errors={errors}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
