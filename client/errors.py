"""The one exception the client raises for a failed call."""

from __future__ import annotations

import grpc


class LogitServeError(Exception):
    """A call that ended with a status other than OK.

    ``code`` is the ``grpc.StatusCode`` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
    CANCELLED, UNAVAILABLE, UNAUTHENTICATED, INTERNAL, ...), ``details`` the server's message
    (for a bad request it names the field and the rule).
    """

    def __init__(self, code: grpc.StatusCode, details: str | None):
        self.code = code
        self.details = details or ""
        super().__init__(f"{code.name}: {self.details}")

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> "LogitServeError":
        return cls(exc.code(), exc.details())
