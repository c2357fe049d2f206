"""Interleaved A/B benchmark of whole servers: which server is faster, and by more than A/A noise?

    python -m bench.service_ab --checkout old=/path/to/old \\
        --variant echo=echo --variant old=old:serve --variant new=serve --variant new2=serve \\
        --variant nopoll="serve --busy-poll-us 0" \\
        --server-arg="--device cuda:0 --warmup-dtypes bfloat16 --warmup-widths 128256" \\
        --rounds 12 --calls 300,1500,3000 --out ab.md

A variant is ``NAME=SPEC``. SPEC is ``echo [FLAGS]`` (``bench.echo_server``, the transport
floor) or ``[CHECKOUT:]serve [FLAGS]``: the public ``logitserve serve`` CLI with its flags, run
from this tree or from a checkout named by ``--checkout NAME=DIR`` (a directory holding
``src/logitserve/`` of another commit, e.g. ``git archive REV src | tar -x -C DIR``, put ahead
of ``PYTHONPATH`` so that ``import logitserve.*`` is that checkout; a commit from before the src
layout holds ``kernels/``, ``server/``, ``client/`` and ``protos/logitserve/v1`` instead, and its
server runs with a folder of symlinks onto them).
``--server-arg`` (shell-split, repeatable) is added to every ``serve`` variant. Two variants
with the same spec (and checkout) are an A/A pair: they measure how far two identical servers
differ, which is the noise any A/B difference must beat.

All servers start at once, each on its own port. Then the cases (Sample 1x``--vocab`` bf16,
the pool of ``bench/payloads.py``: every request its own logits, temperature, top_k, top_p and
seed; ``--concurrency`` calls in flight, ``--calls`` calls each after ``--warmup``) are driven
variant by variant, case by case, round after round, the variants in a fresh random order for
every case of every round. The host drifts by tens of percent within minutes; interleaving puts
every variant under the same drift, and the random order keeps any effect of going first or
after another variant off the comparison.

The report, per variant and case: the medians over rounds of p50 latency and calls/s, each with
the rounds' values, and the server's requests per launch (its ServerInfo counters). Then every
variant against the first non-echo variant, round by round: the median difference of p50 (us)
and of calls/s (%), and in how many rounds it was faster. Then the A/A spread: for each group of
same-spec variants, the median over rounds (and pairs) of the absolute difference. Markdown to
stdout and ``--out FILE``, the rounds' numbers as JSON beside it (``FILE`` with ``.json``).

A CPU smoke run (tiny vocab, two rounds):

    python -m bench.service_ab --checkout old=/tmp/ab-old --variant echo=echo --variant old=old:serve \\
        --variant new=serve --variant new2=serve --server-arg="--device cpu --warmup-dtypes bfloat16 \\
        --warmup-widths 4096" --vocab 4096 --rounds 2 --calls 40,80,160 --warmup 5 --out /tmp/ab.md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import pathlib
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from logitserve.client import Client

from .driver import drive
from .payloads import sample_payload
from .servers import Running, ServerSpec, echo_argv, running_all, serve_argv

# The package folders of a checkout from before the src layout, as ``import logitserve.<name>``
# found them (its pyproject's package-dir).
PACKAGE_DIRS = (("kernels", "kernels"), ("server", "server"), ("client", "client"), ("v1", "protos/logitserve/v1"))
# Packages a checkout has from some commit on: linked where present (the Triton-protocol front's
# generated code, since its server imports it).
LATER_PACKAGE_DIRS = (("kserve", "protos/logitserve/kserve"),)


@dataclasses.dataclass
class Variant:
    name: str
    spec: str  # as written after NAME=
    checkout: str | None  # its name in --checkout, None: this tree
    server: ServerSpec

    @property
    def is_echo(self) -> bool:
        return self.server.is_echo

    @property
    def group(self) -> tuple:
        """Variants of one group run the same server: an A/A pair (or more)."""
        words = shlex.split(self.spec)
        return self.checkout, tuple(words)


def checkout_site(directory: str) -> str:
    """A folder from which ``import logitserve`` finds ``directory``'s packages: its ``src/``, or
    for a commit from before the src layout, symlinks onto its package folders, made once."""
    directory = os.path.abspath(directory)
    if os.path.isdir(os.path.join(directory, "src", "logitserve")):
        return os.path.join(directory, "src")
    for _, path in PACKAGE_DIRS:
        if not os.path.isdir(os.path.join(directory, path)):
            raise SystemExit(f"--checkout {directory}: no {path}/ there")
    tag = hashlib.sha1(directory.encode()).hexdigest()[:10]
    site = os.path.join(tempfile.gettempdir(), f"logitserve-ab-site-{tag}")
    os.makedirs(os.path.join(site, "logitserve"), exist_ok=True)
    for name, path in PACKAGE_DIRS + LATER_PACKAGE_DIRS:
        link = os.path.join(site, "logitserve", name)
        if os.path.islink(link):
            os.unlink(link)
        if os.path.isdir(os.path.join(directory, path)):
            os.symlink(os.path.join(directory, path), link)
    return site


def parse_variant(text: str, checkouts: dict[str, str], server_args: list[str]) -> Variant:
    """``NAME=echo [FLAGS]`` or ``NAME=[CHECKOUT:]serve [FLAGS]``."""
    name, sep, spec = text.partition("=")
    words = shlex.split(spec)
    if not sep or not name or not words:
        raise SystemExit(f"--variant {text!r}: expected NAME=SPEC")
    if words[0] == "echo":
        return Variant(name, spec, None, ServerSpec(name, echo_argv(*words[1:]), is_echo=True))
    checkout, _, command = words[0].rpartition(":")
    if command != "serve":
        raise SystemExit(f"--variant {text!r}: SPEC is echo or [CHECKOUT:]serve, then flags")
    env = cwd = None
    if checkout:
        if checkout not in checkouts:
            raise SystemExit(f"--variant {text!r}: no --checkout {checkout}=DIR")
        cwd = os.path.abspath(checkouts[checkout])
        path = [checkout_site(cwd), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    argv = serve_argv(*server_args, *words[1:])
    return Variant(name, spec, checkout or None, ServerSpec(name, argv, env=env, cwd=cwd))


def source_of(variant: Variant) -> str:
    """Where the variant's ``logitserve.server`` is imported from (checked, not assumed)."""
    if variant.is_echo:
        return "bench/echo_server.py"
    probe = "import os, logitserve.server as s; print(os.path.realpath(os.path.dirname(s.__file__)))"
    done = subprocess.run([sys.executable, "-c", probe], env=variant.server.env, cwd=variant.server.cwd,
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"{variant.name}: cannot import logitserve.server: {done.stderr.strip()[-500:]}")
    return done.stdout.strip()


