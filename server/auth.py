"""Bearer tokens from a file: one per line, re-read on SIGHUP, compared in constant time.

Blank lines and lines starting with ``#`` are skipped. Tokens are never logged.
"""

from __future__ import annotations

import hmac
import pathlib

from .logs import get_logger, log_event

log = get_logger("auth")


class TokenStore:
    """The tokens of ``path``; :meth:`check` tests an ``authorization`` metadata value."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self._tokens: tuple[bytes, ...] = ()
        self._tokens = self._read()

    def _read(self) -> tuple[bytes, ...]:
        lines = self.path.read_text().splitlines()
        tokens = tuple(s.encode() for s in (line.strip() for line in lines) if s and not s.startswith("#"))
        if not tokens:
            raise ValueError(f"auth_token_file: {self.path} holds no token (one per line)")
        return tokens

    def reload(self) -> None:
        """Re-read the file (SIGHUP); on failure keep the tokens already loaded."""
        try:
            self._tokens = self._read()
        except (OSError, ValueError) as exc:
            log_event(log, "token reload failed, keeping the previous tokens", error=str(exc))
            return
        log_event(log, "tokens reloaded", count=len(self._tokens))

    def check(self, authorization: str | None) -> bool:
        """Whether ``authorization`` is ``Bearer <token>`` with a token from the file."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode()
        ok = False
        for known in self._tokens:  # every token compared, so timing says nothing of which
            ok |= hmac.compare_digest(known, given)
        return ok
