"""Where a server process spends its host time, thread by thread: a sampling profiler for benches.

    LOGITSERVE_STACK_SAMPLES=FILE python -c "import bench.stack_profile as p; p.start_from_env(); ..."
    python -m bench.stack_profile FILE [--from T0 --to T1] [--top 25]

:func:`start` runs a daemon thread that reads every other thread's Python stack each
millisecond (``sys._current_frames``) and counts each stack per second of wall time; the
counts go to FILE (JSON) every two seconds and at exit. A bench (``bench.processors_service
--stack-samples``) starts it in the server through a ``sitecustomize`` on the server's path,
and keeps each case's wall-clock window, so that the summary of a window is what the server did
during that case. The summary lists, per thread, the functions present in the most samples
(inclusive) and the leaves (where the time is spent itself). A sample costs the sampled process
a few microseconds of the GIL: the figures of a profiled run are not the bench's figures.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import sys
import threading
import time
from typing import Callable

ENV = "LOGITSERVE_STACK_SAMPLES"
INTERVAL_S = 0.001
DUMP_EVERY_S = 2.0


def _stack(frame) -> str:
    names = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return ";".join(reversed(names))


def start(path: str) -> Callable[[], None]:
    """Sample every thread of this process into ``path`` until it exits; returns the function
    that writes the samples so far (also run every DUMP_EVERY_S and at exit)."""
    counts: collections.Counter = collections.Counter()  # (second, thread id, stack) -> samples
    names: dict[int, str] = {}  # every thread seen alive, by id (kept once it has ended)
    lock = threading.Lock()

    def dump() -> None:
        names.update((t.ident, t.name) for t in threading.enumerate())
        with lock:
            rows = [[second, names.get(tid, str(tid)), stack, n] for (second, tid, stack), n in counts.items()]
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f)
        os.replace(path + ".tmp", path)

    def sample() -> None:
        me, last_dump = threading.get_ident(), time.monotonic()
        while True:
            time.sleep(INTERVAL_S)
            second = int(time.time())
            frames = sys._current_frames()
            with lock:
                for tid, frame in frames.items():
                    if tid != me:
                        counts[(second, tid, _stack(frame))] += 1
            if any(tid not in names for tid in frames):  # a thread started: named while it lives
                names.update((t.ident, t.name) for t in threading.enumerate())
            if time.monotonic() - last_dump > DUMP_EVERY_S:
                dump()
                last_dump = time.monotonic()

    threading.Thread(target=sample, name="stack-sampler", daemon=True).start()
    atexit.register(dump)
    return dump


def start_from_env() -> None:
    if os.environ.get(ENV):
        start(os.environ[ENV])


def profiled_env(env: dict[str, str] | None, path: str) -> dict[str, str]:
    """``env`` (None: this process's) for a server subprocess that samples its threads into ``path``."""
    import tempfile
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hook = sitecustomize_dir(repo, tempfile.mkdtemp(prefix="stack-profile-"))
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([hook, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env[ENV] = os.path.abspath(path)
    return env


def sitecustomize_dir(repo: str, into: str) -> str:
    """A directory holding a ``sitecustomize.py`` that starts the sampler where ``ENV`` is set:
    put it on a server's PYTHONPATH."""
    os.makedirs(into, exist_ok=True)
    with open(os.path.join(into, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {repo!r})\nimport bench.stack_profile\n"
                f"bench.stack_profile.start_from_env()\n")
    return into


def summarize(path: str, start_s: float | None = None, end_s: float | None = None, top: int = 25) -> list[str]:
    """Per thread, in ``[start_s, end_s]`` (wall seconds): samples, the most present functions
    (inclusive share) and the commonest leaves (self share)."""
    with open(path) as f:
        rows = json.load(f)
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for second, thread, stack, n in rows:
        if (start_s is None or second >= int(start_s)) and (end_s is None or second <= end_s):
            per_thread[thread][stack] += n
    lines = []
    for thread, stacks in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(stacks.values())
        inclusive, leaves = collections.Counter(), collections.Counter()
        for stack, n in stacks.items():
            frames = stack.split(";")
            for name in set(frames):
                inclusive[name] += n
            leaves[frames[-1]] += n
        lines.append(f"## thread {thread}: {total} samples")
        lines.append("inclusive: " + ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in inclusive.most_common(top)))
        lines.append("leaves: " + ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in leaves.most_common(top)))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--from", dest="start", type=float)
    parser.add_argument("--to", dest="end", type=float)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print("\n".join(summarize(args.file, args.start, args.end, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
