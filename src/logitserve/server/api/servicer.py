"""The LogitServe servicer: each handler validates into a call (ops), submits it to the batcher
and answers with its result. Errors are raised, never set here: guard.py maps them.

The requests of the RPCs that carry tensors (the operators, Step, StreamSteps) arrive read by
:func:`request_parsers`' deserializers, their tensors' bytes left where gRPC received them
(wire.py): those handlers get a :class:`~.wire.Received`.

Each request gets a :class:`~.regions.CallRegions` for the caller's owner (its
``authorization`` metadata), through which validation resolves the tensors and outputs that
live in shared-memory regions; the handler lets go of it (``finish``) once the answer is built
or the call failed, and the last launch reading its memory releases the leases
(server/regions/calls.py).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from .. import ops
from ..errors import Draining
from .guard import note_rows
from .ordered import ordered_sample, session_events
from ..identity import authorization_of
from ..ops.sample_processors import TENSOR_FIELDS as PROCESSOR_TENSOR_FIELDS
from ..regions import CallRegions
from ..regions.servicer import caller
from ..sequences.open import close_sequences, open_sequences
from ..sequences.sample import SequenceLookup
from ..sequences.update import update_sequences
from ..wire import InPlaceReader, Received

SERVICE = pb.DESCRIPTOR.services_by_name["LogitServe"]
# Each operator request's tensor fields, read in place.
_TENSORS = {
    pb.SampleRequest: ("logits", *PROCESSOR_TENSOR_FIELDS),
    pb.RouteExpertsRequest: ("gate_logits",),
    pb.SoftmaxRequest: ("x",),
    pb.CausalSoftmaxRequest: ("x",),
    pb.SiluRequest: ("x", "up"),
    pb.VerifyDraftRequest: ("draft_token_ids", "draft_probs", "draft_logits", "target_logits"),
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


def _claimed_rows(message) -> int:
    """The rows a request's tensors claim by their shapes (for the log line of a call that failed
    validation): prod(shape[:-1]) of each operator's first tensor."""
    if isinstance(message, pb.StepRequest):
        return sum(_claimed_rows(getattr(message, name)) for name in ops.STEP_OPS if message.HasField(name))
    for name in _TENSORS.get(type(message), ())[:1]:
        rows = 1
        for d in getattr(message, name).shape[:-1]:
            rows *= d
        return rows if len(getattr(message, name).shape) else 0
    return 0


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

    def _regions(self, context) -> CallRegions | None:
        """The request's regions, for the caller's owner (read from its metadata when first needed)."""
        registry = self._service.regions
        return None if registry is None else CallRegions(registry, lambda: caller(context))

    async def _run(self, op, request: Received, context, **options):
        regions = self._regions(context)
        try:
            try:
                call = op.from_pb(request.message, self._service.limits, in_place=request.tensor_bytes,
                                  regions=regions, **options)
            except Exception:
                note_rows(_claimed_rows(request.message))
                raise
            note_rows(call.rows)
            self._service.held.hold_until_done(context, call.answer_size)
            result = await self._service.batcher.submit(call, timeout=context.time_remaining())
            return result.to_pb()  # writes the outputs into system regions: before the leases go
        finally:
            if regions is not None:
                regions.finish()

    async def Sample(self, request: Received, context):
        sequences = SequenceLookup(self._service.sequences, context)
        if request.message.HasField("ordered"):
            return await self._ordered_sample(request, context, sequences)
        return await self._run(ops.SampleCall, request, context, sequences=sequences)

    async def _ordered_sample(self, request: Received, context, sequences) -> pb.SampleResponse:
        """A Sample ordered on the GPU (server/api/ordered.py): validated as any, then enqueued on
        its session instead of the batcher."""
        regions = self._regions(context)
        try:
            try:
                call = ops.SampleCall.from_pb(request.message, self._service.limits, in_place=request.tensor_bytes,
                                              regions=regions, sequences=sequences)
            except Exception:
                note_rows(_claimed_rows(request.message))
                raise
            note_rows(call.rows)
            self._service.held.hold_until_done(context, call.answer_size)
            return await ordered_sample(self._service, call, request.message.ordered, caller(context),
                                        context.time_remaining())
        finally:
            if regions is not None:
                regions.finish()

    async def RouteExperts(self, request: Received, context):
        return await self._run(ops.RouteExpertsCall, request, context)

    async def Softmax(self, request: Received, context):
        return await self._run(ops.SoftmaxCall, request, context)

    async def CausalSoftmax(self, request: Received, context):
        return await self._run(ops.CausalSoftmaxCall, request, context)

    async def Silu(self, request: Received, context):
        return await self._run(ops.SiluCall, request, context)

    async def VerifyDraft(self, request: Received, context):
        return await self._run(ops.VerifyDraftCall, request, context)

    async def _step(self, request: Received, context, held=None) -> pb.StepResponse:
        """One step's answer; its bytes are held (server/api/held.py) until the RPC ends, or, with
        ``held`` (a list), until the caller calls the function appended to it."""
        regions = self._regions(context)
        try:
            try:
                step = ops.StepCall.from_pb(request.message, self._service.limits, in_place=request.tensor_bytes,
                                            regions=regions)
            except Exception:
                note_rows(_claimed_rows(request.message))
                raise
            note_rows(step.rows)
            if held is None:
                self._service.held.hold_until_done(context, step.answer_size)
            else:
                held.append(self._service.held.hold(context, step.answer_size))
            timeout = context.time_remaining()
            submits = {name: self._service.batcher.submit(call, timeout=timeout) for name, call in step.calls.items()}
            return ops.StepResult(step.id, await _all(submits)).to_pb()
        finally:
            if regions is not None:
                regions.finish()

    async def Step(self, request, context):
        return await self._step(request, context)

    async def StreamSteps(self, request_iterator, context):
        async for request in request_iterator:
            if self._service.draining:
                raise Draining("server is draining; reopen the stream on another replica")
            held = []
            try:
                # The generator resumes once gRPC has taken the answer (written it, as the
                # client's receive window allows): that step's bytes are held until then.
                yield await self._step(request, context, held)
            finally:
                for release in held:
                    release()

    async def OpenSequences(self, request, context):
        return await open_sequences(self._service.sequences, request, caller(context), self._service.config.max_vocab)

    async def CloseSequences(self, request, context):
        return close_sequences(self._service.sequences, request, caller(context))

    async def UpdateSequences(self, request, context):
        return await update_sequences(self._service.sequences, request, caller(context),
                                      self._service.config.max_vocab)

    async def GetServerInfo(self, request, context):
        return self._service.info(caller(context)).to_pb()

    async def OpenChannel(self, request, context):
        return self._service.channels.open(authorization_of(context.invocation_metadata() or ()))

    async def OrderedSession(self, request, context):
        async for event in session_events(self._service.ordered, self._service.regions, request, caller(context)):
            yield event

    async def CloseChannel(self, request, context):
        closed = self._service.channels.close(request.key, authorization_of(context.invocation_metadata() or ()))
        return pb.CloseChannelResponse(closed=closed)
