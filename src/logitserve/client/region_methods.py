"""The client methods of the ``SharedMemory`` service: registering regions, their status and
unregistering them, written once for ``Client`` and ``AsyncClient``.

:class:`RegionMethods` is a base of :class:`~.construction.ClientBase`: it uses the client's ``_simple``
(one call of a plain message), ``_call_each`` (several calls, one result), ``_regions`` (the
:class:`~.region_table.RegionTable` of what was registered through it) and
``unregister_on_close``. The requests and answers are :mod:`.regions`'s. Every method takes
``timeout=`` and ``wait_for_ready=`` as the operators' do (the client's docstring).

Names: the caller writes its own (``"logits"``) everywhere; the server knows each by the
client's scoped name (:mod:`.region_names`), which the table translates both ways. What a
client's methods touch is what was registered through it: ``unregister()`` and
``shared_memory_status()`` without a name leave other clients' regions alone, even those of
the same caller (every client, without bearer tokens); ``all_of_caller=True`` asks for the
server's every region of this caller. The table follows the server: a region the server says
it no longer has (NOT_FOUND, unregistered, missing from :meth:`reconcile_regions`' status)
leaves it, with the memory the table kept alive for it.
"""

from __future__ import annotations

import dataclasses

import grpc

from logitserve.v1 import logitserve_pb2 as pb

from . import balancing, codec, keys, regions
from .region_table import Registrations
from .transport import CLIENT_TIMEOUT, parse_as


def _quoted(name: str) -> str:
    """``name`` as the server quotes it in its messages (server/regions/names.py ``shown``)."""
    return repr(name if len(name) <= 64 else name[:64] + "...")