def launch_counts(variant: Variant, server: Running) -> tuple[int, int] | None:
    """The server's (launches, requests they served) so far, from ServerInfo; None for echo."""
    if variant.is_echo:
        return None
    with Client(server.target) as client:
        stats = client.server_info().stats
    return stats.get("launches", 0), stats.get("batched_requests", 0)


def measure(variant: Variant, server: Running, payload, concurrency: int, calls: int, args) -> dict:
    """One case of one variant in one round: p50 (us), calls/s, requests/launch, errors."""
    before = launch_counts(variant, server)
    latencies, errors, wall, _, _ = asyncio.run(drive(server.target, payload, concurrency, calls, args.warmup,
                                                      args.max_seconds, not variant.is_echo))
    after = launch_counts(variant, server)
    latencies.sort()
    per_launch = None
    if before is not None and after is not None and after[0] > before[0]:
        per_launch = (after[1] - before[1]) / (after[0] - before[0])
    return dict(p50_us=latencies[len(latencies) // 2] if latencies else float("nan"),
                calls_per_s=len(latencies) / wall if wall > 0 else float("nan"),
                requests_per_launch=per_launch, calls=len(latencies), errors=errors)


def run_rounds(variants: list[Variant], servers: dict[str, Running], cases: list[tuple[int, int]], args) -> dict:
    """``runs[variant][concurrency]``: one measurement per round, the variants in a fresh random
    order for every case of every round."""
    payload = sample_payload(args.vocab, "bf16", np.random.default_rng(args.seed))
    order = random.Random(args.seed)
    runs: dict[str, dict[int, list[dict]]] = {v.name: {c: [] for c, _ in cases} for v in variants}
    for r in range(args.rounds):
        for concurrency, calls in cases:
            for v in order.sample(variants, len(variants)):
                m = measure(v, servers[v.name], payload, concurrency, calls, args)
                if m["errors"]:
                    print(f"# round {r + 1} {v.name} c={concurrency}: errors {m['errors']}", file=sys.stderr)
                runs[v.name][concurrency].append(m)
        print(f"# round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    return runs


# ------------------------------------------------------------------------------------ report


def _each(values, fmt: str = "{:.0f}") -> str:
    return " ".join(fmt.format(x) for x in values)


def paired(runs: list[dict], reference: list[dict]) -> dict:
    """Round by round against the reference: p50 difference (us, lower is faster) and calls/s
    difference (%, higher is faster); medians and the rounds it was faster in."""
    p50 = [a["p50_us"] - b["p50_us"] for a, b in zip(runs, reference)]
    rate = [100.0 * (a["calls_per_s"] / b["calls_per_s"] - 1.0) for a, b in zip(runs, reference)]
    return dict(p50_diff_us=statistics.median(p50), p50_faster_rounds=sum(d < 0 for d in p50),
                calls_per_s_diff_pct=statistics.median(rate), calls_per_s_faster_rounds=sum(d > 0 for d in rate),
                rounds=len(p50), p50_diffs_us=p50, calls_per_s_diffs_pct=rate)


def aa_spread(members: list[str], runs: dict, concurrency: int) -> dict:
    """Median over rounds and pairs of |p50 difference| (us) and |calls/s difference| (%)."""
    p50, rate = [], []
    for a, b in itertools.combinations(members, 2):
        for x, y in zip(runs[a][concurrency], runs[b][concurrency]):
            p50.append(abs(x["p50_us"] - y["p50_us"]))
            rate.append(abs(100.0 * (x["calls_per_s"] / y["calls_per_s"] - 1.0)))
    return dict(p50_abs_diff_us=statistics.median(p50), calls_per_s_abs_diff_pct=statistics.median(rate))


def report(variants: list[Variant], sources: dict[str, str], runs: dict, cases: list[tuple[int, int]],
           args, command: str) -> tuple[str, dict]:
    lines = [f"Interleaved A/B, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, "
             f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end.",
             f"Command: `{command}`",
             f"Sample 1x{args.vocab} bf16; {args.rounds} rounds; calls per case "
             f"{', '.join(f'{n} at c={c}' for c, n in cases)} (or {args.max_seconds:.0f} s), {args.warmup} warm-up.",
             "", "| variant | spec | server from |", "|---|---|---|"]
    lines += [f"| {v.name} | `{v.spec}` | {sources[v.name]} |" for v in variants]
    lines += ["", "| variant | c | p50 us (median) | p50 us by round | calls/s (median) | calls/s by round "
              "| requests/launch | errors |", "|---|---:|---:|---|---:|---|---:|---:|"]
    summary: dict = {}
    for c, _ in cases:
        for v in variants:
            rs = runs[v.name][c]
            p50s, rates = [m["p50_us"] for m in rs], [m["calls_per_s"] for m in rs]
            per_launch = [m["requests_per_launch"] for m in rs if m["requests_per_launch"] is not None]
            errors = sum(sum(m["errors"].values()) for m in rs)
            row = dict(p50_us=statistics.median(p50s), calls_per_s=statistics.median(rates),
                       requests_per_launch=statistics.median(per_launch) if per_launch else None, errors=errors)
            summary.setdefault(v.name, {})[c] = row
            lines.append(f"| {v.name} | {c} | {row['p50_us']:.0f} | {_each(p50s)} | {row['calls_per_s']:.0f} "
                         f"| {_each(rates)} | {'' if not per_launch else f'{statistics.median(per_launch):.2f}'} "
                         f"| {errors} |")
    compared = [v for v in variants if not v.is_echo]
    comparisons: dict = {}
    if len(compared) > 1:
        ref = compared[0].name
        lines += ["", f"Against `{ref}`, round by round (median difference; rounds faster of all):", "",
                  "| variant | c | p50 diff us | p50 lower in | calls/s diff % | calls/s higher in |",
                  "|---|---:|---:|---:|---:|---:|"]
        for c, _ in cases:
            for v in compared[1:]:
                p = paired(runs[v.name][c], runs[ref][c])
                comparisons.setdefault(v.name, {})[c] = p
                lines.append(f"| {v.name} | {c} | {p['p50_diff_us']:+.0f} | {p['p50_faster_rounds']}/{p['rounds']} "
                             f"| {p['calls_per_s_diff_pct']:+.1f} | {p['calls_per_s_faster_rounds']}/{p['rounds']} |")
    groups: dict[tuple, list[str]] = {}
    for v in variants:
        groups.setdefault(v.group, []).append(v.name)
    spreads: dict = {}
    aa = [members for members in groups.values() if len(members) > 1]
    if aa:
        lines += ["", "A/A spread (same spec; median over rounds of the absolute difference):", "",
                  "| variants | c | p50 abs diff us | calls/s abs diff % |", "|---|---:|---:|---:|"]
        for c, _ in cases:
            for members in aa:
                s = aa_spread(members, runs, c)
                spreads.setdefault(" ".join(members), {})[c] = s
                lines.append(f"| {' '.join(members)} | {c} | {s['p50_abs_diff_us']:.0f} "
                             f"| {s['calls_per_s_abs_diff_pct']:.1f} |")
    data = dict(command=command, vocab=args.vocab, rounds=args.rounds, cases=cases,
                variants={v.name: dict(spec=v.spec, checkout=v.checkout, source=sources[v.name]) for v in variants},
                summary=summary, against=compared[0].name if len(compared) > 1 else None, comparisons=comparisons,
                aa_spread=spreads, runs=runs)
    return "\n".join(lines), data


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.service_ab", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=SPEC", help="repeatable, in order")
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR",
                        help="a source checkout of another commit, for variants CHECKOUT:serve")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="flags added to every serve variant (shell-split, repeatable)")
    parser.add_argument("--vocab", type=int, default=128256, help="Sample width (default 128256)")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8, 64], help="calls in flight, e.g. 1,8,64")
    parser.add_argument("--calls", type=_ints, default=[300, 1500, 3000],
                        help="timed calls per case and round: one number, or one per --concurrency")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls before each case and round")
    parser.add_argument("--max-seconds", type=float, default=20.0, help="time bound per case and round")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0, help="of the payload pool and the variants' order")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for all to be SERVING")
    parser.add_argument("--out", help="also write the Markdown here, and the JSON beside it")
    args = parser.parse_args(argv)
    if len(args.calls) == 1:
        args.calls *= len(args.concurrency)
    if len(args.calls) != len(args.concurrency):
        parser.error("--calls: one number, or one per --concurrency")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    checkouts = {}
    for text in args.checkout:
        name, sep, directory = text.partition("=")
        if not sep or not name or not directory:
            parser.error(f"--checkout {text!r}: expected NAME=DIR")
        checkouts[name] = directory
    server_args = [word for text in args.server_arg for word in shlex.split(text)]
    variants = [parse_variant(text, checkouts, server_args) for text in args.variant]
    if not variants or len({v.name for v in variants}) != len(variants):
        parser.error("--variant: at least one, each NAME once")
    cases = list(zip(args.concurrency, args.calls))
    command = "python -m bench.service_ab " + shlex.join(argv)
    sources = {v.name: source_of(v) for v in variants}

    # SIGTERM stops the servers too (running_all's `finally` runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with running_all([v.server for v in variants], args.startup_timeout) as started:
        servers = {v.name: s for v, s in zip(variants, started)}
        runs = run_rounds(variants, servers, cases, args)
    text, data = report(variants, sources, runs, cases, args, command)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    errors = sum(sum(m["errors"].values()) for per_case in runs.values() for rs in per_case.values() for m in rs)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
