"""The status code and message of a failed call: the one place they are decided, for every
front door (the guard, KServe, the same-host channel).

By exception:

- :class:`~.regions.RegionNotFound`: NOT_FOUND (no such region of the caller); also
  :class:`~.errors.NotFound` (no such KServe model);
- :class:`~.regions.RegionExists`: ALREADY_EXISTS (a region name registered twice);
- ``ValueError``, ``TypeError``: INVALID_ARGUMENT, with the message;
- :class:`~.errors.TooLarge`, :class:`~.errors.QueueFull`, ``torch.OutOfMemoryError``:
  RESOURCE_EXHAUSTED (out of device memory, the caller may retry smaller or elsewhere);
- :class:`~.errors.DeadlineExpired`, ``asyncio.TimeoutError``: DEADLINE_EXCEEDED;
- :class:`~.errors.Draining`: UNAVAILABLE;
- :class:`~.errors.Unauthenticated`: UNAUTHENTICATED; :class:`~.errors.Unsupported`: FAILED_PRECONDITION;
- ``asyncio.CancelledError``, a stream's ``GeneratorExit``: CANCELLED (the client left; re-raised);
- anything else (a device fault): INTERNAL; that call fails, the server goes on.
"""

from __future__ import annotations

import asyncio

import grpc
import torch

from ..errors import DeadlineExpired, Draining, NotFound, QueueFull, TooLarge, Unauthenticated, Unsupported
from ..regions import RegionExists, RegionNotFound

_STATUS = (
    ((RegionNotFound, NotFound), grpc.StatusCode.NOT_FOUND),
    ((RegionExists,), grpc.StatusCode.ALREADY_EXISTS),
    ((ValueError, TypeError), grpc.StatusCode.INVALID_ARGUMENT),
    ((TooLarge, QueueFull, torch.OutOfMemoryError), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((DeadlineExpired, asyncio.TimeoutError), grpc.StatusCode.DEADLINE_EXCEEDED),
    ((Draining,), grpc.StatusCode.UNAVAILABLE),
    ((Unauthenticated,), grpc.StatusCode.UNAUTHENTICATED),
    ((Unsupported,), grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with."""
    for types, code in _STATUS:
        if isinstance(exc, types):
            return code, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}): {exc}"
