"""The LogitServe servicer: each handler validates into a call (ops), submits it to the batcher
and answers with its result. Errors are raised, never set here: guard.py maps them.
"""

from __future__ import annotations

import asyncio

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import ops
from .errors import Draining
from .guard import note_rows


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

    async def _run(self, call, context):
        note_rows(call.rows)
        result = await self._service.batcher.submit(call, timeout=context.time_remaining())
        return result.to_pb()

    async def Sample(self, request, context):
        return await self._run(ops.SampleCall.from_pb(request, self._service.limits), context)

    async def RouteExperts(self, request, context):
        return await self._run(ops.RouteExpertsCall.from_pb(request, self._service.limits), context)

    async def Softmax(self, request, context):
        return await self._run(ops.SoftmaxCall.from_pb(request, self._service.limits), context)

    async def CausalSoftmax(self, request, context):
        return await self._run(ops.CausalSoftmaxCall.from_pb(request, self._service.limits), context)

    async def Silu(self, request, context):
        return await self._run(ops.SiluCall.from_pb(request, self._service.limits), context)

    async def _step(self, request, context) -> pb.StepResponse:
        step = ops.StepCall.from_pb(request, self._service.limits)
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
