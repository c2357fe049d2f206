"""Load and soak: N concurrent clients for T seconds against a server subprocess on 127.0.0.1.

    python -m bench.load --clients 16 --seconds 60 --json load.json

Every client (an :class:`~logitserve.client.AsyncClient` plus a raw channel, one per client, on
one asyncio loop) sends a random mix (``tests/load_mix.py``, driven by ``tests/load_run.py`` as in the tests' short load run) of every RPC (Sample seeded,
unseeded, per-row, greedy, InfiniCore ``random_val``, with NaN rows; RouteExperts; Softmax on any axis; CausalSoftmax; Silu
and broadcasting SwiGLU; Step; a 3-step StreamSteps; GetServerInfo; grpc.health Check), in
float32, bfloat16 and float16, with about one request in six invalid (data shorter than the
shape, an unknown dtype, top_p 0, k > E, rows over --max-rows, garbage bytes). Each answer is
checked against the kernels called in this process on the same inputs and seeds
(``backend="torch"``, as the server runs on the CPU): tokens and indices exactly, floats within a
few ulps (batching stacks rows, which can move the vectorised tail of a row); each invalid
request must get its status code. Unseeded samples are replayed here with the seeds the server
returns.

While the clients run, the server's resident memory is read from ``/proc/<pid>/status`` every
0.5 s; the report gives it at the end of the warm-up and at the end, and the slope after warm-up.

The queue probe then starts a second server with ``--max-queue 4 --max-batch-rows 1`` whose
launches each sleep 500 ms (``logitserve.server.process``'s ``launch_delay_ms``), fires 24 calls
at once and times the RESOURCE_EXHAUSTED answers: a full queue must refuse at once, not time out.

Exit status 0 when there was no unexpected status, no wrong answer, and RSS growth after warm-up
stayed under ``--rss-growth-limit-mib``; 1 otherwise. Traffic stays on loopback; the run is
bounded by ``--seconds`` (and each call by ``--call-timeout``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

# The mix and its runner live with the tests, which import them as top-level modules (as pytest
# puts tests/ on the path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from load_run import LoadConfig as _TestLoad, run as _run_mix  # noqa: E402


@dataclasses.dataclass
class LoadConfig(_TestLoad):
    clients: int = 16
    seconds: float = 60.0
    warmup_seconds: float = 10.0  # RSS is judged from here on


def _rss_summary(samples: list[tuple[float, int]], warmup_s: float) -> dict:
    after = [(t, k) for t, k in samples if t >= warmup_s]
    if len(after) < 2:
        after = samples[len(samples) // 2:]
    t, kib = np.array([s[0] for s in after]), np.array([s[1] for s in after], dtype=float)
    slope = float(np.polyfit(t, kib, 1)[0]) * 60 / 1024 if len(after) >= 2 else 0.0
    return dict(samples=len(samples), start_mib=round(samples[0][1] / 1024, 1),
                warm_mib=round(after[0][1] / 1024, 1), end_mib=round(samples[-1][1] / 1024, 1),
                max_mib=round(max(k for _, k in samples) / 1024, 1),
                growth_after_warmup_mib=round((samples[-1][1] - after[0][1]) / 1024, 1),
                max_above_warm_mib=round((max(k for _, k in after) - after[0][1]) / 1024, 1),
                slope_mib_per_min=round(slope, 2),
                series_mib=[(round(t), round(k / 1024, 1)) for t, k in samples[::10]])  # every ~5 s



def run(config: LoadConfig) -> dict:
    """The mixed load of ``tests/load_run.py`` with the server's RSS sampled every 0.5 s."""
    samples: list[tuple[float, int]] = []

    @contextlib.contextmanager
    def sample_rss(server):
        stop, t_start = threading.Event(), time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                kib = server.rss_kib()
                if kib is not None:
                    samples.append((time.monotonic() - t_start, kib))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            sampler.join()

    report = _run_mix(config, watch=sample_rss)
    report["rss"] = _rss_summary(samples, config.warmup_seconds) if samples else {}
    return report


def markdown(report: dict) -> str:
    rss, lat = report["rss"], report["latency_ms"]
    lines = [
        "| clients | seconds | calls | calls/s | OK (checked) | expected errors | unexpected | wrong | "
        "p50 / p99 ms | RSS warm -> end (MiB) | RSS slope (MiB/min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {report['clients']} | {report['seconds']:.0f} | {report['calls']} | {report['calls_per_s']} | "
        f"{report['ok']} | {report['expected_errors']} | {report['unexpected']} | {report['wrong']} | "
        f"{lat.get('p50')} / {lat.get('p99')} | {rss.get('warm_mib')} -> {rss.get('end_mib')} | "
        f"{rss.get('slope_mib_per_min')} |",
        "",
        "Calls by RPC: " + ", ".join(f"{k} {v}" for k, v in sorted(report["by_rpc"].items())),
        "Statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(report["by_status"].items())),
        "Server RSS (s: MiB): " + ", ".join(f"{t}: {m}" for t, m in rss.get("series_mib", [])),
    ]
    if "queue_probe" in report:
        q = report["queue_probe"]
        lines += ["", f"Queue probe: {q['calls']} calls at once, --max-queue {q['max_queue']}, "
                  f"{q['launch_delay_ms']:.0f} ms per launch: {q['served']} served (slowest {q['max_served_ms']} ms), "
                  f"{q['exhausted']} RESOURCE_EXHAUSTED (median {q['median_exhausted_ms']} ms, "
                  f"max {q['max_exhausted_ms']} ms), {q['unexpected']} other statuses, {q['wrong']} wrong."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup-seconds", type=float, default=10.0, help="RSS growth is measured after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--call-timeout", type=float, default=30.0)
    p.add_argument("--no-queue-probe", action="store_true")
    p.add_argument("--rss-growth-limit-mib", type=float, default=32.0)
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 3600:
        p.error("--clients must be in [1, 256] and --seconds in (0, 3600]")
    config = LoadConfig(clients=args.clients, seconds=args.seconds, warmup_seconds=args.warmup_seconds,
                        seed=args.seed, call_timeout=args.call_timeout, queue_probe=not args.no_queue_probe)
    report = run(config)
    print(markdown(report))
    for failure in report["failures"][:20]:
        print("FAILURE:", failure)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = report["unexpected"] or report["wrong"] or report["server_exit_code"] != 0
    bad = bad or report["rss"].get("growth_after_warmup_mib", 0) > args.rss_growth_limit_mib
    bad = bad or report.get("queue_probe", {}).get("unexpected", 0) or report.get("queue_probe", {}).get("wrong", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
