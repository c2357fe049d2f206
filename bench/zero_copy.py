"""Zero-copy benchmark (issue 23): ``Sample`` through each path a tensor can take to the server.

    python -m bench.zero_copy --device cuda:0 --out zc.md      # the H100 table, about 5 minutes
    python -m bench.zero_copy --device cpu --out zc-cpu.md     # CPU smoke: small shapes, about 1 minute

Starts, as subprocesses on 127.0.0.1 (``bench/servers.py``), the echo server and the service
twice, batching on (``--max-batch-rows 512 --max-delay-us 0``) and off (``--max-batch-rows 1``);
then measures from processes of their own (spawned: the clients share no process with any
server, as a frontend would not).

**Table 1**, ``Sample`` with temperature 0.8, top_k 50, top_p 0.9 and per-row seeds, at 1, 16,
64 and 256 rows of 128256, float32 and bfloat16 (``--rows``, ``--vocab``), p50 at concurrency 1
(batching on), in ms:

- ``kernel``: ``logitserve.kernels.sample`` alone on the device, in the client process;
- ``Client``: ``Client.sample`` from a CPU tensor (numpy float32, torch bfloat16): the bytes path;
- ``raw``: the same request serialized before timing, sent as bytes, the answer not parsed;
- ``echo``: those bytes to the echo server (the transport floor for that payload);
- ``system shm``: the logits in a POSIX shared-memory region registered through the client,
  ``token_ids`` / ``seeds`` / ``valid`` written into another (the server page-locked both at
  registration and copies the logits to the device once, by DMA);
- ``H2D copy`` (CUDA): one copy of the logits from page-locked host memory to the device, in the
  client process: what the system shm path may cost beyond CUDA IPC;
- ``CUDA IPC``: the logits in a torch CUDA tensor registered through the client (the kernel
  reads them where they are), the outputs written into the client's device memory;
- ``RouteExperts 1x8``: ``Client.route_experts`` of 1x8 float32 logits, k=2, measured beside
  each row: the floor a call stands on in the same run.

Each row checks that the bytes, system shm and CUDA IPC paths give the same tokens.

**Table 2**, eight client processes, each calling ``Sample`` on 64x128256 float32 through CUDA IPC
(``--device cpu``: system shared memory) in a loop for ``--loop-seconds``: rows served per
second, with batching on and off, the server's mean requests per launch from its metrics, and
the calls' p50.

Needs what ``bench.service`` needs, torch in the client processes, and cuda-python
(``cuda.bindings``) for the CUDA IPC paths.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shlex
import signal
import statistics
import sys
import time

import numpy as np

from .driver import ClientFailed, in_client_process, loop_for
from .servers import ServerSpec, delta, echo_argv, running_all, scrape, serve_argv
from .service import machine_line

PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9)
SAMPLE = "/logitserve.v1.LogitServe/Sample"
ALIGN = 256  # outputs placed at multiples of this in their region


def _p50_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3 if times else float("nan")


def _time(columns: dict, seconds: float, min_calls: int, max_calls: int) -> dict[str, float]:
    """The columns' calls interleaved round by round, after one warm-up round, until ``seconds``
    have passed (and at least ``min_calls`` rounds) or ``max_calls`` rounds; p50 ms each."""
    for call in columns.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in columns}
    start = time.perf_counter()
    rounds = 0
    while rounds < max_calls and (rounds < min_calls or time.perf_counter() - start < seconds):
        for name, call in columns.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: _p50_ms(t) for name, t in times.items()}


def _outputs(alloc, rows: int):
    """token_ids, seeds and valid views at aligned offsets of a byte buffer (numpy or torch)."""
    step = -(-8 * rows // ALIGN) * ALIGN

    def part(offset, nbytes, dtype):
        piece = alloc[offset:offset + nbytes]
        return piece.view(dtype)

    if isinstance(alloc, np.ndarray):
        return {"token_ids": part(0, 8 * rows, np.int64), "seeds": part(step, 8 * rows, np.int64),
                "valid": part(2 * step, rows, np.bool_)}
    import torch

    return {"token_ids": part(0, 8 * rows, torch.int64), "seeds": part(step, 8 * rows, torch.int64),
            "valid": part(2 * step, rows, torch.bool)}


def _out_bytes(rows: int) -> int:
    return 3 * -(-8 * rows // ALIGN) * ALIGN


def _tokens(result) -> np.ndarray:
    t = result.token_ids
    return t.cpu().numpy() if hasattr(t, "cpu") else np.array(t)


# ----------------------------------------------------------------------- table 1, one process


def measure_paths(target: str, echo: str, device: str, rows_list, vocab: int, dtypes, seconds: float) -> list[dict]:
    """Table 1's rows, measured in this (client) process."""
    import grpc
    import torch

    from logitserve.client import Client, messages, regions
    from logitserve.kernels import sample as kernel_sample

    cuda = device.startswith("cuda")
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    echo_channel = grpc.insecure_channel(echo, options=options)
    echo_call = echo_channel.unary_unary(SAMPLE)
    gate = np.random.default_rng(1).standard_normal((1, 8), dtype=np.float32)
    rows_out = []
    with Client(target, timeout=600) as client:
        raw_call = client._methods["Sample"]  # the client's channel, raw bytes in and out
        for dtype in dtypes:
            for rows in rows_list:
                torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
                host = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3).to(torch_dtype)
                logits = host.numpy() if dtype == "f32" else host  # numpy has no bfloat16
                seeds = np.arange(rows, dtype=np.int64) + 1
                kw = dict(PARAMS, seed=seeds)
                enc = messages.Encoder()
                raw = enc.serialize(messages.build_sample(enc, (), logits, **kw))

                shm_in = regions.shared_copy(host)
                shm_out = regions.shared_array((_out_bytes(rows),), "uint8")
                client.register("bench-shm-in", shm_in)
                client.register("bench-shm-out", shm_out)
                outs_host = _outputs(shm_out.array, rows)
                columns = {}
                if cuda:
                    dev_logits = host.to(device)
                    dev_out = torch.zeros(_out_bytes(rows), dtype=torch.uint8, device=device)
                    client.register("bench-cuda-in", dev_logits)
                    client.register("bench-cuda-out", dev_out)
                    outs_dev = _outputs(dev_out, rows)
                    seeds_dev = torch.from_numpy(seeds).to(device)

                    def kernel():
                        kernel_sample(dev_logits, **PARAMS, seed=seeds_dev)
                        torch.cuda.synchronize(device)

                    pinned_logits, device_copy = host.pin_memory(), torch.empty_like(dev_logits)

                    def host_to_device():
                        device_copy.copy_(pinned_logits, non_blocking=True)
                        torch.cuda.synchronize(device)

                    columns["kernel"] = kernel
                    columns["h2d"] = host_to_device
                    columns["cuda"] = lambda: client.sample(dev_logits, **kw, out=outs_dev)
                else:
                    seeds_t = torch.from_numpy(seeds)
                    columns["kernel"] = lambda: kernel_sample(host, **PARAMS, seed=seeds_t)
                columns["shm"] = lambda: client.sample(shm_in.tensor, **kw, out=outs_host)
                columns["route"] = lambda: client.route_experts(gate, 2)
                fast = _time(columns, min(seconds, 3.0), 20, 500)
                slow = _time({"client": lambda: client.sample(logits, **kw), "raw": lambda: raw_call(raw, timeout=600),
                              "echo": lambda: echo_call(raw, timeout=600)}, seconds, 3, 60)

                expect = _tokens(client.sample(logits, **kw))
                same = np.array_equal(_tokens(client.sample(shm_in.tensor, **kw, out=outs_host)), expect)
                if cuda:
                    same = same and np.array_equal(_tokens(client.sample(dev_logits, **kw, out=outs_dev)), expect)
                rows_out.append(dict(rows=rows, vocab=vocab, dtype=dtype, mb=host.numel() * host.element_size() / 1e6,
                                     same=same, **fast, **slow))
                client.unregister("bench-shm-in")
                client.unregister("bench-shm-out")
                if cuda:
                    client.unregister("bench-cuda-in")
                    client.unregister("bench-cuda-out")
                    del dev_logits, dev_out, outs_dev
                outs_host = None
                for buf in (shm_in, shm_out):
                    buf.array = buf.tensor = None
                    try:
                        buf.shm.close()
                    except BufferError:
                        pass
                    buf.unlink()
                print(f"# {rows}x{vocab} {dtype}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in {**fast, **slow}.items()),
                      file=sys.stderr, flush=True)
    echo_channel.close()
    return rows_out


