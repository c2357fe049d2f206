"""Issue 33's service table: every Sample feature, sequences and VerifyDraft through the service,
beside plain Sample and the RouteExperts floor.

    python -m bench.processors_service --device cuda:0 --out ps.md        # the table, under 4 minutes
    python -m bench.processors_service --device cpu                      # smoke: 16 rows of 4096
    python -m bench.processors_service --device cpu --checkout /tmp/old  # an older tree

A server subprocess (``logitserve serve --device DEVICE``, warm-up of float32 at the run's width
only) and one client process of its own (spawned: it shares no process with the server, as a
frontend would not). Every case is called ``--calls`` times at concurrency 1 after 5 warm-up
calls (fewer where a case passes ``--case-seconds``), each call followed by a RouteExperts 1x8
(the floor, measured beside); every answer is checked (tokens in [0, V), valid, allowed by the
grammar bitmask, VerifyDraft's accepted prefix equal to the draft). Tensors live in registered
regions (torch CUDA tensors on a GPU server, a POSIX shared-memory object on a CPU one), the
outputs (``out=``) too, unless a case says "as bytes".

1. ``plain``: Sample R x V float32, temperature 0.8, top_k 50, top_p 0.9, a seed per row.
2. ``+ penalties, bitmask; regions``: repetition 1.1 and frequency 0.2 penalties over 256-token
   prompts and 1,024-token outputs a row (int64 ids and offsets) and a grammar bitmask
   [R, ceil(V / 32)] int32, all in a region.
3. ``+ bias, presence; as bytes``: case 2's lists and bitmask sent as bytes (numpy), plus a
   logit bias of 8 ids a row and a presence penalty of 0.1.
4. ``sequences + bitmask``: R sequences opened with case 2's parameters, prompts, outputs and
   penalties; Sample by ``sequence_ids`` with the bitmask (in a region) each call (each call
   appends a token to every sequence). Closed after. "n/a" on a tree without sequences.
5. ``VerifyDraft``: B 32 and 128 (``--verify-rows``), n 4, target logits, draft probabilities
   and draft tokens in a region, temperature 1, a seed per row.
6. ``RouteExperts 1x8``: f32, k 2, the gate as bytes: the floor on its own.

``--checkout DIR`` runs the server and the client process from another tree (``git archive REV
kernels server client protos | tar -x -C DIR``, as for ``bench.service_ab``). A case that fails
is a row saying why, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

from .processors_checks import EXPERTS, TOP_EXPERTS, check_route, check_sample, check_verify
from .servers import ServerSpec, running, serve_argv

PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9)
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.2)
PROMPT_LEN, OUTPUT_LEN, BIAS_PER_ROW, DRAFT_N = 256, 1024, 8, 4
WARMUP = 5
MIN_CALLS = 10  # timed calls a case makes even past --case-seconds
ALIGN = 256  # each tensor of an arena starts at a multiple of this
SEQUENCE_ID_BASE = 33_000


# --------------------------------------------------------------------------- client process


class Arena:
    """Tensors one after another in one region registered through ``client``: a torch CUDA
    buffer on a GPU server, a POSIX shared-memory object on a CPU one. ``views`` are torch
    tensors over its bytes, with the given tensors' values; ``client.sample`` and its siblings
    send them by reference."""

    def __init__(self, client, name: str, device: str, tensors: dict):
        import torch

        from logitserve.client import regions

        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        offsets, total = {}, 0
        for k, n in sizes.items():
            offsets[k], total = total, total + -(-n // ALIGN) * ALIGN
        if device.startswith("cuda"):
            self.shm, raw = None, torch.empty(total, dtype=torch.uint8, device=device)
        else:
            self.shm = regions.shared_array((total,), "uint8")
            raw = torch.from_numpy(self.shm.array)
        self.views = {k: raw[offsets[k]:offsets[k] + sizes[k]].view(t.dtype).view(t.shape) for k, t in tensors.items()}
        for k, t in tensors.items():
            self.views[k].copy_(t)
        client.register(name, raw if self.shm is None else self.shm)

    def release(self) -> None:
        """Drop the views and remove the shared-memory object (the client unregistered it at close)."""
        self.views = None
        if self.shm is not None:
            self.shm.array = self.shm.tensor = None
            try:
                self.shm.shm.close()
            except BufferError:  # the client's table may still hold a view: the process ends soon
                pass
            self.shm.unlink()


def _outputs(rows: int, extra: dict | None = None) -> dict:
    """Sample's outputs, placeholders to place in an arena."""
    import torch

    return {"token_ids": torch.zeros(rows, dtype=torch.int64), "seeds": torch.zeros(rows, dtype=torch.int64),
            "valid": torch.zeros(rows, dtype=torch.bool), **(extra or {})}


