"""gRPC server reflection, both versions: ``grpc.reflection.v1alpha`` (grpcio-reflection's
servicer) and ``grpc.reflection.v1``, which newer grpcurl and Postman ask for and which
grpcio-reflection does not ship (grpc/grpc#38576).

The two protocols differ only in their package: same messages, same field numbers, so the same
bytes on the wire (protos/logitserve/reflection_v1/reflection.proto). The v1 servicer re-reads
each request as its v1alpha twin, lets the v1alpha servicer answer, and re-reads each answer
back, so both versions give the same answers from one implementation. Wiring, in
``Service.__init__`` (``guarded`` the GuardedRegistrar, so reflection needs a token as the
other services do)::

    reflection.add_to_server(served_names, guarded)
"""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Iterable

from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

from logitserve.reflection_v1 import reflection_pb2 as v1_pb
from logitserve.reflection_v1 import reflection_pb2_grpc as v1_grpc

V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME
V1_SERVICE_NAME = v1_pb.DESCRIPTOR.services_by_name["ServerReflection"].full_name
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


class ReflectionV1Servicer(v1_grpc.ServerReflectionServicer):
    """``grpc.reflection.v1.ServerReflection`` answered by a v1alpha servicer."""

    def __init__(self, v1alpha_servicer: v1alpha.aio.ReflectionServicer):
        self._v1alpha = v1alpha_servicer

    async def ServerReflectionInfo(self, request_iterator: AsyncIterable[v1_pb.ServerReflectionRequest],
                                   context) -> AsyncIterator[v1_pb.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[v1alpha_pb.ServerReflectionRequest]:
            async for request in request_iterator:
                yield v1alpha_pb.ServerReflectionRequest.FromString(request.SerializeToString())

        async for response in self._v1alpha.ServerReflectionInfo(as_v1alpha(), context):
            yield v1_pb.ServerReflectionResponse.FromString(response.SerializeToString())


def add_to_server(service_names: Iterable[str], server) -> None:
    """Serves both reflection versions on ``server`` (a grpc.aio server or a GuardedRegistrar),
    each listing ``service_names`` and the two reflection services; what
    ``reflection.enable_server_reflection`` does for v1alpha alone."""
    v1alpha_servicer = v1alpha.aio.ReflectionServicer((*service_names, *SERVICE_NAMES))
    v1alpha_grpc.add_ServerReflectionServicer_to_server(v1alpha_servicer, server)
    v1_grpc.add_ServerReflectionServicer_to_server(ReflectionV1Servicer(v1alpha_servicer), server)


__all__ = ["SERVICE_NAMES", "V1ALPHA_SERVICE_NAME", "V1_SERVICE_NAME", "ReflectionV1Servicer", "add_to_server"]
