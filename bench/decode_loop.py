"""LLM decode loop benchmark (issue 44 item 4): what each way of sampling adds to a decode step.

    python -m bench.decode_loop --repeats 2 --out decode_loop.json  # the whole matrix, about 7 minutes on an H100

A synthetic engine (``bench/decode_engine.py``: a CUDA graph of bf16 matmuls, hidden 8192,
calibrated per batch size to take ``--step-ms`` a forward, reading the previous step's tokens
from the device and writing B x 128256 float32 logits) decodes ``--steps`` steps (after
``--warmup``) with its tokens drawn by each mode:

- ``in_process``: ``logitserve.kernels.sample`` on the engine's stream, in its process (the floor,
  and the reference every other mode's tokens are compared with; always run);
- ``sync_grpc``, ``sync_channel``: ``Client.sample`` over gRPC / the same-host channel, the logits
  and tokens in CUDA regions; the client synchronizes the engine's stream, the call returns with
  the tokens written;
- ``ordered_grpc``, ``ordered_channel``: ``Client.ordered_session()``'s stream-ordered calls,
  which return once enqueued; the engine's stream waits for the server's writes on the device;
- ``ordered_standing``: one ordered call serving every step (``repeat``), then ``session.step``:
  no message to the server per step.

Features (``bench/decode_features.py``): ``plain`` (T 0.8, top_k 50, top_p 0.9) at every step time,
``penalties_bitmask`` (plain after penalties and a bitmask), ``sequences`` (those as the rows' sequences) at 5
ms only. Seed 1234 + row, step = the step index: every mode must draw in_process's tokens. One server process
(``bench/servers.py``) serves every mode that calls one. Cells run in ``--step-ms`` order, then batch
sizes, then features; each repeat runs every mode in turn, so drift hits them alike. The JSON is rewritten
after every run, and ``--budget-s`` stops the matrix before a run that would end past it (an alarm at the
budget stops a run in progress), so the output holds every run finished.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback

from . import decode_features

MODES = ("in_process", "sync_grpc", "sync_channel", "ordered_grpc", "ordered_channel", "ordered_standing")
REFERENCE = "in_process"
TRANSPORT = {"sync_grpc": "grpc", "sync_channel": "shm", "ordered_grpc": "grpc", "ordered_channel": "shm",
             "ordered_standing": "shm"}
CALL_TIMEOUT_S = 60.0
RUN_OVERHEAD_S = 1.0  # a run's set-up and checks beyond its steps, for the budget's forecast
HARD_STOP_GRACE_S = 60.0  # past the budget, a run that does not stop (a hung wait) is ended by exiting


class OutOfBudget(BaseException):
    """The budget is spent: the matrix stops and reports. A BaseException, so that no
    ``except Exception`` on the way (a mode's error handling) swallows it."""


def _positive_list(kind):
    """An argparse type: comma-separated ``kind`` values, each > 0."""
    def parse(text: str) -> list:
        values = [kind(part) for part in text.split(",")]
        if not all(value > 0 for value in values):
            raise argparse.ArgumentTypeError(f"must all be > 0, got {text!r}")
        return values
    return parse


def _modes(text: str) -> list[str]:
    """The modes asked for, in MODES' order, with the reference first whether asked or not."""
    asked = set(text.split(","))
    unknown = asked - set(MODES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    return [mode for mode in MODES if mode in asked or mode == REFERENCE]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch", type=_positive_list(int), default="1,32,256", help="batch sizes B, comma-separated")
    parser.add_argument("--step-ms", type=_positive_list(float), default="5,2,20",
                        help="forward times the engine is calibrated to, comma-separated, run in this order")
    parser.add_argument("--modes", type=_modes, default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} ({REFERENCE} always runs: the floor and "
                             "the reference tokens)")
    parser.add_argument("--features", type=decode_features.names, default=argparse.SUPPRESS,
                        help=f"comma-separated, of {decode_features.choices()}; default: every one that runs at "
                             "a --step-ms given")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every mode per cell, interleaved")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before them (their tokens compared too)")
    parser.add_argument("--hidden", type=int, default=8192, help="the engine's hidden size")
    parser.add_argument("--vocab", type=int, default=128256, help="logits' width")
    parser.add_argument("--tolerance", type=float, default=0.1, help="calibration's aim: within this fraction of "
                                                                     "--step-ms")
    parser.add_argument("--device", default="cuda:0", help="the engine's and the server's device")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="passed to the server's command line (repeatable: --server-flag=--busy-poll-us=0)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for SERVING")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds the whole run may take: no run starts that would end past it")
    parser.add_argument("--out", help="write the results (every run) to this JSON file, and the table to the "
                                      "same name with .md")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 2 or args.warmup < 0:
        parser.error("--repeats must be >= 1, --steps >= 2 (a gap needs two forwards), --warmup >= 0")
    args.features = decode_features.resolve(getattr(args, "features", None), args.step_ms, parser.error)
    return args