def timed_case(call, check, floor, calls: int, seconds: float) -> dict:
    """p50 / p90 (ms) of ``call()`` after the warm-up, each answer checked, and ``floor()``'s p50
    timed after each call (None: not measured)."""
    for _ in range(WARMUP):
        check(call())
    window = time.time()
    times, floors, start = [], [], time.perf_counter()
    while len(times) < calls and (len(times) < MIN_CALLS or time.perf_counter() - start < seconds):
        t0 = time.perf_counter()
        answer = call()
        times.append((time.perf_counter() - t0) * 1e3)
        check(answer)
        if floor is not None:
            t0 = time.perf_counter()
            floor()
            floors.append((time.perf_counter() - t0) * 1e3)
    p90 = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
    return dict(calls=len(times), p50=statistics.median(times), p90=p90,
                floor=statistics.median(floors) if floors else None, window=(window, time.time()))


def _inputs(rows: int, vocab: int) -> dict:
    """The Sample cases' logits, seeds, lists and bitmask (host torch tensors, the same every run)."""
    import torch

    g = torch.Generator().manual_seed(33)
    words = -(-vocab // 32)

    def ragged(per_row: int, name: str) -> dict:
        return {f"{name}_token_ids": torch.randint(0, vocab, (rows * per_row,), generator=g),
                f"{name}_offsets": torch.arange(0, rows * per_row + 1, per_row)}

    return dict(logits=torch.randn(rows, vocab, generator=g) * 3, seeds=np.arange(rows, dtype=np.int64) + 1,
                lists={**ragged(PROMPT_LEN, "prompt"), **ragged(OUTPUT_LEN, "output")},
                bias={**{k.replace("_token", ""): v for k, v in ragged(BIAS_PER_ROW, "logit_bias").items()},
                      "logit_bias_values": torch.randn(rows * BIAS_PER_ROW, generator=g) * 2},
                # random words: about half of each row's tokens allowed
                bitmask=torch.randint(-2**31, 2**31, (rows, words), generator=g, dtype=torch.int32))


def sequences_case(client, d: dict, logits, bitmask, out, rows: int, vocab: int, calls: int, seconds: float,
                   floor) -> dict:
    if not hasattr(client, "open_sequences"):
        return {"na": "this tree's client has no sequences"}
    prompts, outputs = d["lists"]["prompt_token_ids"].numpy(), d["lists"]["output_token_ids"].numpy()
    specs = [dict(id=SEQUENCE_ID_BASE + i, seed=int(d["seeds"][i]), **PARAMS, **PENALTIES,
                  prompt_token_ids=prompts[i * PROMPT_LEN:(i + 1) * PROMPT_LEN],
                  output_token_ids=outputs[i * OUTPUT_LEN:(i + 1) * OUTPUT_LEN]) for i in range(rows)]
    host_mask = d["bitmask"].numpy()
    with client.open_sequences(specs) as seqs:
        return timed_case(lambda: seqs.sample(logits, grammar_bitmask=bitmask, out=out),
                          lambda r: check_sample(r, rows, vocab, host_mask), floor, calls, seconds)


def verify_inputs(client, device: str, b: int, vocab: int, arenas: list) -> tuple[dict, np.ndarray]:
    import torch

    g = torch.Generator(device=device).manual_seed(b)
    target = torch.randn(b, DRAFT_N + 1, vocab, generator=g, device=device) * 3
    probs = torch.softmax(torch.randn(b, DRAFT_N, vocab, generator=g, device=device) * 3, dim=-1)
    draft = probs.argmax(dim=-1)
    arena = Arena(client, f"verify{b}", device, dict(
        target=target, probs=probs, draft=draft, token_ids=torch.zeros(b, DRAFT_N + 1, dtype=torch.int64),
        num_accepted=torch.zeros(b, dtype=torch.int64), valid=torch.zeros(b, dtype=torch.bool),
        seeds=torch.zeros(b, dtype=torch.int64)))
    arenas.append(arena)
    return arena.views, draft.cpu().numpy()


def measure(target: str, device: str, rows: int, vocab: int, verify_rows: list[int], calls: int,
            seconds: float, only: str | None = None) -> dict:
    """Every case, in this (client) process: ``{"tree", "device", "cases": {label: result}}``."""
    import torch

    import logitserve.client
    from logitserve.client import Client

    d = _inputs(rows, vocab)
    gate = np.random.default_rng(8).standard_normal((1, EXPERTS), dtype=np.float32)
    cases: dict[str, dict] = {}
    arenas: list[Arena] = []

    def run(label: str, n: int, make) -> None:
        if only is not None and not re.search(only, label):
            return
        print(f"# {label} ...", file=sys.stderr, flush=True)
        try:
            cases[label] = {"rows": n, **make()}
        except Exception as exc:  # noqa: BLE001 - a failing case is a row saying why; the others still run
            traceback.print_exc()
            cases[label] = {"rows": n, "failed": f"{type(exc).__name__}: {exc}".replace("\n", " ")[:160]}

    with Client(target, timeout=600) as client:
        def floor():
            return client.route_experts(gate, TOP_EXPERTS)

        main = Arena(client, "sample", device, dict(logits=d["logits"], **d["lists"], bitmask=d["bitmask"],
                                                    **_outputs(rows)))
        arenas.append(main)
        v = main.views
        logits, out = v["logits"], {k: v[k] for k in ("token_ids", "seeds", "valid")}
        in_region = {k: v[k] for k in d["lists"]}
        as_bytes = {**{k: t.numpy() for k, t in d["lists"].items()}, **{k: t.numpy() for k, t in d["bias"].items()}}
        host_mask = d["bitmask"].numpy()

        def with_mask(result) -> None:
            check_sample(result, rows, vocab, host_mask)

        run("plain", rows, lambda: timed_case(
            lambda: client.sample(logits, **PARAMS, seed=d["seeds"], out=out),
            lambda r: check_sample(r, rows, vocab), floor, calls, seconds))
        run("+ penalties, bitmask; in regions", rows, lambda: timed_case(
            lambda: client.sample(logits, **PARAMS, **PENALTIES, seed=d["seeds"], **in_region,
                                  grammar_bitmask=v["bitmask"], out=out), with_mask, floor, calls, seconds))
        run("+ bias, presence; lists as bytes", rows, lambda: timed_case(
            lambda: client.sample(logits, **PARAMS, **PENALTIES, presence_penalty=0.1, seed=d["seeds"], **as_bytes,
                                  grammar_bitmask=host_mask, out=out), with_mask, floor, calls, seconds))
        run("sequences + bitmask", rows, lambda: sequences_case(client, d, logits, v["bitmask"], out, rows, vocab,
                                                                calls, seconds, floor))
        for b in verify_rows:
            def verify_case(b=b):
                views, draft = verify_inputs(client, device, b, vocab, arenas)
                outs = {k: views[k] for k in ("token_ids", "num_accepted", "valid", "seeds")}
                seeds = np.arange(b, dtype=np.int64) + 1
                return timed_case(lambda: client.verify_draft(views["draft"], views["target"],
                                                              draft_probs=views["probs"], temperature=1.0,
                                                              seed=seeds, out=outs),
                                  lambda r: check_verify(r, draft, vocab), floor, calls, seconds)

            run(f"VerifyDraft B {b}, n {DRAFT_N}", b, verify_case)
        run(f"RouteExperts 1x{EXPERTS}, k {TOP_EXPERTS} (floor)", 1,
            lambda: timed_case(floor, check_route, None, calls, seconds))
        device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    for arena in arenas:
        arena.release()
    tree = os.path.dirname(os.path.dirname(os.path.realpath(logitserve.client.__file__)))
    return {"tree": tree, "device": device_name, "cases": cases}


def _client_entry(results, site: str | None, args: tuple) -> None:
    """The spawned client process: ``import logitserve`` from ``site`` first, when given (the
    checkout's tree; this module imports none of it at its top)."""
    if site:
        sys.path.insert(0, site)
    try:
        results.put(("ok", measure(*args)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put(("error", traceback.format_exc()))


def in_client_process(site: str | None, *args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_client_entry, args=(results, site, args))
    proc.start()
    while True:
        try:
            status, answer = results.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"client process exited with {proc.exitcode} before answering") from None
    proc.join(60)
    if status != "ok":
        raise RuntimeError("client process failed:\n" + answer)
    return answer


# ------------------------------------------------------------------------------------- report


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"


def table(cases: dict[str, dict]) -> list[str]:
    lines = ["| case | rows | calls | p50 ms | p90 ms | over plain | RouteExperts beside p50 | over floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    plain = cases.get("plain", {}).get("p50")
    for label, r in cases.items():
        shown = label if label.startswith(("VerifyDraft", "RouteExperts")) else f"Sample {label}"
        if "p50" not in r:
            why = f"n/a: {r['na']}" if "na" in r else f"failed: {r['failed']}"
            lines.append(f"| {shown} | {r['rows']} | | {why} | | | | |")
            continue
        over = None if plain is None or label == "plain" else r["p50"] - plain
        over_floor = None if r["floor"] is None else r["p50"] - r["floor"]
        lines.append(f"| {shown} | {r['rows']} | {r['calls']} | **{_ms(r['p50'])}** | {_ms(r['p90'])} | "
                     f"{'' if over is None else '+' + _ms(over) if over >= 0 else _ms(over)} | {_ms(r['floor'])} | "
                     f"{_ms(over_floor)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="the server's device: cuda:0 (the table) or cpu (smoke)")
    parser.add_argument("--backend", default="auto", help="the server's --backend")
    parser.add_argument("--rows", type=int, help="Sample's rows (default 256; cpu: 16)")
    parser.add_argument("--vocab", type=int, help="row width (default 128256; cpu: 4096)")
    parser.add_argument("--verify-rows", default="32,128", help="VerifyDraft's batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, help="timed calls a case (default 200; cpu: 20)")
    parser.add_argument("--case-seconds", type=float, default=20.0,
                        help=f"stop a case's timed calls after this long (at least {MIN_CALLS} calls)")
    parser.add_argument("--checkout", help="run the server and the client process from this tree")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--cases", help="run only the cases whose label this regular expression finds")
    parser.add_argument("--stack-samples", metavar="FILE",
                        help="sample the server's threads into FILE (bench.stack_profile); a summary per case follows "
                             "the table (the profiled figures are not the bench's)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    rows = args.rows or (256 if cuda else 16)
    vocab = args.vocab or (128256 if cuda else 4096)
    calls = args.calls or (200 if cuda else 20)
    verify_rows = [int(b) for b in args.verify_rows.split(",") if b]

    from .service import machine_line
    from .service_ab import checkout_site

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = cwd = site = None
    if args.checkout:
        cwd = os.path.abspath(args.checkout)
        site = checkout_site(cwd)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [site, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    if args.stack_samples:
        from .stack_profile import profiled_env
        env = profiled_env(env, args.stack_samples)
    spec = ServerSpec("server", serve_argv("--device", args.device, "--backend", args.backend, "--warmup-dtypes",
                                           "float32", "--warmup-widths", str(vocab)), env=env, cwd=cwd)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    t0 = time.monotonic()
    with running(spec, args.startup_timeout) as server:
        startup = time.monotonic() - t0
        measured = in_client_process(site, server.target, args.device, rows, vocab, verify_rows, calls,
                                     args.case_seconds, args.cases)
    command = shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [f"# bench.processors_service: {machine_line(args)}, {measured['device']}",
             f"Command: `python -m bench.processors_service {command}`; server and client from {measured['tree']}"
             f"{'' if args.checkout else f' (HEAD {rev.strip()})'}. Sample {rows}x{vocab} float32, T 0.8, "
             f"top_k 50, top_p 0.9, seeded; {PROMPT_LEN}-token prompts, {OUTPUT_LEN}-token outputs a row; "
             f"p50 at concurrency 1 after {WARMUP} warm-up calls, ms; outputs in regions.", "",
             *table(measured["cases"]), "",
             f"Server SERVING after {startup:.0f} s; whole run {time.monotonic() - t0:.0f} s."]
    if args.stack_samples:
        from .stack_profile import summarize
        for label, case in measured["cases"].items():
            if "window" in case:
                lines += ["", f"### server threads during {label}", *summarize(args.stack_samples, *case["window"])]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if any("failed" in r for r in measured["cases"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
