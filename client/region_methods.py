"""The client methods of the ``SharedMemory`` service: registering regions, their status and
unregistering them, written once for ``Client`` and ``AsyncClient``.

:class:`RegionMethods` is a mixin of :class:`~.client._Methods`: it uses the client's ``_simple``
(one call of a plain message), ``_regions`` (the :class:`~.region_table.RegionTable` of what
was registered through it) and ``unregister_on_close``. The requests and answers are
:mod:`.regions`'.
"""

from __future__ import annotations

from logitserve.v1 import logitserve_pb2 as pb

from . import codec, regions
from .transport import CLIENT_TIMEOUT


class RegionMethods:
    """Shared-memory regions (the SharedMemory service; helpers in logitserve.client.regions)."""

    @property
    def registered(self) -> list[str]:
        """The names of the regions registered through this client and not yet unregistered."""
        return self._regions.names

    def register(self, name: str, x, *, timeout=CLIENT_TIMEOUT):
        """Register ``x`` as region ``name``: a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor`` / ``shared_copy``) through
        :meth:`register_system`, a contiguous torch CUDA tensor through :meth:`register_cuda`.
        Tensors inside it are then sent by reference, and it may hold ``out=`` outputs."""
        if isinstance(x, regions.SharedHostBuffer):
            return self.register_system(name, x, timeout=timeout)
        if codec.is_torch(x) and x.is_cuda:
            return self.register_cuda(name, x, timeout=timeout)
        raise TypeError(f"register: {name!r}: give a SharedHostBuffer (place host memory with regions.shared_copy "
                        f"or shared_array / shared_tensor) or a torch CUDA tensor, got {type(x).__name__}")

    def register_system(self, name: str, key, byte_size: int | None = None, offset: int = 0, *, timeout=CLIENT_TIMEOUT):
        """Register ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` as
        region ``name``. ``key`` may be a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor``), whose size is then the default, and
        whose tensors are then found by address and sent by reference."""
        request = regions.system_request(name, key, byte_size, offset)
        buf = key if isinstance(key, regions.SharedHostBuffer) else None

        def after(_):
            self._regions.add_system(name, buf, request.offset, request.byte_size)

        return self._simple("RegisterSystemSharedMemory", request, pb.RegisterSharedMemoryResponse,
                            regions.registered, timeout, after)

    def register_cuda(self, name: str, handle, device_id: int | None = None, byte_size: int | None = None,
                      offset: int = 0, *, timeout=CLIENT_TIMEOUT):
        """Register CUDA memory as region ``name``: ``handle`` a contiguous torch CUDA tensor (its
        allocation's IPC handle and its offset in it are sent; needs cuda-python), a
        :class:`~.regions.CudaIpcHandle`, or the 64 bytes of a ``cudaIpcMemHandle_t`` with
        ``device_id`` and ``byte_size``. ``offset`` is added to the tensor's own offset. The
        server must be on the same host. A tensor is kept alive by the client until the region
        is unregistered, and tensors inside its memory are sent by reference."""
        keep = None
        if codec.is_torch(handle):
            keep, handle = handle, regions.cuda_ipc_handle(handle)
        request = regions.cuda_request(name, handle, device_id, byte_size, offset)
        base = handle.base_ptr if isinstance(handle, regions.CudaIpcHandle) else None

        def after(_):
            start = None if base is None else base + request.offset
            self._regions.add_cuda(name, start, request.byte_size,
                                   handle.device_id if base is not None else request.device_id, keep)

        return self._simple("RegisterCudaSharedMemory", request, pb.RegisterSharedMemoryResponse,
                            regions.registered, timeout, after)

    def shared_memory_status(self, name: str = "", *, kind: str | None = None, timeout=CLIENT_TIMEOUT):
        """This caller's regions (of ``kind``, "system" or "cuda", when given) as a list of
        :class:`~.regions.RegionStatus`; ``name``: that one region (NOT_FOUND when unknown)."""
        request = pb.SharedMemoryStatusRequest(name=name, kind=regions.kind_enum(kind))
        return self._simple("SharedMemoryStatus", request, pb.SharedMemoryStatusResponse, regions.status_result,
                            timeout)

    def unregister(self, name: str = "", *, kind: str | None = None, timeout=CLIENT_TIMEOUT) -> list[str]:
        """Unregister region ``name`` (empty: every region of this caller, of ``kind`` when
        given); returns the names unregistered (none for a name not registered)."""
        request = pb.UnregisterSharedMemoryRequest(name=name, kind=regions.kind_enum(kind))
        return self._simple("UnregisterSharedMemory", request, pb.UnregisterSharedMemoryResponse,
                            regions.unregister_result, timeout, lambda msg: self._regions.remove(msg.names))

    def _unregister_requests(self) -> list[bytes]:
        """close()'s unregistering: one request per region registered through this client."""
        if not self.unregister_on_close:
            return []
        return [pb.UnregisterSharedMemoryRequest(name=name).SerializeToString() for name in self._regions.names]