# ---------------------------------------------------------------------------------- summary


def tokens_verdict(runs: list[dict]) -> str:
    """``yes`` when every compared run drew the reference's tokens; else how many steps differed."""
    compared = [run["mismatch"] for run in runs if run.get("mismatch") is not None]
    if not compared:
        return "n/a"
    bad = [m for m in compared if m["steps"]]
    if not bad:
        return "yes"
    return (f"**no**: {sum(m['steps'] for m in bad)} steps in {len(bad)} of {len(compared)} runs, first at step "
            f"{min(m['first'] for m in bad)}")


def summarize(cells: list[dict]) -> list[dict]:
    """One row per (cell, mode): medians over the mode's runs and the difference to the floor."""
    rows = []
    for cell in cells:
        by_mode: dict[str, list[dict]] = {}
        for run in cell["runs"]:
            by_mode.setdefault(run["mode"], []).append(run)
        timed = {mode: [r for r in runs if "error" not in r] for mode, runs in by_mode.items()}
        floor = timed.get(REFERENCE)
        floor_ms = statistics.median(r["ms_per_step"] for r in floor) if floor else None
        for mode in (m for m in MODES if m in by_mode):
            runs, ok = by_mode[mode], timed[mode]
            ms = statistics.median(r["ms_per_step"] for r in ok) if ok else None
            kernel = [r["kernel_us_median"] for r in ok if r.get("kernel_us_median") is not None]
            rows.append(dict(
                step_ms=cell["step_ms"], batch=cell["batch"], feature=cell["feature"], layers=cell["layers"],
                forward_ms=statistics.median(r["forward_ms_median"] for r in ok) if ok else None, mode=mode,
                ms_per_step=ms, repeats=[r["ms_per_step"] for r in ok],
                added_us=None if ms is None or floor_ms is None or mode == REFERENCE else (ms - floor_ms) * 1e3,
                gap_us=statistics.median(r["gap_us_median"] for r in ok) if ok else None,
                kernel_us=statistics.median(kernel) if kernel else None, tokens=tokens_verdict(ok),
                errors=[r["error"] for r in runs if "error" in r],
                notes=sorted({note for r in ok for note in r.get("notes", [])})))
    return rows


def _num(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| step ms | B | feature | layers | forward ms | mode | ms/step | repeats (ms/step) | added us "
             "| GPU gap us | kernel us | tokens equal |",
             "|---:|---:|---|---:|---:|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        tokens = r["tokens"] if not r["errors"] else f"error: {r['errors'][0][:100]}"
        lines.append(f"| {r['step_ms']:g} | {r['batch']} | {r['feature']} | {r['layers']} | {_num(r['forward_ms'], 2)} "
                     f"| {r['mode']} | {_num(r['ms_per_step'], 3)} | {', '.join(f'{v:.3f}' for v in r['repeats'])} "
                     f"| {_num(r['added_us'])} | {_num(r['gap_us'])} | {_num(r['kernel_us'])} | {tokens} |")
    return lines


def header(meta: dict) -> list[str]:
    lines = [f"Decode loop: {meta['date']}, {meta['gpu']}, commit {meta['commit']}, torch {meta['torch']}.",
             f"Command: `{meta['command']}`.",
             f"Engine: hidden {meta['hidden']}, vocab {meta['vocab']}, bf16 tanh layers calibrated per B to the "
             f"step time; {meta['steps']} timed steps after {meta['warmup']} warm-up, {meta['repeats']} repeats "
             f"with the modes interleaved. Features: {meta['features']}; seed 1234 + row, step = the step index.",
             "ms/step: the run's wall time over its steps, median of the repeats; added: over in_process; GPU gap: "
             "the device idle between a forward's end and the next one's start (median over steps, then repeats); "
             "kernel: in_process's sampling call on the device; tokens equal: every step's tokens as in_process's "
             "first run of the cell."]
    if meta.get("server_flags"):
        lines.append(f"Server: `logitserve serve {shlex.join(meta['server_flags'])}` on loopback.")
    lines += [f"Skipped {mode}: {reason}" for mode, reason in meta["skipped"].items()]
    if meta.get("stopped"):
        lines.append(f"Stopped early: {meta['stopped']}")
    return lines


def forecast_s(steps: int, warmup: int, step_ms: float, cell_runs: list[dict]) -> float:
    """Seconds the next run of a cell should take: its steps at the slowest ms/step the cell's
    runs so far took (the step time before any ran), plus the run's overhead."""
    ms = max([step_ms] + [run["ms_per_step"] for run in cell_runs if "ms_per_step" in run])
    return (steps + warmup) * ms / 1e3 + RUN_OVERHEAD_S


# ------------------------------------------------------------------------------------- run


def _git_commit() -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # `git status` only reads: no index refresh
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, env=env, capture_output=True,
                                text=True, timeout=30).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, env=env,
                                 capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit or 'unknown'}{f' + {len(changed)} changed files' if changed else ''}"


