"""Server-side HTTP/2 options against the transport floor: echo servers (raw bytes in, 8 bytes out)
with gRPC channel options, driven one call at a time, interleaved round by round.

    source scripts/device_env.sh; python3 bench/probes/http2_options.py ROUNDS CALLS REQUEST_BYTES
"""
import asyncio, json, multiprocessing, random, statistics, sys, time
import grpc

REPLY = b"\x00" * 8
VARIANTS = {
    "default": [],
    "nobdp": [("grpc.http2.bdp_probe", 0)],
    "la1M+nobdp": [("grpc.http2.lookahead_bytes", 1 << 20), ("grpc.http2.bdp_probe", 0)],
    "la4M+nobdp": [("grpc.http2.lookahead_bytes", 4 << 20), ("grpc.http2.bdp_probe", 0)],
    "la16M+nobdp": [("grpc.http2.lookahead_bytes", 16 << 20), ("grpc.http2.bdp_probe", 0)],
    "la4M+nobdp+wbuf1M": [("grpc.http2.lookahead_bytes", 4 << 20), ("grpc.http2.bdp_probe", 0), ("grpc.http2.write_buffer_size", 1 << 20)],
    "la4M": [("grpc.http2.lookahead_bytes", 4 << 20)],
}

def serve(options, q):
    async def main():
        async def answer(request, context):
            return REPLY
        class Any(grpc.GenericRpcHandler):
            def service(self, d):
                return grpc.unary_unary_rpc_method_handler(answer)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)] + options)
        server.add_generic_rpc_handlers((Any(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        q.put(port)
        await server.wait_for_termination()
    asyncio.run(main())

async def measure(port, payload, calls):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        m = ch.unary_unary("/x/y")
        for _ in range(50):
            await m(payload)
        lat = []
        for _ in range(calls):
            t0 = time.perf_counter_ns(); await m(payload); lat.append(time.perf_counter_ns() - t0)
        return statistics.median(lat) / 1e3

def main():
    rounds, calls, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    payload = bytes(random.Random(0).randbytes(size))
    ctx = multiprocessing.get_context("spawn")
    ports, procs = {}, []
    for name, opts in VARIANTS.items():
        q = ctx.Queue(); p = ctx.Process(target=serve, args=(opts, q), daemon=True); p.start(); procs.append(p)
        ports[name] = q.get(timeout=60)
    res = {n: [] for n in VARIANTS}
    rng = random.Random(1)
    for _ in range(rounds):
        for name in rng.sample(list(VARIANTS), len(VARIANTS)):
            res[name].append(asyncio.run(measure(ports[name], payload, calls)))
    base = res["default"]
    for name, v in res.items():
        diffs = [a - b for a, b in zip(v, base)]
        print(f"{name:20s} p50 {statistics.median(v):7.0f} us  vs default {statistics.median(diffs):+6.0f} us (lower in {sum(d < 0 for d in diffs)} of {len(v)})", flush=True)
    for p in procs: p.terminate()

if __name__ == "__main__":
    main()
