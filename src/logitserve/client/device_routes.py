"""Where a call goes on a server of one process per GPU (``logitserve serve --devices``): the
processes' addresses, the devices a request names, and which process holds each region.

:class:`Endpoints` is the server's list (GetServerInfo's ``device_endpoints``) as this client
dials it. An address bound to every address of the server's host (``0.0.0.0:50052``,
``[::]:50052``) is read as the host of the client's target with that port: the process is
reached the way the target was (a target that names several addresses: its first).

:class:`DeviceEncoder` builds a request as :class:`~.messages.Encoder` does, noting also the CUDA
device of each tensor it sends as bytes (:func:`tensor_device`), and finds tensors in the
regions of the client and of its device clients (:class:`RegionTables`), noting which process
holds each region it names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import codec, messages
from .region_table import Located, RegionTable

# The key of the client's own target among the processes a call may go to (a device's client
# is keyed by its device index).
TARGET = None
# Hosts that mean "every address of the server's host": read as the host the client dialled.
ANY_ADDRESS = ("0.0.0.0", "[::]", "::", "")
_SCHEMES = ("dns:", "ipv4:", "ipv6:")


def tensor_device(x) -> int | None:
    """The CUDA device index of a torch CUDA tensor, else None (host memory, numpy, messages)."""
    return x.device.index if codec.is_torch(x) and x.is_cuda else None


def target_host(target: str) -> str:
    """The host of a gRPC target: ``host:port``, ``[v6]:port``, ``dns:///host:port``,
    ``dns://resolver/host:port``, ``ipv4:a:port,b:port`` (its first address)."""
    rest = target
    for scheme in _SCHEMES:
        if rest.startswith(scheme):
            rest = rest[len(scheme):]
            break
    if rest.startswith("//"):  # dns://[resolver]/name
        rest = rest[2:].split("/", 1)[-1]
    rest = rest.split(",", 1)[0]
    host, sep, port = rest.rpartition(":")
    return host if sep and port.isdigit() else rest


def dialled(address: str, target: str) -> str:
    """``address`` (``host:port``) as this client reaches it: an any-address host is the target's."""
    host, _, port = address.rpartition(":")
    return f"{target_host(target)}:{port}" if host in ANY_ADDRESS else address


@dataclass(frozen=True)
class Endpoints:
    """The server's processes as the client dials them: ``own_device``, the target's device
    ("cuda:0"; "" when unknown), and ``addresses``, ``{device: address}`` of every process (empty:
    a server of one process)."""

    own_device: str = ""
    addresses: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, info, target: str) -> "Endpoints":
        """From the target's :class:`~.results.ServerInfo` (None: a server without GetServerInfo,
        taken as one process)."""
        if info is None:
            return cls()
        return cls(info.device, {device: dialled(address, target) for device, address in info.device_endpoints.items()})


class RegionTables:
    """The region tables of a client (key :data:`TARGET`) and of its device clients (keys: device
    indices), read as one by a request's encoder; ``owners``: ``{server name: key}`` of every
    region the request named."""

    def __init__(self, tables: list[tuple[int | None, RegionTable]]):
        self.tables = tables
        self.owners: dict[str, int | None] = {}

    def locate(self, x) -> Located | None:
        for key, table in self.tables:
            where = table.locate(x)
            if where is not None:
                self.owners[where.region] = key
                return where
        return None

    def references(self, msg):
        """``msg`` with the names each table registered renamed to the server's (a name belongs to
        one table: client/devices.py refuses it in a second)."""
        named_all = {}
        for key, table in self.tables:
            msg, named = table.references(msg)
            named_all.update(named)
            self.owners.update(dict.fromkeys(named, key))
        return msg, named_all

    def shown_name(self, server_name: str) -> str:
        """The caller's name of a region the request named (from the table that holds it)."""
        for key, table in self.tables:
            if key == self.owners.get(server_name):
                return table.shown_name(server_name)
        return server_name


class DeviceEncoder(messages.Encoder):
    """An :class:`~.messages.Encoder` over :class:`RegionTables`; ``tensor_devices``: the CUDA
    devices of the tensors it sent as bytes (those in regions are in ``cuda_devices``)."""

    def __init__(self, tables: RegionTables):
        super().__init__(tables)
        self.tensor_devices: set[int] = set()

    def tensor(self, x, path, label):
        device = tensor_device(x)
        if device is not None:
            self.tensor_devices.add(device)
        return super().tensor(x, path, label)

    @property
    def devices(self) -> set[int]:
        """Every CUDA device whose memory the request names."""
        return self.cuda_devices | self.tensor_devices