def write_results(meta: dict, cells: list[dict], out: str | None, final: bool) -> None:
    """The JSON (every run); when ``final``, the table too, printed and beside the JSON as .md."""
    text = None
    if final:
        text = "\n".join(header(meta) + [""] + table(summarize(cells)))
        print("\n" + text, flush=True)
    if not out:
        return
    with open(out, "w") as f:
        json.dump(dict(meta=meta, partial=not final, summary=summarize(cells), cells=cells, table=text), f, indent=1)
        f.write("\n")
    if final:
        pathlib.Path(out).with_suffix(".md").write_text(text + "\n")


def _hard_stop(server_pid: list[int]) -> None:
    """The budget and its grace passed and a wait did not return: kill the server, exit (the JSON
    on disk holds every run finished)."""
    print("# budget exceeded and the run did not stop: exiting (the JSON holds the runs finished)", file=sys.stderr,
          flush=True)
    for pid in server_pid:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    os._exit(3)


def _skip(skipped: dict, modes: list[str], reason: str) -> None:
    for mode in modes:
        skipped.setdefault(mode, reason)
        print(f"# skipping {mode}: {reason}", file=sys.stderr, flush=True)


def _clients(stack: contextlib.ExitStack, args, meta: dict, live, server_pid: list[int]) -> dict:
    """The server (when a live mode calls one) and a client per transport, closed with ``stack``."""
    from logitserve.client import Client

    from .servers import ServerSpec, running, serve_argv

    transports = sorted({TRANSPORT[mode] for mode in live() if mode in TRANSPORT})
    if not transports:
        return {}
    meta["server_flags"] = ["--device", args.device, "--warmup-widths", str(args.vocab), "--warmup-dtypes", "float32",
                            *args.server_flag]
    server = stack.enter_context(running(ServerSpec("server", serve_argv(*meta["server_flags"])),
                                         args.startup_timeout))
    server_pid.append(server.pid)
    clients = {}
    for transport in transports:
        try:
            clients[transport] = stack.enter_context(Client(server.target, timeout=CALL_TIMEOUT_S, channel=transport))
        except ImportError as exc:  # the same-host channel needs iceoryx2
            _skip(meta["skipped"], [m for m in live() if TRANSPORT.get(m) == transport], f"{transport}: {exc}")
    return clients


def _register(register, clients: dict, live, skipped: dict) -> None:
    """``register(client)`` (CUDA regions) for every client; one that cannot (no cuda-python) takes its modes out."""
    for transport, client in clients.items():
        try:
            register(client)
        except Exception as exc:  # noqa: BLE001 - reported as the modes' reason
            _skip(skipped, [m for m in live() if TRANSPORT.get(m) == transport], f"registering CUDA regions: {exc}")


def _run_cell(cell: dict, engine, params: dict, args, clients: dict, live, skipped: dict, started: float,
              save) -> None:
    """The cell's repeats, each a run of every live mode, into ``cell["runs"]``; tokens compared
    with the cell's first in_process run."""
    from .decode_engine import compare_tokens, run_mode

    reference = None
    for repeat in range(args.repeats):
        for mode in live():
            forecast = forecast_s(args.steps, args.warmup, cell["step_ms"], cell["runs"])
            elapsed = time.monotonic() - started
            if elapsed + forecast > args.budget_s:
                raise OutOfBudget(f"at {elapsed:.0f} s, before {mode} (repeat {repeat}) of the {cell['step_ms']:g} "
                                  f"ms, B {cell['batch']} cell, whose {forecast:.0f} s would pass --budget-s")
            client = clients.get(TRANSPORT.get(mode))
            try:
                run = run_mode(mode, engine, params, args.steps, args.warmup, client)
            except Exception as exc:  # noqa: BLE001 - recorded; the other modes go on
                cell["runs"].append(dict(mode=mode, repeat=repeat, error=f"{type(exc).__name__}: {exc}"))
                _skip(skipped, [mode], f"a run raised {type(exc).__name__}: {exc}")
                save()
                continue
            if TRANSPORT.get(mode) == "shm" and not client._same_host.is_open:
                run.notes.append("the channel was not open after the run: its calls went by gRPC")
            if mode == REFERENCE and reference is None:
                reference = run.tokens
            record = dict(mode=mode, repeat=repeat, **run.record(),
                          mismatch=None if reference is None else compare_tokens(reference, run.tokens))
            cell["runs"].append(record)
            print(f"# {mode} repeat {repeat}: {record['ms_per_step']:.3f} ms/step, gap {record['gap_us_median']:.1f} "
                  f"us, tokens {tokens_verdict([record])}" + "".join(f"; {n}" for n in run.notes), file=sys.stderr,
                  flush=True)
            save()