# ------------------------------------------------------------------- table 2, eight processes


def client_loop(index: int, target: str, device: str, rows: int, vocab: int, seconds: float, barrier, queue) -> None:
    """One of the concurrent clients: its own regions, then ``Sample`` in a loop."""
    import torch

    from logitserve.client import Client, regions

    cuda = device.startswith("cuda")
    host = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(index)) * 3
    kw = dict(PARAMS, seed=np.arange(rows, dtype=np.int64) + 100 * index)
    bufs = []
    with Client(target, timeout=600) as client:
        if cuda:
            logits = host.to(device)
            out_alloc = torch.zeros(_out_bytes(rows), dtype=torch.uint8, device=device)
            client.register(f"c{index}-in", logits)
            client.register(f"c{index}-out", out_alloc)
        else:
            bufs = [regions.shared_copy(host), regions.shared_array((_out_bytes(rows),), "uint8")]
            client.register(f"c{index}-in", bufs[0])
            client.register(f"c{index}-out", bufs[1])
            logits, out_alloc = bufs[0].tensor, bufs[1].array
        outs = _outputs(out_alloc, rows)
        for _ in range(3):
            client.sample(logits, **kw, out=outs)
        barrier.wait()
        times, wall = loop_for(lambda: client.sample(logits, **kw, out=outs), seconds)
        outs = logits = out_alloc = None
    for buf in bufs:
        buf.array = buf.tensor = None
        try:
            buf.shm.close()
        except BufferError:
            pass
        buf.unlink()
    queue.put((index, len(times), wall, times))


