"""Each token's share of the server-wide bounds a tenant can fill (``--token-share``).

With bearer tokens on, one token may hold at most ``share`` of each bound (channels, sequences
and their bytes, regions and region bytes, held answers), so no token can take everything and
lock the others out. Without tokens every caller is one identity (the ``authorization`` header
is only hashed, so identities can be invented at will): a per-identity bound would protect
nothing, and the global bounds alone apply.
"""

from __future__ import annotations

import math


def per_token_bound(total: int, share: float, tokens_on: bool) -> int:
    """The most of a server-wide bound ``total`` one token may hold: ``total`` itself without
    tokens, else ``share`` of it rounded down, but at least 1 where ``total`` is at least 1."""
    if not tokens_on or total <= 0:
        return total
    return max(1, math.floor(total * share))