def run_matrix(args: argparse.Namespace, meta: dict, cells: list[dict], started: float, server_pid: list[int],
               save) -> None:
    """Every cell into ``cells`` (``save()`` after each run). A mode that cannot run (no channel,
    no stream-ordered calls, a run that raised) goes into ``meta["skipped"]`` with its reason,
    and the others go on."""
    import torch

    from logitserve.client import Client

    from . import decode_engine

    skipped = meta["skipped"]
    if not hasattr(Client, "ordered_session"):
        _skip(skipped, [m for m in args.modes if m.startswith("ordered_")],
              "this tree's Client has no ordered_session (stream-ordered calls)")

    def live() -> list[str]:
        return [mode for mode in args.modes if mode not in skipped]

    with contextlib.ExitStack() as stack:
        clients = _clients(stack, args, meta, live, server_pid)
        try:
            weights = decode_engine.Weights(args.hidden, args.vocab, torch.device(args.device))
            engines, lists = {}, decode_features.Lists(args.vocab, weights.device,
                                                       lambda register: _register(register, clients, live, skipped))
            for step_ms in args.step_ms:
                features = decode_features.cell_features(step_ms, args.features)
                for batch in (args.batch if features else ()):
                    if batch not in engines:
                        engines[batch] = decode_engine.Engine(weights, batch)
                        _register(engines[batch].register, clients, live, skipped)
                    engine = engines[batch]
                    layers, forward_ms = engine.calibrate_to(step_ms, args.tolerance)
                    logit_std, _ = engine.logit_spread()
                    print(f"# cell {step_ms:g} ms, B {batch}: {layers} layers, forward {forward_ms:.2f} ms, "
                          f"logits' std {logit_std:.2f}", file=sys.stderr, flush=True)
                    for name in features:
                        cells.append(dict(step_ms=step_ms, batch=batch, feature=name, layers=layers,
                                          calibrated_forward_ms=forward_ms, logit_std=logit_std, runs=[]))
                        _run_cell(cells[-1], engine, lists.params(name, batch), args, clients, live, skipped,
                                  started, save)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)  # closing the clients and stopping the server go uncut


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.decode_loop needs a CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    meta = dict(command="python -m bench.decode_loop " + shlex.join(argv if argv is not None else sys.argv[1:]),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                gpu=torch.cuda.get_device_name(args.device), commit=_git_commit(), torch=torch.__version__,
                hidden=args.hidden, vocab=args.vocab, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                features=decode_features.describe(args.features),
                skipped={}, stopped=None)
    cells: list[dict] = []
    server_pid: list[int] = []

    def out_of_budget(*_):
        raise OutOfBudget(f"the budget of {args.budget_s:g} s ran out during a run")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server is stopped on the way out
    signal.signal(signal.SIGALRM, out_of_budget)
    signal.setitimer(signal.ITIMER_REAL, args.budget_s)
    backstop = threading.Timer(args.budget_s + HARD_STOP_GRACE_S, _hard_stop, (server_pid,))
    backstop.daemon = True
    backstop.start()
    try:
        run_matrix(args, meta, cells, started, server_pid, lambda: write_results(meta, cells, args.out, False))
    except OutOfBudget as exc:
        meta["stopped"] = str(exc)
    except Exception:  # noqa: BLE001 - the runs finished are still reported
        meta["stopped"] = traceback.format_exc(limit=3)
        print(meta["stopped"], file=sys.stderr)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        backstop.cancel()
    meta["seconds"] = round(time.monotonic() - started, 1)
    write_results(meta, cells, args.out, True)
    differed = any(row["tokens"].startswith("**no**") for row in summarize(cells))
    return 0 if cells and not meta["stopped"] and not differed else 1


if __name__ == "__main__":
    raise SystemExit(main())