class RegionMethods:
    """Shared-memory regions (the SharedMemory service; helpers in logitserve.client.regions).
    A region belongs to one server: a round_robin client refuses these methods (:mod:`.balancing`)."""

    @property
    def registered(self) -> list[str]:
        """The names of the regions registered through this client that the server has not been
        seen to drop (see :meth:`reconcile_regions`), in registration order."""
        return self._regions.names

    @property
    def region_scope(self) -> str | None:
        """This client's scope: the server knows region ``name`` as ``<scope>.<name>`` (None: as
        ``name``)."""
        return self._regions.scope.scope

    def server_name(self, name: str, *, global_name: bool = False) -> str:
        """The name the server knows region ``name`` by: what a message built outside this
        client, tritonclient or the server's logs name it."""
        return self._regions.server_name(name, global_name)

    @property
    def key_prefix(self) -> str:
        """The prefix of every shared-memory key this client's token may register on a server
        that scopes keys to tokens (``--shm-key-scope token``, its default with tokens); "" without
        a token."""
        return keys.key_prefix(self._token) if self._token else ""

    def shm_key(self, name: str | None = None) -> str | None:
        """A key for a new shared-memory object this client may register: :attr:`key_prefix` and
        ``name`` (fresh when None); without a token ``name`` as it is. For
        ``regions.shared_array(shape, dtype, key=client.shm_key())`` and its siblings."""
        return keys.scoped_key(self._token, name)

    def register(self, name: str, x, *, global_name: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """Register ``x`` as region ``name``: a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor`` / ``shared_copy``) through
        :meth:`register_system`, a contiguous torch CUDA tensor through :meth:`register_cuda`.
        Tensors inside it are then sent by reference, and it may hold ``out=`` outputs. Names as
        :meth:`register_system`'s."""
        balancing.require_one_server(self, "register")
        if isinstance(x, regions.SharedHostBuffer):
            return self.register_system(name, x, global_name=global_name, timeout=timeout,
                                        wait_for_ready=wait_for_ready)
        if codec.is_torch(x) and x.is_cuda:
            return self.register_cuda(name, x, global_name=global_name, timeout=timeout, wait_for_ready=wait_for_ready)
        raise TypeError(f"register: {name!r}: give a SharedHostBuffer (place host memory with regions.shared_copy "
                        f"or shared_array / shared_tensor) or a torch CUDA tensor, got {type(x).__name__}")

    def register_system(self, name: str, key, byte_size: int | None = None, offset: int = 0, *,
                        global_name: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """Register ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` as
        region ``name``. ``key`` may be a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor``), whose size is then the default, and
        whose tensors are then found by address and sent by reference. The server knows it as
        ``<scope>.<name>`` (:attr:`region_scope`), or as ``name`` with ``global_name=True``.
        Refused on a round_robin client (:mod:`.balancing`): a region belongs to one server."""
        balancing.require_one_server(self, "register_system")
        server_name = self._regions.server_name(name, global_name)
        request = regions.system_request(server_name, key, byte_size, offset)
        buf = key if isinstance(key, regions.SharedHostBuffer) else None

        def after(_):
            self._regions.add_system(name, buf, request.offset, request.byte_size, server_name)

        return self._simple("RegisterSystemSharedMemory", request, pb.RegisterSharedMemoryResponse,
                            regions.registered, timeout, after, wait_for_ready=wait_for_ready)

    def register_cuda(self, name: str, handle, device_id: int | None = None, byte_size: int | None = None,
                      offset: int = 0, *, global_name: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """Register CUDA memory as region ``name``: ``handle`` a contiguous torch CUDA tensor (its
        allocation's IPC handle and its offset in it are sent; needs cuda-python), a
        :class:`~.regions.CudaIpcHandle`, or the 64 bytes of a ``cudaIpcMemHandle_t`` with
        ``device_id`` and ``byte_size``. ``offset`` is added to the tensor's own offset. The
        server must be on the same host. A tensor is kept alive by the client until the region
        is unregistered (or the server is seen to have dropped it), and tensors inside its memory
        are sent by reference. Names as :meth:`register_system`'s."""
        balancing.require_one_server(self, "register_cuda")
        server_name = self._regions.server_name(name, global_name)
        keep = None
        if codec.is_torch(handle):
            keep, handle = handle, regions.cuda_ipc_handle(handle)
        request = regions.cuda_request(server_name, handle, device_id, byte_size, offset)
        base = handle.base_ptr if isinstance(handle, regions.CudaIpcHandle) else None

        def after(_):
            start = None if base is None else base + request.offset
            self._regions.add_cuda(name, start, request.byte_size,
                                   handle.device_id if base is not None else request.device_id, keep, server_name)

        return self._simple("RegisterCudaSharedMemory", request, pb.RegisterSharedMemoryResponse,
                            regions.registered, timeout, after, wait_for_ready=wait_for_ready)

    def shared_memory_status(self, name: str = "", *, kind: str | None = None, global_name: bool = False,
                             all_of_caller: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """The regions registered through this client (of ``kind``, "system" or "cuda", when
        given) as a list of :class:`~.regions.RegionStatus` under the caller's names (and
        ``server_name``, the server's). ``name``: that one region (NOT_FOUND when the server does
        not have it, which drops it from this client's table). ``all_of_caller=True``: every
        region the server holds for this caller, other clients' included (under the server's
        names)."""
        balancing.require_one_server(self, "shared_memory_status")
        if name and all_of_caller:
            raise ValueError("shared_memory_status: give a name or all_of_caller=True, not both")
        server_name = self._regions.server_name(name, global_name) if name else ""
        mine = self._regions.registrations()
        request = pb.SharedMemoryStatusRequest(name=server_name, kind=regions.kind_enum(kind))

        def listed(msg: pb.SharedMemoryStatusResponse):
            ours = self._regions.registrations()
            return [dataclasses.replace(s, name=name or self._regions.shown_name(s.name), server_name=s.name)
                    for s in regions.status_result(msg) if name or all_of_caller or s.name in ours]

        named = {server_name: mine[server_name]} if server_name in mine else {}
        return self._simple("SharedMemoryStatus", request, pb.SharedMemoryStatusResponse, listed, timeout,
                            on_error=self._forgetting_missing(named), wait_for_ready=wait_for_ready)

    def unregister(self, name: str = "", *, kind: str | None = None, global_name: bool = False,
                   all_of_caller: bool = False, timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> list[str]:
        """Unregister region ``name``; without a name, every region registered through this client
        (of ``kind`` when given), one request each, and nothing else: other clients keep theirs,
        those of the same caller too (every client, without bearer tokens).

        ``all_of_caller=True``: every region the server holds for this caller (of ``kind``), other
        clients' included: the server's unregister with an empty name, as KServe's.

        Returns the names unregistered, sorted (the caller's names for this client's regions,
        the server's for others); none for a name the server did not have. Each leaves this
        client's table, with the memory the table kept alive for it."""
        balancing.require_one_server(self, "unregister")
        enum = regions.kind_enum(kind)
        if all_of_caller:
            if name:
                raise ValueError("unregister: give a name or all_of_caller=True, not both")
            before = self._regions.registrations(kind)

            def gone(msg: pb.UnregisterSharedMemoryResponse) -> list[str]:
                shown = sorted(self._regions.shown_name(n) for n in msg.names)
                self._regions.drop({n: before[n] for n in msg.names if n in before})
                return shown

            return self._simple("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(kind=enum),
                                pb.UnregisterSharedMemoryResponse, gone, timeout, wait_for_ready=wait_for_ready)
        if name:
            server_name = self._regions.server_name(name, global_name)
            serial = self._regions.registrations().get(server_name)
            calls = [self._unregister_one(server_name, serial, name, enum, timeout)]
        else:
            calls = [self._unregister_one(server_name, serial, self._regions.shown_name(server_name),
                                          pb.REGION_KIND_UNSPECIFIED, timeout)
                     for server_name, serial in self._regions.registrations(kind).items()]
        return self._call_each(calls, lambda answers: sorted(n for names in answers for n in names), wait_for_ready)

    def _unregister_one(self, server_name: str, serial: int | None, shown: str, kind: int, timeout):
        """The call that unregisters one region: ``(rpc, request bytes, timeout, parse)``; its
        answer drops the registration ``serial`` from the table when the server no longer has the
        region (it answered its name, or nothing to a request of any kind)."""
        request = pb.UnregisterSharedMemoryRequest(name=server_name, kind=kind)

        def gone(msg: pb.UnregisterSharedMemoryResponse) -> list[str]:
            removed = server_name in msg.names
            if serial is not None and (removed or kind == pb.REGION_KIND_UNSPECIFIED):
                self._regions.drop({server_name: serial})
            return [shown] if removed else []

        return ("UnregisterSharedMemory", request.SerializeToString(), timeout,
                parse_as(pb.UnregisterSharedMemoryResponse, gone))

    def reconcile_regions(self, *, timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> list[str]:
        """Bring this client's table in line with the server: drop every region registered through
        this client that the server no longer holds for this caller (unregistered by another
        client of the same caller with ``all_of_caller``, or by a server restart), with the
        memory the table kept alive for it. Returns the names dropped."""
        balancing.require_one_server(self, "reconcile_regions")
        before = self._regions.registrations()

        def compare(msg: pb.SharedMemoryStatusResponse) -> list[str]:
            held = {r.name for r in msg.regions}
            return self._regions.drop({n: serial for n, serial in before.items() if n not in held})

        return self._simple("SharedMemoryStatus", pb.SharedMemoryStatusRequest(), pb.SharedMemoryStatusResponse,
                            compare, timeout, wait_for_ready=wait_for_ready)

    def _forgetting_missing(self, named: Registrations):
        """The ``on_error`` of a call naming the registrations ``named``: a NOT_FOUND that quotes
        one of them drops it from the table (the server no longer has it) and says so in the
        error. None when the call names none."""
        if not named:
            return None

        def on_error(exc):
            if exc.code != grpc.StatusCode.NOT_FOUND:
                return exc
            quoted = {n: serial for n, serial in named.items() if _quoted(n) in exc.details}
            if len(quoted) != 1:  # two long names cut to the same quote: which one is unknown
                return exc
            dropped = self._regions.drop(quoted)
            return exc.dropping(dropped) if dropped else exc

        return on_error

    def _region_error(self, error, named: Registrations):
        """``error`` (a LogitServeError) of a call naming ``named``, as :meth:`_forgetting_missing` makes it."""
        on_error = self._forgetting_missing(named)
        return error if on_error is None else on_error(error)

    def _unregister_requests(self) -> list[bytes]:
        """close()'s unregistering: one request per region registered through this client."""
        if not self.unregister_on_close:
            return []
        return [pb.UnregisterSharedMemoryRequest(name=n).SerializeToString() for n in self._regions.registrations()]
