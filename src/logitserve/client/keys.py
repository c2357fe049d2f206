"""Shared-memory keys a server with token-scoped keys accepts from this client.

A server run with ``--shm-key-scope token`` (the default when it checks bearer tokens) maps a
system region only when its key starts with the caller's token prefix: no client can register
another's objects by naming them. The prefix is a digest of the token, computed here the way the
server does (server/regions/names.py ``key_prefix``), so no call is needed to learn it::

    buf = regions.shared_array((8, 32000), "float32", key=scoped_key(token))
    client.register("logits", buf)
"""

from __future__ import annotations

import hashlib
import secrets


def key_prefix(token: str) -> str:
    """The prefix every shared-memory key of ``token`` must start with on a token-scoped server."""
    owner = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()
    return "ls" + hashlib.sha256(b"logitserve shm key prefix\0" + owner.encode()).hexdigest()[:16] + "_"


def scoped_key(token: str | None, name: str | None = None) -> str | None:
    """A key for a new shared-memory object of ``token``'s client: its prefix and ``name`` (a
    fresh random name when None). Without a token: ``name`` as it is (None lets the creator pick)."""
    if not token:
        return name
    return key_prefix(token) + (name if name is not None else secrets.token_hex(8))
