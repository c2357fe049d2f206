"""The regions of one RPC on the request path: its references resolved for the caller, and its
leases held until nobody can touch the memory any more.

One :class:`CallRegions` per request (a Step's parts share their request's). Validation
(``from_pb``) resolves every reference through :meth:`CallRegions.resolve`, which keeps the
lease. The leases are released once, together, when the last of these holders lets go:

- the handler (held from the start; let go by :meth:`CallRegions.finish`, once, in the
  servicer's ``finally``, after the answer is built, or at once when validation fails);
- each launch reading or writing the call's memory (:meth:`CallRegions.hold` before it starts,
  :meth:`CallRegions.release` after the device has finished it: ``DeviceHandle.run_batch``).

So a client that cancels while its call's launch is in flight lets go of the handler's hold only:
the memory stays mapped until the launch is done, and an unregister meanwhile is deferred by the
registry. A call dropped before its launch (queue full, deadline, cancelled while queued) never
takes a launch hold, so its leases go with the handler's.
"""

from __future__ import annotations

import threading

from .region import RegionLease


class CallRegions:
    """Resolves one RPC's references for ``owner`` in ``registry`` and holds its leases.

    ``owner`` may be a callable returning it (read from the call's metadata only when a
    reference is resolved: calls without regions never pay for it).
    """

    __slots__ = ("registry", "_owner", "_leases", "_sizes", "_holds", "_finished", "_lock")

    def __init__(self, registry, owner=None):
        self.registry = registry
        self._owner = owner
        self._leases: list[RegionLease] = []
        self._sizes: dict = {}  # each system object's size, as this call's first resolve on it read it
        self._holds = 1  # the handler's
        self._finished = False
        self._lock = threading.Lock()  # launch holds end on the event loop; tests release from threads

    @property
    def owner(self):
        if callable(self._owner):
            self._owner = self._owner()
        return self._owner

    @property
    def leases(self) -> int:
        """Leases held now."""
        return len(self._leases)

    def resolved(self, first: int = 0) -> tuple[RegionLease, ...]:
        """The leases resolved so far, from the ``first``-th (a Step's parts: server/ops/step.py)."""
        with self._lock:
            return tuple(self._leases[first:])

    def resolve(self, ref, dtype, shape, field: str, *, writable: bool = False) -> RegionLease:
        """A lease on ``ref`` (see ``RegionRegistry.resolve``; byte_size exactly the tensor's),
        kept until the call's last holder lets go."""
        lease = self.registry.resolve(ref, dtype, shape, self.owner, field, writable=writable, sizes=self._sizes)
        with self._lock:
            if self._holds == 0:  # never: the handler validates before it lets go
                lease.release()
                raise RuntimeError("a call's regions resolved after the call ended")
            self._leases.append(lease)
        return lease

    def hold(self) -> None:
        """A launch is about to read or write the call's memory."""
        with self._lock:
            if self._holds == 0:
                raise RuntimeError("a launch of a call whose regions were already released")
            self._holds += 1

    def finish(self) -> None:
        """The handler is done with the call (idempotent)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.release()

    def release(self) -> None:
        """A launch's hold ends (the handler's: :meth:`finish`); the last holder releases every lease."""
        with self._lock:
            if self._holds == 0:
                return
            self._holds -= 1
            if self._holds:
                return
            leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()
