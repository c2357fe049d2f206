"""One call, one identity: the ``authorization`` header both the token check (guard.py) and the
owner of the caller's shared-memory regions (regions_servicer.caller) are read from.

Read apart, they disagreed: the token check took the last of several headers and the regions
the first, so ``[Bearer made-up, Bearer A]`` passed A's check and registered a region under
"made-up" (issue 32). A call with more than one header is refused, tokens on or off.
"""

from __future__ import annotations

from .errors import Unauthenticated

AUTHORIZATION = "authorization"


def authorization_of(metadata) -> str | None:
    """The one ``authorization`` value of a call's ``metadata`` (its ``invocation_metadata()``:
    key, value pairs, a key possibly more than once), None without one; ``Unauthenticated``
    for a call with several."""
    found = [value for key, value in metadata if key == AUTHORIZATION]
    if len(found) > 1:
        raise Unauthenticated(f"{AUTHORIZATION}: one header per call, got {len(found)}")
    return found[0] if found else None
