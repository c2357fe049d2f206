"""The server's own failures, each mapped to one gRPC status code by guard.py.

Bad requests are plain ``ValueError`` / ``TypeError`` (INVALID_ARGUMENT), as the kernels raise
them; anything not listed here or there is a fault (INTERNAL).
"""

from __future__ import annotations


class TooLarge(Exception):
    """A request over a configured limit (rows, row width): RESOURCE_EXHAUSTED."""


class QueueFull(Exception):
    """The batcher's queue is at --max-queue: RESOURCE_EXHAUSTED, answered at once."""


class DeadlineExpired(Exception):
    """The call's deadline passed before its kernel launched: DEADLINE_EXCEEDED."""


class Draining(Exception):
    """The server is shutting down and takes no new work: UNAVAILABLE."""


class Unauthenticated(Exception):
    """Missing or wrong bearer token: UNAUTHENTICATED."""


class Unsupported(Exception):
    """Something this server runs without (channels under --channels off): FAILED_PRECONDITION."""


class NotFound(LookupError):
    """No such thing to answer about (a KServe model or version): NOT_FOUND."""


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception chained to it (``__cause__``, ``__context__``), each once."""
    found, pending = [], [exc]
    while pending:
        link = pending.pop()
        if any(link is seen for seen in found):
            continue
        found.append(link)
        pending += [e for e in (link.__cause__, link.__context__) if e is not None]
    return found
