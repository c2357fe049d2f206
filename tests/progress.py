"""Progress for long tests: a line while a test runs long, and the slowest files at the end.

pytest prints a dot when a test finishes, so a test that runs for minutes (a statistical run,
the interpreter, a container build, venvs for the client install) leaves the terminal silent
that long. Here a background thread writes ``  ... <test> still running (30 s)`` every
``LOGITSERVE_TEST_HEARTBEAT_S`` seconds (30 by default) while a test's setup, call or
teardown runs, and the summary lists the files that took longer than two such intervals.
``-q -q`` (or ``-p no:progress``) turns both off.

The line goes to a duplicate of the terminal's file descriptor taken at start-up, the way
pytest's faulthandler plugin keeps stderr: pytest's default capture redirects descriptor 1
itself while a test runs, so the terminal reporter's own stream would land in the test's
captured output.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

import pytest

HEARTBEAT_ENV = "LOGITSERVE_TEST_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 30.0
SLOWEST_FILES_SHOWN = 10


def heartbeat_seconds() -> float:
    raw = os.environ.get(HEARTBEAT_ENV, "")
    if not raw:
        return DEFAULT_HEARTBEAT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):  # nan fails both
        raise pytest.UsageError(f"{HEARTBEAT_ENV}: must be a positive number of seconds, got {raw!r}")
    return seconds


def terminal_fd(config: pytest.Config) -> int | None:
    """A duplicate of the terminal's stdout descriptor, or None where stdout has none."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    try:
        if capture is None:
            return os.dup(sys.stdout.fileno())
        with capture.global_and_fixture_disabled():
            return os.dup(sys.stdout.fileno())
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both Value- and OSError
        return None


@pytest.hookimpl(trylast=True)  # after the terminal plugin's configure has made its reporter
def pytest_configure(config: pytest.Config) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or config.get_verbosity() <= -2:
        return
    interval = heartbeat_seconds()
    fd = terminal_fd(config)
    if fd is None:
        return
    config.pluginmanager.register(Progress(reporter, fd, interval), "progress-heartbeat")


class Progress:
    def __init__(self, reporter, fd: int, interval: float) -> None:
        self._reporter = reporter
        self._fd = fd
        self._encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        self._interval = interval
        self._file_seconds: collections.Counter[str] = collections.Counter()
        # One lock for the state the thread reads and for the thread's writes. The main thread
        # leaves a phase under it, so a line is never written while the reporter writes its own.
        self._cond = threading.Condition()
        self._nodeid: str | None = None
        self._started = 0.0
        self._due = 0.0
        self._phase: str | None = None  # setup, call or teardown while one runs
        self._stopped = False
        self._thread = threading.Thread(target=self._beat, name="test-heartbeat", daemon=True)

    def pytest_sessionstart(self) -> None:
        self._thread.start()

    def pytest_unconfigure(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        os.close(self._fd)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        with self._cond:
            self._nodeid = nodeid
            self._started = time.monotonic()
            self._due = self._started + self._interval
            self._cond.notify()

    def pytest_runtest_logfinish(self) -> None:
        with self._cond:
            self._nodeid = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self):
        return (yield from self._in_phase("setup"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self):
        return (yield from self._in_phase("call"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self):
        return (yield from self._in_phase("teardown"))

    def _in_phase(self, phase: str):
        with self._cond:
            self._phase = phase
            self._cond.notify()
        try:
            return (yield)
        finally:
            with self._cond:
                self._phase = None

    @pytest.hookimpl(tryfirst=True)  # before the reporter writes the report's letter
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._file_seconds[report.nodeid.split("::")[0]] += report.duration
        reporter = self._reporter
        writes_a_letter = report.when == "call" or not report.passed
        dots_mode = reporter.showfspath and not reporter.showlongtestinfo
        if writes_a_letter and dots_mode and reporter.currentfspath is None:
            # A heartbeat ended the file's line: start it again, so the letter doesn't trail
            # the heartbeat and the reporter's column count stays true.
            reporter.write_fspath_result(report.nodeid, "")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        threshold = 2 * self._interval
        slow = [(s, f) for f, s in self._file_seconds.items() if s > threshold]
        if not slow:
            return
        terminalreporter.write_sep("=", f"slowest files (over {threshold:g} s)")
        for seconds, path in sorted(slow, reverse=True)[:SLOWEST_FILES_SHOWN]:
            terminalreporter.write_line(f"{seconds:7.0f} s  {path}")

    def _beat(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._nodeid is None or self._phase is None:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                if now < self._due:
                    self._cond.wait(self._due - now)
                    continue
                self._write_line(now)
                while self._due <= now:
                    self._due += self._interval

    def _write_line(self, now: float) -> None:
        phase = "" if self._phase == "call" else f", {self._phase}"
        line = f"\n  ... {self._nodeid} still running ({now - self._started:.0f} s{phase})"
        reporter = self._reporter
        if reporter.showfspath or reporter.showlongtestinfo:
            # Left open: the reporter ends it when it next writes, starting the file's or the
            # test's line again (see pytest_runtest_logreport).
            reporter.currentfspath = None
        else:
            line += "\n"  # -q: the dots go on below
        try:
            os.write(self._fd, line.encode(self._encoding, "replace"))
        except OSError:
            pass  # a closed terminal must not fail the run
