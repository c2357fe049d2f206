"""The ``logitserve.v1.SharedMemory`` service: register, list and unregister regions, each
handler a few lines over a :class:`~.regions.RegionRegistry`.

The caller's regions are those of :func:`~.regions.owner_of` its ``authorization`` metadata.
Wiring, in ``Service.__init__`` beside LogitServe (``guarded`` the GuardedRegistrar)::

    regions_servicer.add_to_server(self.regions, guarded)

Each handler maps the registry's exceptions to their status itself (:data:`REGION_STATUS`,
through ``context.abort``), so the service answers the right codes guarded or not; the guard
records the code of such an abort as it is.
"""

from __future__ import annotations

import asyncio
import functools

import grpc

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from ..errors import TooLarge
from ..identity import authorization_of
from . import CUDA, SYSTEM, RegionExists, RegionInfo, RegionNotFound, RegionRegistry, owner_of

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SharedMemory"].full_name

# The statuses of the registry's exceptions (guard.py's table maps them alike, for the
# LogitServe calls that name regions).
REGION_STATUS = (
    (RegionNotFound, grpc.StatusCode.NOT_FOUND),
    (RegionExists, grpc.StatusCode.ALREADY_EXISTS),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

_KIND_NAMES = {pb.REGION_KIND_UNSPECIFIED: None, pb.REGION_KIND_SYSTEM: SYSTEM, pb.REGION_KIND_CUDA: CUDA}
_KIND_ENUMS = {SYSTEM: pb.REGION_KIND_SYSTEM, CUDA: pb.REGION_KIND_CUDA}


def caller(context) -> str | None:
    """The owner of the calling client's regions: owner_of its one ``authorization`` header,
    the one the guard checked the token of (a call with several is refused: identity.py)."""
    return owner_of(authorization_of(context.invocation_metadata() or ()))


def _kind(value: int) -> str | None:
    try:
        return _KIND_NAMES[value]
    except KeyError:
        raise ValueError(f"kind: unknown value {value}") from None


def region_message(info: RegionInfo) -> pb.SharedMemoryRegion:
    return pb.SharedMemoryRegion(name=info.name, kind=_KIND_ENUMS[info.kind], key=info.key, offset=info.offset,
                                 byte_size=info.byte_size, device_id=info.device_id, in_use=info.in_use)


def _statuses(handler):
    """``handler`` answering the registry's exceptions with their status codes."""

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except (RegionNotFound, RegionExists, ValueError, TooLarge) as exc:
            code = next(code for types, code in REGION_STATUS if isinstance(exc, types))
            await context.abort(code, str(exc))
    return wrapped


class SharedMemoryServicer(pb_grpc.SharedMemoryServicer):
    """The SharedMemory RPCs over ``registry``."""

    def __init__(self, registry: RegionRegistry):
        self.registry = registry

    @_statuses
    async def RegisterSystemSharedMemory(self, request, context):
        self.registry.register_system(request.name, request.key, request.offset, request.byte_size, caller(context))
        return pb.RegisterSharedMemoryResponse()

    @_statuses
    async def RegisterCudaSharedMemory(self, request, context):
        # Opening a handle can take milliseconds: off the event loop.
        await asyncio.to_thread(self.registry.register_cuda, request.name, request.raw_handle, request.device_id,
                                request.byte_size, caller(context), request.offset)
        return pb.RegisterSharedMemoryResponse()

    @_statuses
    async def SharedMemoryStatus(self, request, context):
        infos = self.registry.status(request.name, caller(context), _kind(request.kind))
        return pb.SharedMemoryStatusResponse(regions=[region_message(i) for i in infos])

    @_statuses
    async def UnregisterSharedMemory(self, request, context):
        names = self.registry.unregister(request.name, caller(context), _kind(request.kind))
        return pb.UnregisterSharedMemoryResponse(names=names)


def add_to_server(registry: RegionRegistry, server) -> SharedMemoryServicer:
    """Serve the SharedMemory service over ``registry`` on ``server`` (a ``grpc.aio.Server``, or
    the ``GuardedRegistrar`` the other services are added through); returns the servicer."""
    servicer = SharedMemoryServicer(registry)
    pb_grpc.add_SharedMemoryServicer_to_server(servicer, server)
    return servicer
