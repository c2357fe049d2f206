"""What the guarded handlers see of a call that came through a channel: the part of
``grpc.aio.ServicerContext`` they use, answered from the channel and the request's header.

The handlers (servicer.py, wrapped by guard.py) are gRPC's; with this context they serve a
channel's call unchanged: the same token check (the channel's ``authorization``, re-checked every
call, so a token taken off the file stops its channels too), the same owner of regions and
sequences, the same deadline, limits, drain, status codes and messages.
"""

from __future__ import annotations

import time

import grpc

from ..guard import REQUEST_ID_KEY
from ...identity import AUTHORIZATION


class ChannelCallContext:
    """One channel call's context. ``metadata``: the pairs gRPC would deliver (authorization,
    x-request-id); ``timeout_s``: the caller's deadline from the call's arrival, None for none."""

    def __init__(self, peer: str, authorization: str | None, request_id: str | None, timeout_s: float | None):
        pairs = []
        if authorization is not None:
            pairs.append((AUTHORIZATION, authorization))
        if request_id:
            pairs.append((REQUEST_ID_KEY, request_id))
        self._metadata = tuple(pairs)
        self._peer = peer
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._done_callbacks = []
        self.request_id = request_id or ""
        self.status: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def set_trailing_metadata(self, pairs) -> None:
        # The guard's one trailer is the call's request id: it goes back in the answer's header.
        for key, value in pairs:
            if key == REQUEST_ID_KEY:
                self.request_id = value

    def code(self) -> grpc.StatusCode | None:
        return self.status

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """As gRPC's: the call ends with ``code``; raises AbortError, as gRPC's does."""
        self.status, self.details = code, details
        raise grpc.aio.AbortError(code, details)

    def add_done_callback(self, callback) -> None:
        self._done_callbacks.append(callback)

    def done(self) -> None:
        """The call has ended (its answer sent or dropped): run the callbacks, once."""
        callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback(self)
