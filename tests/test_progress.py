"""tests/progress.py: a long test shows it is still running, even with output captured.

Each case runs pytest in a second process on a generated file whose first test sleeps a second
or two, with the heartbeat every second (or half) instead of every 30.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from progress import HEARTBEAT_ENV, heartbeat_seconds

TESTS_DIR = Path(__file__).resolve().parent

SLEEPY_TESTS = """
import time

def test_sleeps():
    print("captured, never shown")
    time.sleep({sleep})

def test_quick():
    pass
"""


def run_pytest(tmp_path: Path, *args: str, heartbeat: str = "1", sleep: float = 2.5):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # rootdir here, none of the project's options
    (tmp_path / "test_sleepy.py").write_text(SLEEPY_TESTS.format(sleep=sleep))
    # No installed plugins: only this one, and a second less to start.
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env[HEARTBEAT_ENV] = heartbeat
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "progress", "-p", "no:cacheprovider", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_a_long_test_is_reported_while_it_runs_and_its_file_in_the_summary(tmp_path):
    result = run_pytest(tmp_path)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # Each second one line, and below the last the reporter starts the file's line again.
    heartbeat = r"  \.\.\. test_sleepy.py::test_sleeps still running \(\d s\)\n"
    assert re.search(rf"\n({heartbeat}){{2}}test_sleepy.py \.", out), out
    assert "test_quick still running" not in out, out
    assert "captured, never shown" not in out, out
    assert "slowest files (over 2 s)" in out and "s  test_sleepy.py\n" in out, out
    assert "2 passed" in out, out


def test_verbose_output_names_the_test_again_after_the_heartbeat(tmp_path):
    result = run_pytest(tmp_path, "-v", sleep=1.5)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"still running \(\d s\)\ntest_sleepy.py::test_sleeps PASSED", out), out


def test_quiet_quiet_turns_it_off(tmp_path):
    result = run_pytest(tmp_path, "-q", "-q", heartbeat="0.5", sleep=1.5)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "still running" not in result.stdout and "slowest files" not in result.stdout, result.stdout


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_interval_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(HEARTBEAT_ENV, value)
    rule = rf"^{HEARTBEAT_ENV}: must be a positive number of seconds, got '{value}'$"
    with pytest.raises(pytest.UsageError, match=rule):
        heartbeat_seconds()


def test_the_interval_defaults_to_30_s_and_takes_fractions(monkeypatch):
    monkeypatch.delenv(HEARTBEAT_ENV, raising=False)
    assert heartbeat_seconds() == 30
    monkeypatch.setenv(HEARTBEAT_ENV, "0.5")
    assert heartbeat_seconds() == 0.5


def test_the_suite_loads_it(pytestconfig):
    plugins = pytestconfig.pluginmanager
    assert plugins.has_plugin("progress") or plugins.is_blocked("progress")  # tests/conftest.py
