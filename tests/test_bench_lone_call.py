"""bench/lone_call: the lone-call loop runs the server's real path (and the bare handler's) to
an answer. Each in a process of its own: the tool patches the guard and the servicer."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flags", [[], ["--bare"]], ids=["full", "bare"])
def test_lone_call_loop_answers(flags):
    done = subprocess.run([sys.executable, "-m", "bench.lone_call", "--calls", "200", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"lone Sample call ({'bare' if flags else 'full'}): median ")
    assert "(180 calls;" in done.stdout