def concurrent_run(ctx, server, device: str, clients: int, rows: int, vocab: int, seconds: float) -> dict:
    barrier = ctx.Barrier(clients + 1)
    queue = ctx.Queue()
    procs = [ctx.Process(target=client_loop, args=(i, server.target, device, rows, vocab, seconds, barrier, queue))
             for i in range(clients)]
    for p in procs:
        p.start()
    barrier.wait(timeout=600)
    before = scrape(server.metrics_urls) if server.metrics_urls else {}
    parts = [queue.get(timeout=600 + seconds) for _ in procs]
    after = scrape(server.metrics_urls) if server.metrics_urls else {}
    for p in procs:
        p.join(60)
    calls = sum(n for _, n, _, _ in parts)
    wall = max(w for _, _, w, _ in parts)
    launches = delta(before, after, "logitserve_launches_total")
    per_launch = delta(before, after, "logitserve_batch_requests_sum") / launches if launches > 0 else None
    return dict(calls=calls, wall=wall, rows_per_s=calls * rows / wall, per_launch=per_launch,
                p50=_p50_ms([t for _, _, _, ts in parts for t in ts]))


# ------------------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    if value is None or value != value:
        return ""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def table_paths(rows: list[dict], cuda: bool) -> list[str]:
    lines = ["| logits | MB | kernel | Client (bytes) | raw | echo | system shm | H2D copy | CUDA IPC "
             "| RouteExperts 1x8 | Client / raw | tokens equal |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['rows']}x{r['vocab']} {r['dtype']} | {r['mb']:.1f} | {_ms(r['kernel'])} | {_ms(r['client'])} "
                     f"| {_ms(r['raw'])} | {_ms(r['echo'])} | {_ms(r['shm'])} | {_ms(r.get('h2d')) if cuda else 'n/a'} "
                     f"| {_ms(r.get('cuda')) if cuda else 'n/a'} | {_ms(r['route'])} | {r['client'] / r['raw']:.2f}x "
                     f"| {'yes' if r['same'] else 'NO'} |")
    return lines


