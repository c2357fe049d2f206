"""A client killed mid-decode (issue 44's third target): what the server's other clients see.

    python -m bench.ordered_kill --out ordered_kill.json   # about 1 minute on an H100

One ``logitserve serve`` process (``--max-ordered-sessions 2``) and two engine processes, each
decoding with stream-ordered calls through the same-host channel:

- the *survivor*: ``bench/decode_engine.py``'s CUDA-graphed engine (B ``--batch``, calibrated to
  ``--step-ms``), reading each step's tokens on the device, as ``bench.decode_loop`` does. It
  keeps two steps in flight and stamps each step's completion on the host
  (``time.monotonic``, one clock for every process of the machine);
- the *victim*: a light engine (its "forward" a ``torch.cuda._sleep`` of about ``--step-ms`` and a
  fill of its logits, so that it takes little of the GPU from the survivor), whose session owns
  its regions (``owned_regions``), killed with SIGKILL while its steps are in flight.

Timeline: the survivor alone, the victim starting, both decoding, the kill; then this process
opens a session in a loop until the server has let the victim's go (``--max-ordered-sessions 2``:
until then it is refused), which is the release time. The server's device memory
(``nvidia-smi``'s figure for its process) is read alone, with both, after the release and after
the survivor's session closed too (the marks of closed sessions are freed only then).
``--victims 2`` (the default) starts and kills a second victim after the first's release: memory
that rises again after it is held for good (a leak), memory that does not is the caching
allocator's, reused. The
report gives the survivor's step times (median, p99, max) in each window: a kill that stalled
the server's other work would show in the window right after it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

DEVICE = "cuda:0"
IN_FLIGHT = 2  # the survivor's steps enqueued ahead of the one it stamps


def _engine_client(target: str):
    from logitserve.client import Client

    client = Client(target, timeout=60, channel="shm")
    client.server_info()  # the channel opens with the first call
    if not client._same_host.is_open:
        raise RuntimeError("the same-host channel did not open")
    return client


def survivor(target: str, batch: int, step_ms: float) -> None:
    """Decode until stdin closes; print one JSON line of step completion times."""
    import torch

    from . import decode_engine, decode_features

    weights = decode_engine.Weights(8192, 128256, torch.device(DEVICE))
    engine = decode_engine.Engine(weights, batch)
    layers, forward_ms = engine.calibrate_to(step_ms, 0.1)
    params = decode_features.PLAIN
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stamps, done = [], []
    with _engine_client(target) as client, client.ordered_session() as session:
        engine.register(client)
        with torch.cuda.stream(engine.stream):
            engine.reset()
            n = 0
            while not stop.is_set():
                engine.forward()
                session.sample(engine.logits, out={"token_ids": engine.tokens}, stream=engine.stream, **params,
                               seed=engine.seed_rows_host, step=n)
                done.append(torch.cuda.Event())
                done[-1].record(engine.stream)
                if n == 20:
                    print("decoding", flush=True)
                if n >= IN_FLIGHT:
                    done[n - IN_FLIGHT].synchronize()
                    stamps.append(time.monotonic())
                n += 1
            engine.stream.synchronize()
    print(json.dumps(dict(stamps=stamps, layers=layers, forward_ms=forward_ms)), flush=True)


def victim(target: str, batch: int, step_ms: float) -> None:
    """Decode until killed: print ``decoding`` once steps are in flight."""
    import torch

    cycles = int(step_ms * 1e-3 * torch.cuda.get_device_properties(DEVICE).clock_rate * 1e3)
    logits = torch.empty(batch, 128256, device=DEVICE)
    tokens = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(5)
    stream = torch.cuda.Stream(DEVICE)
    with _engine_client(target) as client:
        client.register_cuda("victim-logits", logits)
        client.register_cuda("victim-tokens", tokens)
        session = client.ordered_session(owned_regions=("victim-logits", "victim-tokens"))  # they go with it
        with torch.cuda.stream(stream):
            for n in range(1_000_000):
                torch.cuda._sleep(cycles)
                torch.randn(batch, 128256, generator=generator, out=logits, device=DEVICE)
                logits[:, 0].add_(tokens.float())  # the next "forward" reads the tokens
                session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=0.8, top_k=50,
                               seed=np.arange(batch) + 1, step=n)
                if n == 20:
                    print("decoding", flush=True)
                if n % 8 == 7:  # a bounded run-ahead, as an engine's
                    stream.synchronize()


def server_mib(pid: int, quiet: list[tuple[float, float]]) -> float | None:
    """The server process's device memory as nvidia-smi lists it (None: not listed). The query
    itself stalls the GPU's work for a moment: its span goes into ``quiet``, whose steps no
    window counts."""
    began = time.monotonic()
    try:
        lines = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        quiet.append((began, time.monotonic() + 0.05))
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return float(fields[1])
    return None


def _window(stamps: np.ndarray, start: float, end: float, quiet: list[tuple[float, float]]) -> dict:
    """Step times (ms) of the steps completed in [start, end), but for those in a ``quiet`` span."""
    done = stamps[1:]
    counted = (done >= start) & (done < end)
    for a, b in quiet:
        counted &= ~((done >= a) & (done < b))
    steps = np.diff(stamps)[counted] * 1e3
    if not steps.size:
        return dict(steps=0)
    return dict(steps=int(steps.size), median_ms=float(np.median(steps)), p99_ms=float(np.percentile(steps, 99)),
                max_ms=float(steps.max()))


def _spawn(role: str, target: str, args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.ordered_kill", "--role", role, "--target", target,
                             "--batch", str(args.batch), "--step-ms", str(args.step_ms)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _await_line(process: subprocess.Popen, line: str, what: str) -> None:
    got = process.stdout.readline().strip()
    if got != line:
        raise RuntimeError(f"{what} printed {got!r} (exit {process.poll()}), not {line!r}")


def _kill(target: str, doomed: subprocess.Popen) -> tuple[float, float, float, str | None]:
    """SIGKILL ``doomed`` mid-decode; (kill, reaped, released) monotonic times and the refusal a
    third session got while both held theirs (None: it was not refused)."""
    from logitserve.client import Client, LogitServeError

    with Client(target, timeout=60) as client:
        with_both = None
        try:
            client.ordered_session().close()
        except LogitServeError as exc:
            with_both = str(exc)[:160]
        kill = time.monotonic()
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
        reaped = time.monotonic()  # a CUDA process's exit (its driver state torn down) takes a while
        while True:
            try:
                session = client.ordered_session()
                break
            except LogitServeError:
                if time.monotonic() - kill > 30:
                    raise RuntimeError("the killed victim's session was not let go within 30 s")
                time.sleep(0.002)
        released = time.monotonic()
        session.close()
    return kill, reaped, released, with_both


def orchestrate(args) -> dict:
    from .servers import ServerSpec, running, serve_argv

    flags = ["--device", DEVICE, "--warmup-widths", "128256", "--warmup-dtypes", "float32",
             "--max-ordered-sessions", "2", "--ordered-wait-s", "60"]
    marks: dict[str, float] = {}
    memory: dict[str, float | None] = {}
    quiet: list[tuple[float, float]] = []
    releases: list[float] = []
    with running(ServerSpec("server", serve_argv(*flags)), 300) as server:
        memory["server_idle"] = server_mib(server.pid, quiet)
        keep = _spawn("survivor", server.target, args)
        _await_line(keep, "decoding", "the survivor")
        marks["survivor_decoding"] = time.monotonic()
        time.sleep(args.window_s)
        memory["survivor_only"] = server_mib(server.pid, quiet)
        for victim in range(1, args.victims + 1):
            # The first victim's windows are timed; each victim's release and the memory after it
            # are kept, so that a second one tells memory held for good from the allocator's cache.
            first = victim == 1
            marks["victim_started" if first else f"victim_{victim}_started"] = time.monotonic()
            doomed = _spawn("victim", server.target, args)
            _await_line(doomed, "decoding", "the victim")
            marks["victim_decoding" if first else f"victim_{victim}_decoding"] = time.monotonic()
            time.sleep(args.window_s)
            memory["both" if first else f"both_{victim}"] = server_mib(server.pid, quiet)
            kill, reaped, released, with_both = _kill(server.target, doomed)
            if first:
                marks.update(kill=kill, reaped=reaped, released=released)
                third = with_both
            releases.append(released - kill)
            time.sleep(args.window_s)
            memory["after_release" if first else f"after_release_{victim}"] = server_mib(server.pid, quiet)
            if first:
                marks["end"] = time.monotonic()
        keep.stdin.close()
        result = json.loads(keep.stdout.readline())
        keep.wait(60)
        time.sleep(1.0)  # the survivor's session closed: no session waits, so the marks are freed
        memory["all_closed"] = server_mib(server.pid, quiet)
    stamps = np.array(result["stamps"])
    windows = {
        "alone": _window(stamps, marks["survivor_decoding"], marks["victim_started"], quiet),
        "victim_starting": _window(stamps, marks["victim_started"], marks["victim_decoding"], quiet),
        "both": _window(stamps, marks["victim_decoding"], marks["kill"], quiet),
        "first_second_after_kill": _window(stamps, marks["kill"], marks["kill"] + 1.0, quiet),
        "after": _window(stamps, marks["kill"] + 1.0, marks["end"], quiet),
    }
    during = np.concatenate([np.diff(stamps)[(stamps[1:] >= a) & (stamps[1:] < b)] for a, b in quiet]) * 1e3
    windows["during_nvidia_smi"] = dict(steps=int(during.size), max_ms=float(during.max()) if during.size else None)
    return dict(batch=args.batch, step_ms=args.step_ms, survivor_layers=result["layers"],
                survivor_forward_ms=result["forward_ms"], third_session_with_both=third,
                victim_exited_after_s=marks["reaped"] - marks["kill"], released_after_s=marks["released"] - marks["kill"], releases_s=releases,
                server_mib=memory, windows=windows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=3.0, help="seconds of each window")
    parser.add_argument("--victims", type=int, default=2, help="victims started and killed in turn (the first's "
                        "windows timed; a second's memory tells a leak from the allocator's cache)")
    parser.add_argument("--role", choices=("survivor", "victim"), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="write the report (JSON) here too")
    args = parser.parse_args(argv)
    if args.role:
        (survivor if args.role == "survivor" else victim)(args.target, args.batch, args.step_ms)
        return 0
    report = orchestrate(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
