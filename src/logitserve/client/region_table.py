"""The table of the regions one client registered, and finding the region a tensor lies in.

:class:`RegionTable` keeps every region a client registered (it unregisters them when it closes):
the caller's name, the server's name (:mod:`.region_names`: scoped per client unless global) and,
where the client knows it, the memory behind it (a SharedHostBuffer's mapping, a torch CUDA
tensor's allocation), so that a contiguous numpy array or torch tensor inside one is sent as a
reference to it (:class:`Located`) instead of as bytes.

Each registration is an entry with a serial number of its own, so that what the server said of
a region (NOT_FOUND, missing from SharedMemoryStatus, unregistered) drops the very registration
the request named, never one made under the same name since. Dropping an entry drops what the
table kept alive for it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import codec
from .region_names import Scope
from .regions import CUDA, SYSTEM, SharedHostBuffer

# ``{server name: serial}``: the registrations a request named, or a snapshot of the table.
Registrations = dict[str, int]
_REGION_REF = pb.RegionRef.DESCRIPTOR


@dataclass(frozen=True)
class Located:
    """Where a tensor lies in a region registered through the client: the region (the server's
    name) and its registration's serial, the tensor's offset from the region's start and its
    length in bytes; ``device`` the CUDA device index (this process's) for a CUDA region, None
    for system memory."""

    region: str
    serial: int
    kind: str
    offset: int
    byte_size: int
    device: int | None

    def ref(self) -> pb.RegionRef:
        return pb.RegionRef(region=self.region, offset=self.offset, byte_size=self.byte_size)


@dataclass(frozen=True)
class _Entry:
    """One registration: the caller's name, the server's, the kind and its serial."""

    name: str
    server_name: str
    kind: str
    serial: int


@dataclass(frozen=True)
class _Span:
    """The memory of a registration in this process: ``[start, end)`` addresses (host, or device
    ``device``), and what keeps it valid (the SharedHostBuffer, checked open; the CUDA tensor,
    kept alive while registered)."""

    entry: _Entry
    start: int
    end: int
    device: int | None
    keep: object = None


def host_address(buf: SharedHostBuffer) -> int:
    """The address of a SharedHostBuffer's first byte in this process."""
    probe = np.frombuffer(buf.shm.buf, dtype=np.uint8, count=1)
    try:
        return probe.__array_interface__["data"][0]
    finally:
        del probe


def _address(x) -> tuple[int, int, str, int | None] | None:
    """``(address, byte_size, kind, device)`` of a contiguous numpy array or torch tensor with a
    wire dtype, in the wire's layout (little-endian); None for anything else."""
    if codec.is_torch(x):
        if not x.is_contiguous() or codec.wire_dtype(x) is None or x.is_conj() or x.is_neg():
            return None
        nbytes = x.numel() * x.element_size()
        if x.device.type == "cuda":
            return x.data_ptr(), nbytes, CUDA, x.device.index
        if x.device.type == "cpu":
            return x.data_ptr(), nbytes, SYSTEM, None
        return None
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous or codec.wire_dtype(x) is None or x.dtype.byteorder == ">":
            return None
        return x.__array_interface__["data"][0], x.nbytes, SYSTEM, None
    return None


def _region_refs(msg):
    """Every RegionRef inside ``msg`` (a Tensor's ``region``, ``output_regions``' values, those of
    a Step's parts), depth first."""
    for field, value in msg.ListFields():
        sub = field.message_type
        if sub is None:
            continue
        if sub.GetOptions().map_entry:
            items = value.values() if sub.fields_by_name["value"].message_type is not None else ()
        else:
            items = value if field.is_repeated else (value,)
        for item in items:
            if item.DESCRIPTOR is _REGION_REF:
                yield item
            else:
                yield from _region_refs(item)


class RegionTable:
    """The regions one client registered: each entry's names (the caller's and the server's:
    ``scope`` gives the server's, see :mod:`.region_names`; default: no scope) and, where the
    client knows it, the memory behind it, so that :meth:`locate` finds the region a tensor lies
    in by its address. Thread-safe."""

    def __init__(self, scope: Scope | None = None):
        self.scope = Scope(None) if scope is None else scope
        self._lock = threading.Lock()
        self._serials = itertools.count(1)
        self._entries: dict[str, _Entry] = {}  # the caller's name -> entry, in registration order
        self._by_server: dict[str, _Entry] = {}
        self._spans: dict[str, _Span] = {}  # the caller's name -> span

    @property
    def names(self) -> list[str]:
        """The caller's names of the regions registered, in registration order."""
        with self._lock:
            return list(self._entries)

    # ------------------------------------------------------------------------------- names

    def server_name(self, name: str, global_name: bool = False) -> str:
        """The server's name for the caller's ``name``: its entry's, or the scope's rule for a
        name not registered through this client."""
        with self._lock:
            entry = self._entries.get(name)
        return entry.server_name if entry is not None else self.scope.server_name(name, global_name)

    def shown_name(self, server_name: str) -> str:
        """The name to show the caller for a server name: the caller's name of an entry or of this
        client's scope, else the server's name as it is (a region of another client)."""
        with self._lock:
            entry = self._by_server.get(server_name)
        if entry is not None:
            return entry.name
        return self.scope.user_name(server_name) or server_name

    def referenced(self, name: str) -> tuple[str, int | None]:
        """A name a caller wrote in a reference (a Tensor or RegionRef it built): ``(server name,
        serial)`` of the entry with that name (the caller's, else the server's), else
        ``(name, None)``: a name the client did not register goes as written."""
        with self._lock:
            entry = self._entries.get(name) or self._by_server.get(name)
        return (name, None) if entry is None else (entry.server_name, entry.serial)

    def references(self, msg) -> tuple[object, Registrations]:
        """``msg`` (a Tensor or a request the caller built) with each region it names by a name
        registered through this client renamed to the server's name (a copy, when one changes),
        and the registrations it names."""
        renames: dict[str, str] = {}
        named: Registrations = {}
        for ref in _region_refs(msg):
            server_name, serial = self.referenced(ref.region)
            if serial is not None:
                named[server_name] = serial
            if server_name != ref.region:
                renames[ref.region] = server_name
        if renames:
            copy = type(msg)()
            copy.CopyFrom(msg)
            for ref in _region_refs(copy):
                ref.region = renames.get(ref.region, ref.region)
            msg = copy
        return msg, named

    def registrations(self, kind: str | None = None) -> Registrations:
        """``{server name: serial}`` of the entries (of ``kind`` when given), now."""
        with self._lock:
            return {e.server_name: e.serial for e in self._entries.values() if kind is None or e.kind == kind}

    # ------------------------------------------------------------------------ adding, dropping

    def add(self, name: str, kind: str, server_name: str | None = None, span: tuple | None = None) -> None:
        """A registration of the caller's ``name`` (the server's name ``server_name``, default the
        scope's); ``span``: ``(start, end, device, keep)`` of its memory here, when known."""
        server_name = self.scope.server_name(name) if server_name is None else server_name
        with self._lock:
            entry = _Entry(name, server_name, kind, next(self._serials))
            self._unlink(self._entries.get(name))
            self._unlink(self._by_server.get(server_name))
            self._entries[name] = self._by_server[server_name] = entry
            if span is not None:
                self._spans[name] = _Span(entry, *span)

    def add_system(self, name: str, buf: SharedHostBuffer | None, offset: int, byte_size: int,
                   server_name: str | None = None) -> None:
        """Region ``name``: ``[offset, offset + byte_size)`` of ``buf`` (None: a key this
        process has no mapping of; the name is still kept)."""
        span = None
        if buf is not None:
            start = host_address(buf) + offset
            span = (start, start + byte_size, None, buf)
        self.add(name, SYSTEM, server_name, span)

    def add_cuda(self, name: str, start: int | None, byte_size: int, device: int, keep=None,
                 server_name: str | None = None) -> None:
        """Region ``name``: ``byte_size`` bytes from device address ``start`` on ``device``
        (None: unknown here; the name is still kept), ``keep`` (the tensor) kept alive."""
        self.add(name, CUDA, server_name, None if start is None else (start, start + byte_size, device, keep))

    def remove(self, names) -> None:
        """Forget the caller's ``names``, whatever their registration."""
        with self._lock:
            for name in set(names):
                self._unlink(self._entries.get(name))

    def drop(self, registrations: Registrations) -> list[str]:
        """Forget the entries of ``registrations`` that are still the same registration (a name
        registered again since stays); returns the caller's names forgotten."""
        dropped = []
        with self._lock:
            for server_name, serial in registrations.items():
                entry = self._by_server.get(server_name)
                if entry is not None and entry.serial == serial:
                    self._unlink(entry)
                    dropped.append(entry.name)
        return dropped

    def _unlink(self, entry: _Entry | None) -> None:
        """Forget ``entry`` and its span (under the lock)."""
        if entry is None:
            return
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
            span = self._spans.get(entry.name)
            if span is not None and span.entry is entry:
                del self._spans[entry.name]
        if self._by_server.get(entry.server_name) is entry:
            del self._by_server[entry.server_name]

    # ---------------------------------------------------------------------------- locating

    def locate(self, x) -> Located | None:
        """The region ``x`` (a numpy array or torch tensor) lies in, contiguous and whole, or
        None (then it travels as bytes)."""
        found = _address(x)
        if found is None:
            return None
        ptr, nbytes, kind, device = found
        if nbytes == 0:
            return None
        with self._lock:
            spans = list(self._spans.values())
        for span in spans:
            entry = span.entry
            if entry.kind != kind or span.device != device or not span.start <= ptr or ptr + nbytes > span.end:
                continue
            if kind == SYSTEM and span.keep is not None and span.keep.shm.buf is None:
                continue  # closed (unmapped) here: its addresses may be reused
            return Located(entry.server_name, entry.serial, kind, ptr - span.start, nbytes, device)
        return None
