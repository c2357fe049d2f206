"""The open channels of one server process: who opened each, its key and its wake-up event.

A channel belongs to the caller that opened it, as its regions and sequences do: its calls run
under the ``authorization`` of the OpenChannel call (re-checked by the guard each call). Its key
is 16 random bytes the server gives only to that caller (over gRPC, TLS where configured);
iceoryx2's services are listed openly on the host, so the key, not the service's name, is what a
request proves. At most ``max_channels`` are open, all callers together, and at most
``per_token`` of them by one token (--token-share: server/tenancy.py), so that no token can take
them all; one without a call for ``idle_s`` seconds is closed when the next channel opens or the
server sweeps (:meth:`ChannelTable.sweep`), so a client that died without closing costs only
until then.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import time
from dataclasses import dataclass, field

from logitserve.v1.channel_format import KEY_BYTES

from ...errors import TooLarge
from ...regions import owner_of


@dataclass(eq=False)
class Channel:
    key: bytes
    number: int  # names its event service and its "peer" (held answers are counted per peer)
    authorization: str | None  # the opener's header, sent again with every call
    owner: str | None  # the opener's regions' owner (regions.owner_of)
    event: object  # wakes the caller after an answer (transport.ChannelEvent)
    event_name: str
    last_used: float = field(default_factory=time.monotonic)

    @property
    def peer(self) -> str:
        return f"channel:{self.number}"


class ChannelTable:
    def __init__(self, max_channels: int, idle_s: float, per_token: int | None = None):
        self.max_channels = max_channels
        self.per_token = max_channels if per_token is None else per_token
        self.idle_s = idle_s
        self._by_key: dict[bytes, Channel] = {}
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_key)

    def open(self, authorization: str | None, make_event) -> Channel:
        """A new channel of the caller ``authorization``; ``make_event(number)`` gives its
        ``(event name, notifier)``. TooLarge past ``max_channels``, or past ``per_token`` for the
        caller's token (idle ones closed first)."""
        self.sweep()
        if len(self._by_key) >= self.max_channels:
            raise TooLarge(f"channels: {len(self._by_key)} open, this server's limit is {self.max_channels} "
                           f"(--max-channels); close unused ones (CloseChannel) or call over gRPC")
        owner = owner_of(authorization)
        held = self.by_owner().get(owner, 0)
        if held >= self.per_token:
            raise TooLarge(f"channels: this token holds {held}, its share of this server's {self.max_channels} "
                           f"(--max-channels, --token-share); close unused ones (CloseChannel) or call over gRPC")
        number = next(self._numbers)
        event_name, event = make_event(number)
        channel = Channel(secrets.token_bytes(KEY_BYTES), number, authorization, owner, event, event_name)
        self._by_key[channel.key] = channel
        return channel

    def by_owner(self) -> dict[str | None, int]:
        """Open channels by owner (owner_of of the opener's token; None without one)."""
        return collections.Counter(channel.owner for channel in self._by_key.values())

    def get(self, key: bytes) -> Channel | None:
        channel = self._by_key.get(key)
        if channel is not None:
            channel.last_used = time.monotonic()
        return channel

    def close(self, key: bytes, authorization: str | None) -> bool:
        """Close the caller's channel ``key``; False when it has none of that key (another
        caller's channel is not closed, and not told apart from a key never given)."""
        channel = self._by_key.get(key)
        if channel is None or owner_of(authorization) != channel.owner:
            return False
        del self._by_key[key]
        return True

    def sweep(self) -> int:
        """Close the channels idle for ``idle_s``; returns how many."""
        cutoff = time.monotonic() - self.idle_s
        idle = [key for key, channel in self._by_key.items() if channel.last_used < cutoff]
        for key in idle:
            del self._by_key[key]
        return len(idle)

    def clear(self) -> None:
        self._by_key.clear()

