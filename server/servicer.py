"""The LogitServe servicer: each handler validates into a call (ops), submits it to the batcher
and answers with its result. Errors are raised, never set here: guard.py maps them.

The requests of the RPCs that carry tensors (the operators, Step, StreamSteps) arrive read by
:func:`request_parsers`' deserializers, their tensors' bytes left where gRPC received them
(wire.py): those handlers get a :class:`~.wire.Received`.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import ops
from .errors import Draining
from .guard import note_rows
from .wire import InPlaceReader, Received

SERVICE = pb.DESCRIPTOR.services_by_name["LogitServe"]
# Each operator request's tensor fields, read in place.
_TENSORS = {
    pb.SampleRequest: ("logits",),
    pb.RouteExpertsRequest: ("gate_logits",),
    pb.SoftmaxRequest: ("x",),
    pb.CausalSoftmaxRequest: ("x",),
    pb.SiluRequest: ("x", "up"),
}


def _tensor_paths(request_type) -> dict[str, tuple[int, ...]]:
    """The tensor fields of ``request_type`` to read in place: dotted name -> field numbers."""
    fields = request_type.DESCRIPTOR.fields_by_name
    if request_type is pb.StepRequest:  # each operator's request, one level down
        return {f"{step_field}.{name}": (fields[step_field].number, *path)
                for step_field in ops.STEP_OPS
                for name, path in _tensor_paths(getattr(pb, fields[step_field].message_type.name)).items()}
    return {name: (fields[name].number,) for name in _TENSORS[request_type]}


def request_parsers() -> dict[str, Callable[[bytes], Received]]:
    """The request deserializers of every RPC that carries tensors, by method path
    (``/logitserve.v1.LogitServe/Sample``)."""
    parsers = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        if request_type in _TENSORS or request_type is pb.StepRequest:
            parsers[f"/{SERVICE.full_name}/{method.name}"] = InPlaceReader(request_type.FromString,
                                                                           _tensor_paths(request_type))
    return parsers


async def _all(aws: dict[str, object]) -> dict[str, object]:
    """Await every awaitable of ``aws``; on the first failure cancel the rest and raise it."""
    tasks = {name: asyncio.ensure_future(aw) for name, aw in aws.items()}
    try:
        await asyncio.gather(*tasks.values())
    except BaseException:
        for task in tasks.values():
            task.cancel()
        raise
    return {name: task.result() for name, task in tasks.items()}


class LogitServeServicer(pb_grpc.LogitServeServicer):
    """Handlers of ``logitserve.v1.LogitServe``; ``service`` is the running app (app.Service)."""

    def __init__(self, service):
        self._service = service

    def _call(self, op, request: Received):
        return op.from_pb(request.message, self._service.limits, in_place=request.tensor_bytes)

    async def _run(self, call, context):
        note_rows(call.rows)
        result = await self._service.batcher.submit(call, timeout=context.time_remaining())
        return result.to_pb()

    async def Sample(self, request: Received, context):
        return await self._run(self._call(ops.SampleCall, request), context)

    async def RouteExperts(self, request: Received, context):
        return await self._run(self._call(ops.RouteExpertsCall, request), context)

    async def Softmax(self, request: Received, context):
        return await self._run(self._call(ops.SoftmaxCall, request), context)

    async def CausalSoftmax(self, request: Received, context):
        return await self._run(self._call(ops.CausalSoftmaxCall, request), context)

    async def Silu(self, request: Received, context):
        return await self._run(self._call(ops.SiluCall, request), context)

    async def _step(self, request: Received, context) -> pb.StepResponse:
        step = ops.StepCall.from_pb(request.message, self._service.limits, in_place=request.tensor_bytes)
        note_rows(step.rows)
        timeout = context.time_remaining()
        submits = {name: self._service.batcher.submit(call, timeout=timeout) for name, call in step.calls.items()}
        return ops.StepResult(step.id, await _all(submits)).to_pb()

    async def Step(self, request, context):
        return await self._step(request, context)

    async def StreamSteps(self, request_iterator, context):
        async for request in request_iterator:
            if self._service.draining:
                raise Draining("server is draining; reopen the stream on another replica")
            yield await self._step(request, context)

    async def GetServerInfo(self, request, context):
        return self._service.info().to_pb()
