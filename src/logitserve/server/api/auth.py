"""Bearer tokens from a file: one per line, re-read on SIGHUP, compared in constant time.

Blank lines and lines starting with ``#`` are skipped. Tokens are never logged. Only their
SHA-256 digests are kept and compared (``hmac.compare_digest`` on equal-length digests), so the
time a check takes says nothing of a token's content or length.
"""

from __future__ import annotations

import hashlib
import hmac
import pathlib

from ..logs import get_logger, log_event

log = get_logger("auth")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class TokenStore:
    """The tokens of ``path``; :meth:`check` tests an ``authorization`` metadata value."""

    def __init__(self, path: str):
        self.path = pathlib.Path(path)
        self._tokens: tuple[bytes, ...] = ()
        self._tokens = self._read()

    def _read(self) -> tuple[bytes, ...]:
        lines = self.path.read_text().splitlines()
        tokens = tuple(_digest(s) for s in (line.strip() for line in lines) if s and not s.startswith("#"))
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
        given = _digest(token.strip())
        ok = False
        for known in self._tokens:  # every token compared, so timing says nothing of which
            ok |= hmac.compare_digest(known, given)
        return ok
