"""The ``inference.GRPCInferenceService`` handlers (KServe v2 with Triton's extensions), beside
``logitserve.v1`` on the same server: the same guard (auth, draining, status codes, metrics, log
line), the same validation (each operator's ``from_pb``, through translate.py), the same
batcher, limits, shared-memory registry and sequences (sequences.py).

Wiring, in ``Service.__init__`` (``guarded`` the GuardedRegistrar, made with
:func:`request_parsers` among its parsers)::

    kserve.add_to_server(self, guarded)

An unknown model or version answers NOT_FOUND; everything else maps as in guard.py. In
``ModelStreamInfer`` a failed request, or a message that does not parse, is answered by its
``error_message`` (the message the unary call's status would carry) and the stream goes on, as
in Triton; a draining server ends the stream UNAVAILABLE, as ``StreamSteps`` does.

An inference's answer is held (server/api/held.py, --max-held-answer-bytes and its per-connection
bound) from before its work until the RPC ends, or in a stream until gRPC has taken it, as
logitserve.v1's are: past either bound it is refused (RESOURCE_EXHAUSTED, or its
``error_message``) before any work.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from grpc_health.v1 import health_pb2

from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc

from ...errors import Draining
from ..guard import let_go, note_rows
from ..status import status_for
from ...regions import CUDA, SYSTEM, CallRegions, RegionNotFound
from ...regions.servicer import caller
from . import translate
from .models import MODELS, PLATFORM, VERSION
from .sequences import sequence_of

SERVICE = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME = SERVICE.full_name


@dataclass
class ReceivedInfer:
    """A ModelInferRequest as received: the message, and its raw_input_contents as views of the
    received bytes."""

    message: kpb.ModelInferRequest
    raw: list


@dataclass
class Unparsed:
    """A message of a ModelStreamInfer stream that is not a ModelInferRequest: answered by its
    ``error_message``, the stream goes on (a unary call's is INVALID_ARGUMENT, by guard.py)."""

    reason: str


def _parse_infer(data: bytes) -> ReceivedInfer:
    return ReceivedInfer(*translate.split_raw(data))


def _parse_stream_infer(data: bytes) -> ReceivedInfer | Unparsed:
    try:
        return _parse_infer(data)
    except Exception as exc:  # noqa: BLE001 - DecodeError, or anything a corrupt message raises
        return Unparsed(f"request: not a valid ModelInferRequest ({exc})")


def request_parsers() -> dict:
    """The deserializers of the inference RPCs, by method path: raw_input_contents left in place."""
    return {f"/{SERVICE_NAME}/ModelInfer": _parse_infer, f"/{SERVICE_NAME}/ModelStreamInfer": _parse_stream_infer}


def _region_bytes(registry, name: str, owner) -> int | None:
    """The size of ``owner``'s region ``name``, None without one (the operator's validation
    says so, naming the field)."""
    try:
        return registry.status(name, owner)[0].byte_size
    except RegionNotFound:
        return None


class Statistics:
    """Per model: requests answered and failed, with their durations, and the last answer's time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_model = {name: [0, 0, 0, 0, 0] for name in MODELS}  # ok, ok ns, failed, failed ns, last ms

    def record(self, model: str, ok: bool, ns: int) -> None:
        with self._lock:
            entry = self._by_model[model]
            if ok:
                entry[0] += 1
                entry[1] += ns
                entry[4] = time.time_ns() // 1_000_000
            else:
                entry[2] += 1
                entry[3] += ns

    def message(self, model: str) -> kpb.ModelStatistics:
        with self._lock:
            ok, ok_ns, failed, failed_ns, last = self._by_model[model]
        duration = kpb.StatisticDuration
        return kpb.ModelStatistics(
            name=model, version=VERSION, last_inference=last, inference_count=ok, execution_count=ok,
            inference_stats=kpb.InferStatistics(success=duration(count=ok, ns=ok_ns),
                                                fail=duration(count=failed, ns=failed_ns)))


class InferenceServicer(kpb_grpc.GRPCInferenceServiceServicer):
    """Handlers of ``inference.GRPCInferenceService``; ``service`` is the running app (app.Service)."""

    def __init__(self, service):
        self._service = service
        self.statistics = Statistics()

    # -- health and metadata --------------------------------------------------------------

    async def _ready(self, context) -> bool:
        service = self._service
        if service.draining or service.device_lost:
            return False
        answer = await service.health.Check(health_pb2.HealthCheckRequest(service=""), context)
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    async def ServerLive(self, request, context):
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kpb.ServerReadyResponse(ready=await self._ready(context))

    async def ModelReady(self, request, context):
        try:
            translate.model_of(request.name, request.version)
        except translate.ModelNotFound:
            return kpb.ModelReadyResponse(ready=False)
        return kpb.ModelReadyResponse(ready=await self._ready(context))

    async def ServerMetadata(self, request, context):
        extensions = ["model_configuration", "statistics", "parameters", "system_shared_memory"]
        if self._service.handle.device.type == "cuda":
            extensions.append("cuda_shared_memory")
        return kpb.ServerMetadataResponse(name=PLATFORM, version=self._service.version, extensions=extensions)

    async def ModelMetadata(self, request, context):
        return translate.model_of(request.name, request.version).metadata()

    async def ModelConfig(self, request, context):
        return kpb.ModelConfigResponse(config=translate.model_of(request.name, request.version).config())

    async def ModelStatistics(self, request, context):
        names = [translate.model_of(request.name, request.version).name] if request.name else list(MODELS)
        return kpb.ModelStatisticsResponse(model_stats=[self.statistics.message(n) for n in names])

    async def RepositoryIndex(self, request, context):
        ready = await self._ready(context)
        if request.ready and not ready:
            return kpb.RepositoryIndexResponse()
        index = kpb.RepositoryIndexResponse.ModelIndex
        return kpb.RepositoryIndexResponse(models=[
            index(name=name, version=VERSION, state="READY" if ready else "UNAVAILABLE",
                  reason="" if ready else "the server is not ready (warming up, draining or device lost)")
            for name in MODELS])

    # -- inference --------------------------------------------------------------------------

    async def _infer(self, received: ReceivedInfer, context, held: list | None = None,
                     response: kpb.ModelInferResponse | None = None) -> kpb.ModelInferResponse:
        """One inference: translated, validated by its operator, batched, answered (into
        ``response`` when given). Its answer's bytes are held (server/api/held.py) until the RPC
        ends, or, with ``held`` (a list), until the caller calls the function appended to it."""
        request = received.message
        model = translate.model_of(request.model_name, request.model_version)
        service = self._service
        t0 = time.perf_counter_ns()
        registry = service.regions
        regions = None if registry is None else CallRegions(registry, lambda: caller(context))
        ok = False
        try:
            job = translate.to_v1(model, request, received.raw)
            if regions is not None:
                translate.check_capacities(job, lambda name: _region_bytes(registry, name, regions.owner))
            async with sequence_of(job, service, context) as options:
                try:
                    call = model.call.from_pb(job.message, service.limits, in_place=job.in_place, regions=regions,
                                              **options)
                except translate.RENAMED as exc:
                    raise translate.renamed(exc, job.names) from None
                note_rows(call.rows)
                # The operator's answer size: the KServe answer carries the same tensors, its framing
                # (output names, datatypes) differing by tens of bytes.
                if held is None:
                    service.held.hold_until_done(context, call.answer_size)
                else:
                    held.append(service.held.hold(context, call.answer_size))
                result = await service.batcher.submit(call, timeout=context.time_remaining())
                # Builds the answer (writing outputs into system regions) before the leases go.
                response = translate.to_kserve(model, request.id, result.to_pb(), job.outputs, response)
            ok = True
            return response
        finally:
            if regions is not None:
                regions.finish()
            self.statistics.record(model.name, ok, time.perf_counter_ns() - t0)

    async def ModelInfer(self, request: ReceivedInfer, context):
        return await self._infer(request, context)

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            if self._service.draining:
                raise Draining("server is draining; reopen the stream on another replica")
            held = []
            try:
                # The generator resumes once gRPC has taken the answer (written it, as the
                # client's receive window allows): its bytes are held until then. Yielded as
                # awaited, the answer is no local of this frame meanwhile.
                yield await self._stream_answer(request, context, held)
            finally:
                for release in held:
                    release()

    async def _stream_answer(self, request: ReceivedInfer | Unparsed, context,
                             held: list) -> kpb.ModelStreamInferResponse:
        """One message of a stream answered: its inference (built in place, not copied into the
        stream's message), or the error_message its unary call's status would carry."""
        if isinstance(request, Unparsed):
            return kpb.ModelStreamInferResponse(error_message=request.reason)
        answer = kpb.ModelStreamInferResponse()
        try:
            await self._infer(request, context, held, answer.infer_response)
        except Draining:
            raise
        except Exception as exc:  # noqa: BLE001 - answered in error_message, as its status would say
            message = status_for(exc)[1]
            let_go(exc)  # the stream goes on: its traceback must not keep this request alive
            return kpb.ModelStreamInferResponse(error_message=message)
        return answer

    # -- shared memory: the registry of logitserve.v1.SharedMemory ----------------------------

    async def SystemSharedMemoryRegister(self, request, context):
        self._service.regions.register_system(request.name, request.key, request.offset, request.byte_size,
                                              caller(context))
        return kpb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        status = kpb.SystemSharedMemoryStatusResponse.RegionStatus
        infos = self._service.regions.status(request.name, caller(context), SYSTEM)
        return kpb.SystemSharedMemoryStatusResponse(regions={
            i.name: status(name=i.name, key=i.key, offset=i.offset, byte_size=i.byte_size) for i in infos})

    async def SystemSharedMemoryUnregister(self, request, context):
        self._service.regions.unregister(request.name, caller(context), SYSTEM)
        return kpb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryRegister(self, request, context):
        # Opening a handle can take milliseconds: off the event loop.
        await asyncio.to_thread(self._service.regions.register_cuda, request.name, request.raw_handle,
                                request.device_id, request.byte_size, caller(context))
        return kpb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        status = kpb.CudaSharedMemoryStatusResponse.RegionStatus
        infos = self._service.regions.status(request.name, caller(context), CUDA)
        return kpb.CudaSharedMemoryStatusResponse(regions={
            i.name: status(name=i.name, device_id=i.device_id, byte_size=i.byte_size) for i in infos})

    async def CudaSharedMemoryUnregister(self, request, context):
        self._service.regions.unregister(request.name, caller(context), CUDA)
        return kpb.CudaSharedMemoryUnregisterResponse()


def add_to_server(service, server) -> InferenceServicer:
    """Serve ``inference.GRPCInferenceService`` for ``service`` (app.Service) on ``server`` (the
    GuardedRegistrar the other services are added through); returns the servicer."""
    servicer = InferenceServicer(service)
    kpb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    return servicer
