"""Structured logs: one JSON object per line and per event, on stderr.

``log_event(logger, "rpc", rpc="Sample", rows=4, status="OK", latency_ms=1.2)`` writes
``{"ts": "...", "level": "info", "logger": "logitserve.rpc", "event": "rpc", "rpc": "Sample", ...}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_ROOT = "logitserve"
# Set by --workers for each worker process: its index, written into every log line ("worker").
WORKER_ENV = "LOGITSERVE_WORKER_INDEX"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, [worker,] event, then the event's
    fields. ``worker``: the process's index under --workers (or "supervisor")."""

    def __init__(self, worker: str | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        if self.worker is not None:
            line["worker"] = self.worker
        line["event"] = record.getMessage()
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str = "info", stream=None, worker: str | None = None) -> None:
    """Send the ``logitserve`` loggers to ``stream`` (stderr) as JSON lines at ``level``, each
    with ``worker`` when given."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(worker))
    root = logging.getLogger(_ROOT)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"{_ROOT}.{name}")


def log_event(logger: logging.Logger, event: str, *, level: int = logging.INFO, exc_info=None, **fields) -> None:
    """Log one event with its fields (request id, rpc, rows, status, latency, ...)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, extra={"fields": fields}, exc_info=exc_info)


# Library convention: until configure() runs (the CLI does), warnings are not printed by
# logging's last-resort handler; in-process users attach their own handlers.
logging.getLogger(_ROOT).addHandler(logging.NullHandler())
