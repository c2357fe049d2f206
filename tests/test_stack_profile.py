"""bench.stack_profile, the benches' sampling profiler: a process that samples itself writes each
thread's stacks per second, and the summary of a window names where a busy thread spent it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from bench.stack_profile import summarize

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_a_busy_thread_is_found_where_it_spins(tmp_path):
    out = tmp_path / "stacks.json"
    program = textwrap.dedent(f"""
        import threading, time
        import bench.stack_profile as profile
        profile.start({str(out)!r})

        def spin_here():
            end = time.monotonic() + 1.5  # long enough to be sampled on a loaded machine
            while time.monotonic() < end:
                pass

        worker = threading.Thread(target=spin_here, name="spinner")
        worker.start()
        worker.join()
    """)
    start = time.time()
    subprocess.run([sys.executable, "-c", program], check=True, cwd=ROOT, timeout=60)
    lines = summarize(str(out), start - 1, time.time() + 1)
    spinner = lines[[i for i, line in enumerate(lines) if line.startswith("## thread spinner")][0] + 1]
    assert "<string>:spin_here" in spinner, lines
