"""Each call to the process of its tensors' device, on a server of one process per GPU
(``logitserve serve --devices``; server/devices.py).

Such a server lists its processes in GetServerInfo (``device_endpoints``). A client learns the
list from its target once, at the first call that names CUDA memory (a CUDA tensor, a CUDA
region, ``register_cuda``), and from then on:

- a call whose CUDA tensors (sent as bytes or by region) are on ``cuda:i`` goes to the process
  of ``cuda:i``, over a channel of its own (opened at its first call, with the client's TLS,
  token, options and ``channel=``); a call that names no CUDA memory goes to the target, as on
  any server, unless it names regions registered at a device's process (then there);
- ``register_cuda`` of memory on ``cuda:i`` registers it with that process, and the calls that
  name the region go there;
- a call that names memory of two processes (tensors on two devices; a region registered at
  one process with tensors of another; sequence ids, which belong to the target's process,
  with tensors of another) is refused with a ``ValueError`` that names them: a call runs in
  one process.

:meth:`DeviceRouting.on_device` is the client of one device's process, for what names no
device: host regions (``register_system``) and sequences that calls on that device use.
Regions are listed, unregistered and reconciled at the process that holds them; closing the
client closes its device clients (and unregisters their regions) first. ``stream_steps`` goes
to the target (``on_device(i).stream_steps`` for device ``i``'s process). On a server of one
process the list is empty and nothing changes but one GetServerInfo at the first such call.

Devices are numbered as this process sees them (``cuda:i`` is ``torch.device("cuda", i)``): the
client and the server must see the GPUs in the same order (the same ``CUDA_VISIBLE_DEVICES``),
as CUDA IPC's device ids already require.
"""

from __future__ import annotations

import copy
import inspect
import threading

import grpc

from logitserve.v1 import logitserve_pb2 as pb

from . import balancing, codec, messages, regions, results
from .device_routes import TARGET, DeviceEncoder, Endpoints, RegionTables
from .errors import LogitServeError
from .region_table import RegionTable
from .transport import CLIENT_TIMEOUT, synchronize


class _Routes:
    """A client's view of the server's processes: the list (None until learned) and the device
    clients opened; ``leaf``: a device's client, which sends everything to its own target."""

    def __init__(self, leaf: bool = False):
        self.leaf = leaf
        self.endpoints: Endpoints | None = None
        self.by_device: dict[int, object] = {}
        self.lock = threading.Lock()

    def clients(self) -> list:
        with self.lock:
            return list(self.by_device.values())

    def tables(self, own: RegionTable) -> list[tuple[int | None, RegionTable]]:
        """The client's region table (``own``) and each device client's, by key."""
        with self.lock:
            return [(TARGET, own)] + [(key, c._regions) for key, c in self.by_device.items()]


def _joined(parts: list, combine):
    """``combine(parts)``, each part awaited first where it is awaitable (an AsyncClient's)."""
    if not any(inspect.isawaitable(p) for p in parts):
        return combine(parts)

    async def awaited():
        return combine([await p if inspect.isawaitable(p) else p for p in parts])

    return awaited()


def _names_sequences(msg) -> bool:
    sample = msg.sample if isinstance(msg, pb.StepRequest) else msg
    return isinstance(sample, pb.SampleRequest) and len(sample.sequence_ids) > 0


def _draws_unnamed_steps(msg) -> bool:
    """A Sample naming sequences without the step each row expects: sent twice, it would draw
    twice. With ``sequence_steps`` a repeat answers the draw made the first time (the server keeps
    each sequence's last answer), so that call is as safe to retry as any other."""
    sample = msg.sample if isinstance(msg, pb.StepRequest) else msg
    return _names_sequences(msg) and len(sample.sequence_steps) == 0