def table_concurrent(results: dict[str, dict], clients: int, rows: int, vocab: int, path: str) -> list[str]:
    lines = [f"| {clients} clients x {rows}x{vocab} f32, {path} | calls | rows/s | requests/launch | p50 ms |",
             "|---|---:|---:|---:|---:|"]
    for label, r in results.items():
        per = "" if r["per_launch"] is None else f"{r['per_launch']:.1f}"
        lines.append(f"| {label} | {r['calls']} | {r['rows_per_s']:,.0f} | {per} | {_ms(r['p50'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the server's device: cuda:0 (the full table) or cpu (smoke)")
    parser.add_argument("--backend", default="auto", help="the server's --backend")
    parser.add_argument("--rows", help="comma-separated rows (default 1,16,64,256)")
    parser.add_argument("--vocab", type=int, help="row width (default 128256; cpu: 4096)")
    parser.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16")
    parser.add_argument("--seconds", type=float, help="time per row of table 1 for the bytes columns "
                                                      "(default 8; cpu: 2)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client processes (default 8)")
    parser.add_argument("--client-rows", type=int, default=64, help="rows per call of each concurrent client")
    parser.add_argument("--loop-seconds", type=float, help="length of each concurrent run (default 15; cpu: 3)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    parser.add_argument("--out", help="also write the tables to this file")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    rows_list = [int(r) for r in (args.rows or "1,16,64,256").split(",")]
    vocab = args.vocab or (128256 if cuda else 4096)
    seconds = args.seconds if args.seconds is not None else (8.0 if cuda else 2.0)
    loop_seconds = args.loop_seconds if args.loop_seconds is not None else (15.0 if cuda else 3.0)
    dtypes = [d.strip() for d in args.dtypes.split(",")]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Warm-up compiles only what the benchmark calls: its width, in its dtypes.
    warm = ",".join({"f32": "float32", "bf16": "bfloat16"}[d] for d in dtypes)
    serve = serve_argv("--device", args.device, "--backend", args.backend, "--warmup-dtypes", warm,
                       "--warmup-widths", str(vocab))
    specs = [ServerSpec("echo", echo_argv(), is_echo=True),
             ServerSpec("batch on", serve + ["--max-batch-rows", "512", "--max-delay-us", "0"]),
             ServerSpec("batch off", serve + ["--max-batch-rows", "1", "--max-delay-us", "0"])]
    ctx = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    header = [f"Zero-copy benchmark: {machine_line(args)}.",
              f"Command: `python -m bench.zero_copy {shlex.join(argv if argv is not None else sys.argv[1:])}`. "
              f"Clients in processes of their own; Sample with temperature 0.8, top_k 50, top_p 0.9, per-row "
              f"seeds; p50 at concurrency 1, ms (batching on).", ""]
    with running_all(specs, args.startup_timeout) as (echo, batch_on, batch_off):
        try:
            paths = in_client_process(measure_paths, batch_on.target, echo.target, args.device, rows_list, vocab,
                                      dtypes, seconds)
        except ClientFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        concurrent = {}
        for label, server in (("batching on", batch_on), ("batching off", batch_off)):
            concurrent[label] = concurrent_run(ctx, server, args.device, args.clients, args.client_rows, vocab,
                                               loop_seconds)
            print(f"# {args.clients} clients, {label}: {concurrent[label]['rows_per_s']:,.0f} rows/s",
                  file=sys.stderr, flush=True)
    path = "CUDA IPC" if cuda else "system shared memory"
    text = "\n".join(header + table_paths(paths, cuda) + [""]
                     + table_concurrent(concurrent, args.clients, args.client_rows, vocab, path)
                     + ["", f"Whole run {time.monotonic() - t0:.0f} s."])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all(r["same"] for r in paths) else 1


if __name__ == "__main__":
    raise SystemExit(main())
