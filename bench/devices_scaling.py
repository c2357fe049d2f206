"""A server per GPU (issue 36): rows/s of Sample 64x128256 float32 through CUDA IPC, one client
process per GPU, against one GPU alone.

    python -m bench.devices_scaling --out scaling.json                # 2 GPUs (cuda:0,cuda:1), about 4 minutes
    python -m bench.devices_scaling --smoke --out scaling-cpu.json    # CPU smoke: 4x4096, about 1 minute

Runs, one after the other, each server a subprocess on 127.0.0.1 waited for until SERVING:

1. ``baseline``: ``logitserve serve --device cuda:0`` and one client process on cuda:0;
2. ``logitserve serve --devices cuda:0,cuda:1``: one client process on cuda:0 alone (``one``),
   then one client process per GPU at once (``together``). Every client dials cuda:0's process:
   the client sends each call to its tensors' GPU's process itself (client/devices.py).

Each client (spawned: no process shared with a server) holds its logits (the same values in
every client: one seed) in a torch CUDA tensor of its GPU and the outputs (token_ids, seeds,
valid) in another, both registered as CUDA IPC regions; Sample with temperature 0.8, top_k 50,
top_p 0.9 and a seed per row, 3 warm-up calls, then in a loop for ``--seconds`` after a barrier.
Reported (printed, and written as JSON to ``--out``): each phase's rows/s, each client's rows/s,
p50 and the device of the process that served it, the Sample calls each server process counted
in its metrics over the loop, ``ratio`` (together / baseline; the issue's target is >= 1.8 for
two GPUs) and whether every client's tokens equal the baseline's.

``--smoke``: the same steps on the CPU (torch backend) with 4x4096 logits in POSIX shared
memory; ``--devices`` takes GPUs only, so the server of two processes is ``run_devices`` over
``cpu,cpu``, and each client dials its own process (a CPU tensor names no device to route by).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from logitserve.server.process import free_ports

from .driver import loop_for
from .servers import serve_argv, wait_serving
from .service import machine_line
from .zero_copy import PARAMS, _out_bytes, _outputs, _p50_ms

TARGET_RATIO = 1.8
SUPERVISE_CPU = ("import sys\nfrom logitserve.server import cli\nfrom logitserve.server.devices import run_devices\n"
                 "from logitserve.server.logs import configure\n_, config = cli.parse(['serve', *sys.argv[2:]])\n"
                 "configure(config.log_level, worker='supervisor')\n"
                 "sys.exit(run_devices(config, sys.argv[1].split(',')))\n")


class Server:
    """A server subprocess of ``processes`` processes on consecutive ports (gRPC and metrics), its
    output in a temporary log; SERVING once every process is."""

    def __init__(self, label: str, argv: list[str], processes: int, timeout_s: float):
        port, metrics = free_ports(processes), free_ports(processes)
        argv = argv + ["--port", str(port), "--metrics-port", str(metrics)]
        self.targets = [f"127.0.0.1:{port + i}" for i in range(processes)]
        self.metrics_urls = [f"http://127.0.0.1:{metrics + i}/metrics" for i in range(processes)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-devices-", suffix=".log", delete=False)
        print(f"# starting {label}: {shlex.join(argv)} (log {self.log.name})", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        try:
            for target in self.targets:
                wait_serving(target, self.process, max(timeout_s - (time.monotonic() - t0), 1.0))
        except BaseException:
            self.stop(show_log=True)
            raise
        print(f"# {label} SERVING after {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    def sample_calls(self) -> list[float]:
        """Sample calls each process has counted (its logitserve_requests_total{rpc="Sample"})."""
        calls = []
        for url in self.metrics_urls:
            calls.append(sum(v for k, v in _samples(url) if k == 'logitserve_requests_total{rpc="Sample"}'))
        return calls

    def stop(self, show_log: bool = False) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if show_log:
            self.log.flush()
            with open(self.log.name) as f:
                print("# server log (tail):\n" + "".join(f.readlines()[-30:]), file=sys.stderr)
        self.log.close()
        os.unlink(self.log.name)


def _samples(url: str) -> list[tuple[str, float]]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return [(line.rpartition(" ")[0], float(line.rpartition(" ")[2])) for line in lines if line and line[0] != "#"]


def client_loop(device: str, target: str, rows: int, vocab: int, seconds: float, barrier, results) -> None:
    """One client on ``device``: its regions, the tokens of one call, then Sample in a loop."""
    import torch

    from logitserve.client import Client, regions

    host = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    kw = dict(PARAMS, seed=np.arange(rows, dtype=np.int64) + 1)
    bufs = []
    with Client(target, timeout=600) as client:
        if device.startswith("cuda"):
            logits = host.to(device)
            out_alloc = torch.zeros(_out_bytes(rows), dtype=torch.uint8, device=device)
        else:
            bufs = [regions.shared_copy(host), regions.shared_array((_out_bytes(rows),), "uint8")]
            logits, out_alloc = bufs[0].tensor, bufs[1].array
        client.register("logits", bufs[0] if bufs else logits)
        client.register("out", bufs[1] if bufs else out_alloc)
        outs = _outputs(out_alloc, rows)
        for _ in range(3):
            result = client.sample(logits, **kw, out=outs)
        tokens = np.array(result.token_ids.cpu() if hasattr(result.token_ids, "cpu") else result.token_ids).tolist()
        index = int(device.split(":")[1]) if device.startswith("cuda") else None
        served_by = (client.on_device(index) if index is not None else client).server_info().device
        barrier.wait()
        times, wall = loop_for(lambda: client.sample(logits, **kw, out=outs), seconds)
        result = outs = logits = out_alloc = None
    for buf in bufs:
        buf.array = buf.tensor = None
        buf.shm.close()
        buf.unlink()
    results.put(dict(device=device, served_by=served_by, calls=len(times), rows_per_s=len(times) * rows / wall,
                     p50_ms=_p50_ms(times), tokens=tokens))


def phase(server: Server, clients: list[tuple[str, str]], rows: int, vocab: int, seconds: float) -> dict:
    """``clients`` (device, target) at once for ``seconds``: their figures and each process's calls."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(clients) + 1), ctx.Queue()
    procs = [ctx.Process(target=client_loop, args=(device, target, rows, vocab, seconds, barrier, results))
             for device, target in clients]
    for p in procs:
        p.start()
    barrier.wait(timeout=900)
    before = server.sample_calls()
    parts = sorted((results.get(timeout=600 + seconds) for _ in procs), key=lambda r: r["device"])
    after = server.sample_calls()
    for p in procs:
        p.join(60)
    return dict(rows_per_s=sum(r["rows_per_s"] for r in parts), clients=parts,
                sample_calls_per_process=[a - b for a, b in zip(after, before)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cuda:0,cuda:1", help="the GPUs (default cuda:0,cuda:1)")
    parser.add_argument("--smoke", action="store_true", help="on the CPU, small shapes (see the docstring)")
    parser.add_argument("--rows", type=int, help="rows per call (default 64; smoke: 4)")
    parser.add_argument("--vocab", type=int, help="row width (default 128256; smoke: 4096)")
    parser.add_argument("--seconds", type=float, help="length of each phase's loop (default 20; smoke: 3)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    parser.add_argument("--out", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    devices = ["cpu", "cpu"] if args.smoke else args.devices.split(",")
    rows, vocab = args.rows or (4 if args.smoke else 64), args.vocab or (4096 if args.smoke else 128256)
    seconds = args.seconds if args.seconds is not None else (3.0 if args.smoke else 20.0)
    backend = "torch" if args.smoke else "auto"
    flags = ["--backend", backend, "--warmup-dtypes", "float32", "--warmup-widths", str(vocab), "--host", "127.0.0.1"]
    baseline_argv = serve_argv("--device", devices[0], *flags)
    devices_argv = [sys.executable, "-c", SUPERVISE_CPU, ",".join(devices), *flags] if args.smoke else \
        serve_argv("--devices", ",".join(devices), *flags)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = "python -m bench.devices_scaling " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = dict(command=command, machine=machine_line(types.SimpleNamespace(device=",".join(devices),
                                                                              backend=backend)),
                  devices=devices, rows=rows, vocab=vocab, dtype="float32", seconds=seconds,
                  path="system shared memory" if args.smoke else "CUDA IPC")
    t0 = time.monotonic()
    server = Server("baseline", baseline_argv, 1, args.startup_timeout)
    try:
        report["baseline"] = phase(server, [(devices[0], server.targets[0])], rows, vocab, seconds)
    finally:
        server.stop()
    server = Server(f"{len(devices)} processes", devices_argv, len(devices), args.startup_timeout)
    try:
        # A GPU client dials the first process and is routed; a CPU one dials its own.
        targets = server.targets if args.smoke else [server.targets[0]] * len(devices)
        report["one"] = phase(server, [(devices[0], targets[0])], rows, vocab, seconds)
        report["together"] = phase(server, list(zip(devices, targets)), rows, vocab, seconds)
    finally:
        server.stop()
    together = report["together"]
    report["ratio"] = together["rows_per_s"] / report["baseline"]["rows_per_s"]
    report["ratio_vs_one"] = together["rows_per_s"] / report["one"]["rows_per_s"]
    expected = report["baseline"]["clients"][0]["tokens"]
    runs = [c for name in ("baseline", "one", "together") for c in report[name]["clients"]]
    report["tokens_equal"] = all(c["tokens"] == expected for c in runs)
    report["served_by_own_process"] = all(c["served_by"] == c["device"] for c in together["clients"]) \
        and all(calls > 0 for calls in together["sample_calls_per_process"])
    report["target_ratio"] = TARGET_RATIO
    report["whole_run_s"] = round(time.monotonic() - t0, 1)
    lines = [f"Server per device: {report['machine']}.", f"Command: `{command}`; Sample {rows}x{vocab} float32 "
             f"through {report['path']}, {seconds:.0f} s a phase.", "",
             "| phase | client | served by | calls | rows/s | p50 ms | Sample calls per process |",
             "|---|---|---|---:|---:|---:|---|"]
    for name in ("baseline", "one", "together"):
        for c in report[name]["clients"]:
            lines.append(f"| {name} | {c['device']} | {c['served_by']} | {c['calls']} | {c['rows_per_s']:,.0f} "
                         f"| {c['p50_ms']:.2f} | {', '.join(f'{n:.0f}' for n in report[name]['sample_calls_per_process'])} |")
    lines += ["", f"Together {together['rows_per_s']:,.0f} rows/s = {report['ratio']:.2f}x one GPU alone "
              f"({report['baseline']['rows_per_s']:,.0f}; target >= {TARGET_RATIO}x), {report['ratio_vs_one']:.2f}x "
              f"one client of the same server; tokens equal: {report['tokens_equal']}; each client served by its "
              f"device's process: {report['served_by_own_process']}. Whole run {report['whole_run_s']:.0f} s."]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0 if report["tokens_equal"] and report["served_by_own_process"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