class DeviceRouting:
    """The mixin ``Client`` and ``AsyncClient`` put before their methods: sends each call to its
    device's process (see the module's docstring)."""

    def _bind(self, *args, **kwargs) -> None:
        """The client's channel, its arguments kept for the device clients' own channels. A new
        client starts knowing none of the server's processes (a device client's routes are set
        before it binds). Here, not in an ``__init__``, so that ``help(Client)`` shows the
        constructor's arguments (:class:`~.construction.ClientBase`'s)."""
        self._bind_args = (args, kwargs)
        if "_routes" not in vars(self):
            self._routes = _Routes()
        super()._bind(*args, **kwargs)

    # ---------------------------------------------------------------------- the processes

    def _after_learning(self, then):
        """``then()`` once the server's processes are known: learned from the target's
        GetServerInfo at the first call that needs them (awaited first with an AsyncClient)."""
        if self._routes.leaf or self._routes.endpoints is not None:
            return then()
        try:
            asked = self.server_info()
        except LogitServeError as exc:
            asked = _without_server_info(exc)
        if not inspect.isawaitable(asked):
            self._learn(asked)
            return then()

        async def learn_then():
            try:
                info = await asked
            except LogitServeError as exc:
                info = _without_server_info(exc)
            self._learn(info)
            result = then()
            return await result if inspect.isawaitable(result) else result

        return learn_then()

    def _learn(self, info) -> None:
        with self._routes.lock:
            if self._routes.endpoints is None:
                self._routes.endpoints = Endpoints.of(info, self.target)

    def _key(self, device: int, method: str):
        """Which client's process runs ``cuda:device``: :data:`TARGET` (this client's) or the device."""
        endpoints = self._routes.endpoints
        name = f"cuda:{device}"
        if not endpoints.addresses or name == endpoints.own_device:
            return TARGET
        address = endpoints.addresses.get(name)
        if address is None:
            raise ValueError(f"{method}: its CUDA memory is on {name}, and the server at {self.target} has a process "
                             f"for {', '.join(endpoints.addresses)} only (its --devices)")
        return TARGET if address == self.target else device

    def _client(self, key):
        """This client (key :data:`TARGET`) or device ``key``'s, opened at first use: a copy of this
        one bound to the device's address, with its own channel and region table."""
        if key is TARGET:
            return self
        with self._routes.lock:
            device_client = self._routes.by_device.get(key)
            if device_client is None:
                device_client = copy.copy(self)
                device_client.target = self._routes.endpoints.addresses[f"cuda:{key}"]
                device_client.load_balancing = "pick_first"  # one process
                device_client._regions = RegionTable(self._regions.scope)
                device_client._routes = _Routes(leaf=True)
                args, kwargs = self._bind_args
                device_client._bind(*args, **kwargs)
                self._routes.by_device[key] = device_client
        return device_client

    def _all_clients(self) -> list:
        return [self, *self._routes.clients()]

    def _where(self, key) -> str:
        if key is TARGET:
            return f"the target {self.target}"
        return f"cuda:{key}'s process {self._routes.endpoints.addresses[f'cuda:{key}']}"

    def _on(self, device: int, method: str):
        """The client whose process runs ``cuda:device`` (a device's client is its own)."""
        return self if self._routes.leaf else self._client(self._key(device, method))

    def on_device(self, device: int):
        """The client of ``cuda:device``'s process: its calls go there whatever they name (host
        regions and sequences for calls on that device); this client itself where its target is
        that process or the server has one (awaitable with an AsyncClient)."""
        found = self._after_learning(lambda: self._on(device, "on_device"))
        if inspect.iscoroutinefunction(self.close) and not inspect.isawaitable(found):  # an AsyncClient's
            async def ready():
                return found
            return ready()
        return found

    # --------------------------------------------------------------------------- calls

    def _encoder(self) -> messages.Encoder:
        if self._routes.leaf:
            return messages.Encoder(self._regions)
        return DeviceEncoder(RegionTables(self._routes.tables(self._regions)))

    def _send(self, rpc: str, enc: messages.Encoder, msg, response_type, read, timeout, stream,
              wait_for_ready: bool | None = None):
        """Synchronize what the request names on CUDA, serialize it (tensor bytes copied once)
        and call ``rpc`` at the process of its device; the answer is read by ``read`` with the
        request's ``out=`` outputs. A call naming sequences without their steps changes them
        unrepeatably: not idempotent."""

        def send(client):
            synchronize(enc.cuda_devices, stream)
            payload = enc.serialize(msg, self._recycler)
            self._recycler.give_back(payload)  # reused only once nothing references it (after this call)
            return client._call(rpc, payload, timeout, results.reader(response_type, read, enc.outputs),
                                client._forgetting_missing(enc.referenced), idempotent=not _draws_unnamed_steps(msg),
                                wait_for_ready=wait_for_ready)

        if self._routes.leaf or not (enc.devices or any(k is not TARGET for k in enc.table.owners.values())):
            return send(self)
        return self._after_learning(lambda: send(self._client(self._destination(rpc, enc, msg))))

    def _destination(self, rpc: str, enc: DeviceEncoder, msg):
        """The one process (its key) of everything ``msg`` names, or ``ValueError`` naming each."""
        wants = {}  # key -> what takes the call there
        for device in sorted(enc.devices):
            wants.setdefault(self._key(device, rpc), []).append(f"memory on cuda:{device}")
        for server_name, key in enc.table.owners.items():
            wants.setdefault(key, []).append(f"region {enc.table.shown_name(server_name)!r}")
        if _names_sequences(msg):
            wants.setdefault(TARGET, []).append("sequence ids (opened at the target)")
        if len(wants) > 1:
            parts = "; ".join(f"{', '.join(what)} at {self._where(key)}" for key, what in wants.items())
            raise ValueError(f"{rpc}: a call runs in one process of the server (one per device), and this one names "
                             f"{parts}; put its tensors on one device, and register its regions and open its "
                             f"sequences at that device's process (client.on_device(i))")
        return next(iter(wants), TARGET)

    # --------------------------------------------------------------------------- regions

    def _holder(self, name: str):
        """The client whose table has the caller's region ``name`` (this one when none has)."""
        return next((c for c in self._all_clients() if name in c._regions.names), self)

    def _refuse_elsewhere(self, name: str, client, method: str) -> None:
        holder = self._holder(name)
        if holder is not client and name in holder._regions.names:
            raise ValueError(f"{method}: {name!r} is registered at {holder.target}: a name belongs to one process of "
                             f"the server; unregister it there first")

    def register_system(self, name: str, key, byte_size: int | None = None, offset: int = 0, *,
                        global_name: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        self._refuse_elsewhere(name, self, "register_system")
        return super().register_system(name, key, byte_size, offset, global_name=global_name, timeout=timeout,
                                       wait_for_ready=wait_for_ready)

    def register_cuda(self, name: str, handle, device_id: int | None = None, byte_size: int | None = None,
                      offset: int = 0, *, global_name: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        balancing.require_one_server(self, "register_cuda")
        device = handle.device.index if codec.is_torch(handle) and handle.is_cuda else \
            handle.device_id if isinstance(handle, regions.CudaIpcHandle) else device_id

        def register():
            client = self if device is None else self._on(device, "register_cuda")
            self._refuse_elsewhere(name, client, "register_cuda")
            return super(DeviceRouting, client).register_cuda(name, handle, device_id, byte_size, offset,
                                                              global_name=global_name, timeout=timeout,
                                                              wait_for_ready=wait_for_ready)

        return register() if device is None else self._after_learning(register)

    @property
    def registered(self) -> list[str]:
        return [name for c in self._all_clients() for name in c._regions.names]

    def server_name(self, name: str, *, global_name: bool = False) -> str:
        return self._holder(name)._regions.server_name(name, global_name)

    def shared_memory_status(self, name: str = "", *, kind: str | None = None, global_name: bool = False,
                             all_of_caller: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        clients = [self._holder(name)] if name else self._all_clients()
        return _joined([super(DeviceRouting, c).shared_memory_status(name, kind=kind, global_name=global_name,
                                                                     all_of_caller=all_of_caller, timeout=timeout,
                                                                     wait_for_ready=wait_for_ready)
                        for c in clients], lambda parts: [s for part in parts for s in part])

    def unregister(self, name: str = "", *, kind: str | None = None, global_name: bool = False,
                   all_of_caller: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> list[str]:
        clients = [self._holder(name)] if name else self._all_clients()
        return _joined([super(DeviceRouting, c).unregister(name, kind=kind, global_name=global_name,
                                                           all_of_caller=all_of_caller, timeout=timeout,
                                                           wait_for_ready=wait_for_ready)
                        for c in clients], lambda parts: sorted(n for part in parts for n in part))

    def reconcile_regions(self, *, timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> list[str]:
        return _joined([super(DeviceRouting, c).reconcile_regions(timeout=timeout, wait_for_ready=wait_for_ready)
                        for c in self._all_clients()],
                       lambda parts: [n for part in parts for n in part])


def _without_server_info(exc: LogitServeError):
    """A target that has no GetServerInfo (a proxy of some RPCs) is one process; other errors raise."""
    if exc.code != grpc.StatusCode.UNIMPLEMENTED:
        raise exc
    return None
