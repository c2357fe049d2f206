"""The one exception the client raises for a failed call."""

from __future__ import annotations

import grpc


class LogitServeError(Exception):
    """A call that ended with a status other than OK.

    ``code`` is the ``grpc.StatusCode`` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
    CANCELLED, UNAVAILABLE, UNAUTHENTICATED, NOT_FOUND, INTERNAL, ...), ``details`` the server's
    message (for a bad request it names the field and the rule). ``dropped``: the regions (the
    caller's names) the client dropped from its table because this answer said the server no
    longer has them (a NOT_FOUND for a region registered through the client).
    """

    def __init__(self, code: grpc.StatusCode, details: str | None, dropped=()):
        self.code = code
        self.details = details or ""
        self.dropped = tuple(dropped)
        message = f"{code.name}: {self.details}"
        if self.dropped:
            names = ", ".join(repr(name) for name in self.dropped)
            message += (f" (the server no longer has region {names}: dropped from this client's registered "
                        f"regions, with the memory it kept alive for it; register it again to use it)")
        super().__init__(message)

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> "LogitServeError":
        return cls(exc.code(), exc.details())

    def dropping(self, names) -> "LogitServeError":
        """This error, saying that ``names`` were dropped from the client's table."""
        return LogitServeError(self.code, self.details, (*self.dropped, *names))
