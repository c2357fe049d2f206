"""Region names as a client's caller writes them, and as the server knows them.

The server keeps one namespace of region names per caller (per bearer token; without tokens,
every client of the server is the same caller). Two clients that both register ``"logits"``
without tokens would collide (ALREADY_EXISTS), and one's cleanup could name the other's
regions. So a client registers each name under a scope of its own: the server's name is
``<scope>.<name>``, the scope random per client instance (``c`` and 12 hex digits) unless the
client is given one (``region_scope="frontend-1"``: the same names across restarts) or none
(``region_scope=None``: names as written). ``global_name=True`` registers one name as written,
for a region other clients of the same caller (tritonclient, raw stubs) name themselves.

The caller keeps writing ``"logits"`` in every client method; :class:`Scope` gives the server's
name for it and the caller's name back, and :mod:`.region_table` keeps the pairs.
"""

from __future__ import annotations

import re
import secrets

# The server's rule for a region name (server/regions/names.py NAME_RULE), checked here on the
# name a scoped name is made of: the caller's names follow one rule, scoped or global, and a
# name too long once scoped fails before anything is sent, naming the caller's name.
NAME_MAX = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
NAME_RULE = "1 to 128 of A-Z a-z 0-9 . _ : -, starting with a letter or digit"
SEPARATOR = "."


class _NewScope:
    """The default of ``region_scope``: a random scope for each client instance."""

    def __repr__(self) -> str:
        return "NEW_SCOPE"


NEW_SCOPE = _NewScope()


def check_name(name: str, field: str = "name") -> str:
    """``name`` when it is a valid region name, else ``ValueError`` naming ``field`` and the rule."""
    if not isinstance(name, str) or len(name) > NAME_MAX or not _NAME.fullmatch(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 64 else repr(name[:64] + "...")
        raise ValueError(f"{field}: {shown} is not a valid region name ({NAME_RULE})")
    return name


class Scope:
    """One client's scope: ``scope`` a name of the region-name rule, :data:`NEW_SCOPE` (a random
    one) or None (no scope: names go to the server as written)."""

    def __init__(self, scope=NEW_SCOPE):
        if scope is NEW_SCOPE:
            scope = "c" + secrets.token_hex(6)
        elif scope is not None:
            check_name(scope, "region_scope")
            if len(scope) + len(SEPARATOR) >= NAME_MAX:
                raise ValueError(f"region_scope: {len(scope)} characters leaves no room for a name "
                                 f"(the server's names are at most {NAME_MAX})")
        self.scope: str | None = scope
        self.prefix = "" if scope is None else scope + SEPARATOR

    def server_name(self, name: str, global_name: bool = False) -> str:
        """The server's name for ``name``: ``<scope>.<name>``, or ``name`` itself when
        ``global_name`` or the client has no scope (then the server checks it). A scoped name
        is checked here, by the rule of the name written: ``-x`` would pass inside ``c0.-x``."""
        if global_name or not self.prefix:
            return name
        check_name(name)
        if len(self.prefix) + len(name) > NAME_MAX:
            raise ValueError(f"name: {len(name)} characters; with this client's scope {self.prefix!r} the server's "
                             f"name would be {len(self.prefix) + len(name)}, over its limit of {NAME_MAX} (use at "
                             f"most {NAME_MAX - len(self.prefix)}, or global_name=True)")
        return self.prefix + name

    def user_name(self, server_name: str) -> str | None:
        """The name a server name of this scope was registered under, None for a name outside it
        (a global name, another client's)."""
        if self.prefix and server_name.startswith(self.prefix) and len(server_name) > len(self.prefix):
            return server_name[len(self.prefix):]
        return None
