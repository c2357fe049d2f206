"""The server interceptors, outermost first: one maps exceptions to status codes (and logs and
counts every RPC), one checks bearer tokens, and the innermost turns request bytes that do not
parse into ``ValueError`` (INVALID_ARGUMENT), after authentication.

Status codes (the one place they are decided):

=====================================  ===================
exception                              status
=====================================  ===================
``ValueError``, ``TypeError``          INVALID_ARGUMENT, with the message
:class:`~.errors.TooLarge`, ``QueueFull``  RESOURCE_EXHAUSTED
:class:`~.errors.DeadlineExpired`, ``asyncio.TimeoutError``  DEADLINE_EXCEEDED
:class:`~.errors.Draining`             UNAVAILABLE
:class:`~.errors.Unauthenticated`      UNAUTHENTICATED
``asyncio.CancelledError``             CANCELLED (the client left; re-raised)
anything else (a device fault)         INTERNAL: that call fails, the server goes on
=====================================  ===================
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from .errors import DeadlineExpired, Draining, QueueFull, TooLarge, Unauthenticated
from .logs import get_logger, log_event

log = get_logger("rpc")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REQUEST_ID_KEY = "x-request-id"

_STATUS = (
    ((ValueError, TypeError), grpc.StatusCode.INVALID_ARGUMENT),
    ((TooLarge, QueueFull), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((DeadlineExpired, asyncio.TimeoutError), grpc.StatusCode.DEADLINE_EXCEEDED),
    ((Draining,), grpc.StatusCode.UNAVAILABLE),
    ((Unauthenticated,), grpc.StatusCode.UNAUTHENTICATED),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a failed call answers with."""
    for types, code in _STATUS:
        if isinstance(exc, types):
            return code, str(exc) or type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}): {exc}"


@dataclass
class CallRecord:
    """What the log line and metrics of one RPC say; handlers add the rows they carried."""

    rpc: str
    request_id: str
    rows: int = 0
    code: grpc.StatusCode = grpc.StatusCode.OK


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("logitserve_call", default=None)


def note_rows(rows: int) -> None:
    """Count ``rows`` toward the current RPC's log line (a no-op outside one)."""
    record = _current.get()
    if record is not None:
        record.rows += rows


def _metadata(details_or_context) -> dict[str, str]:
    md = (details_or_context.invocation_metadata() if callable(getattr(details_or_context, "invocation_metadata"))
          else details_or_context.invocation_metadata)
    return {k: v for k, v in (md or ()) if isinstance(v, str)}


# New request ids: a random prefix per process and a counter, unique across restarts and
# replicas without a random draw per call.
_ID_PREFIX = secrets.token_hex(4)
_ids = itertools.count()


def _request_id(context) -> str:
    """The caller's ``x-request-id``, or a new one."""
    return _metadata(context).get(REQUEST_ID_KEY) or f"{_ID_PREFIX}{next(_ids):08x}"


class _Undecodable:
    """Request bytes that do not parse as the method's message: answered INVALID_ARGUMENT (gRPC
    itself would answer UNKNOWN for a unary call and the stream would end INTERNAL)."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    """``deserializer``, returning :class:`_Undecodable` instead of raising on malformed bytes."""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or anything a corrupt message raises
            return _Undecodable(exc)
    return deserialize


def _decoded(request):
    """``request`` (a message, or a stream of them) with undecodable messages raising ValueError."""
    if isinstance(request, _Undecodable):
        raise ValueError(f"request: not a valid protobuf message for this method ({request.error})")
    if hasattr(request, "__aiter__"):
        return _decoded_stream(request)
    return request


async def _decoded_stream(requests):
    async for request in requests:
        yield _decoded(request)


def _rebuild(handler: grpc.RpcMethodHandler, unary=None, stream=None,
             request_deserializer=None) -> grpc.RpcMethodHandler:
    """A handler like ``handler`` whose behaviour is wrapped by ``unary`` / ``stream`` factories
    (and whose requests are parsed by ``request_deserializer`` when given)."""
    kw = dict(request_deserializer=request_deserializer or handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kw)


class _WrappingInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that wraps each method's handler (:meth:`_wrap`), built once per method.

    Interceptors run for every call; the wrapped handler is rebuilt only when the inner handler
    changes, which keeps that cost off the hot path. Per-call state lives in the wrappers.
    """

    def __init__(self):
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._by_method.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = self._by_method[details.method] = (handler, self._wrap(details.method, handler))
        return cached[1]

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class ExceptionInterceptor(_WrappingInterceptor):
    """Maps exceptions to status codes; records metrics and logs one line per RPC.

    The line of a call that succeeded (or was cancelled by its client) is at debug level: at
    info, formatting and writing it cost about 200 us a call and a third of the throughput on
    the H100 host (Sample 1x128256, bench/service.py). Failures log at warning, faults at error.

    ``is_draining()`` true turns new calls away with UNAVAILABLE (health checks excepted).
    """

    def __init__(self, metrics=None, is_draining=lambda: False):
        super().__init__()
        self._metrics = metrics
        self._is_draining = is_draining

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        rpc = method.rsplit("/", 1)[-1]
        check_draining = not method.startswith(HEALTH_PREFIX)

        def admit(record: CallRecord, context) -> None:
            # Runs inside the handler's task: the record it sets is that call's alone.
            _current.set(record)
            context.set_trailing_metadata(((REQUEST_ID_KEY, record.request_id),))
            if check_draining and self._is_draining():
                raise Draining("server is draining; retry on another replica")

        async def fail(exc: Exception, record: CallRecord, context) -> None:
            record.code, message = status_for(exc)
            if record.code == grpc.StatusCode.INTERNAL:
                log_event(log, "fault", level=logging.ERROR, exc_info=exc, request_id=record.request_id, rpc=rpc)
            await context.abort(record.code, message)

        def unary(behaviour):
            async def wrapped(request, context):
                record, t0 = CallRecord(rpc, _request_id(context)), time.perf_counter()
                try:
                    admit(record, context)
                    return await behaviour(request, context)
                except asyncio.CancelledError:
                    record.code = grpc.StatusCode.CANCELLED
                    raise
                except grpc.aio.AbortError:
                    record.code = context.code() or grpc.StatusCode.UNKNOWN
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status, never lost
                    await fail(exc, record, context)
                finally:
                    self._finish(record, t0)
            return wrapped

        def stream(behaviour):
            if not inspect.isasyncgenfunction(behaviour):
                # A streaming handler written as a coroutine that calls context.write() (the
                # health service's Watch): wrapped like a unary one.
                return unary(behaviour)

            async def wrapped(request, context):
                record, t0 = CallRecord(rpc, _request_id(context)), time.perf_counter()
                try:
                    admit(record, context)
                    async for response in behaviour(request, context):
                        yield response
                except asyncio.CancelledError:
                    record.code = grpc.StatusCode.CANCELLED
                    raise
                except grpc.aio.AbortError:
                    record.code = context.code() or grpc.StatusCode.UNKNOWN
                    raise
                except Exception as exc:  # noqa: BLE001
                    await fail(exc, record, context)
                finally:
                    self._finish(record, t0)
            return wrapped

        return _rebuild(handler, unary, stream)

    def _finish(self, record: CallRecord, t0: float) -> None:
        seconds = time.perf_counter() - t0
        if self._metrics is not None:
            self._metrics.observe_rpc(record.rpc, record.code.name, seconds)
        level = logging.DEBUG if record.code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) else logging.WARNING
        log_event(log, "rpc", level=level, request_id=record.request_id, rpc=record.rpc, rows=record.rows,
                  status=record.code.name, latency_ms=round(seconds * 1e3, 3))


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but the health service needs ``authorization: Bearer <token>`` metadata."""

    def __init__(self, tokens):
        self._tokens = tokens

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        if self._tokens.check(_metadata(details).get("authorization")):
            return handler

        def deny_unary(_behaviour):
            async def denied(request, context):
                raise Unauthenticated("missing or invalid bearer token (metadata 'authorization: Bearer <token>')")
            return denied

        def deny_stream(_behaviour):
            async def denied(request, context):
                raise Unauthenticated("missing or invalid bearer token (metadata 'authorization: Bearer <token>')")
                yield  # an async generator, like the handler it replaces
            return denied

        return _rebuild(handler, deny_unary, deny_stream)


class RequestDecodeInterceptor(_WrappingInterceptor):
    """Innermost: request bytes that do not parse as the method's message raise ``ValueError``
    inside the handler (INVALID_ARGUMENT through :class:`ExceptionInterceptor`), so a caller
    without a valid token learns nothing of its request. Left to itself gRPC would answer a unary
    call UNKNOWN and end a stream INTERNAL."""

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        def wrap(behaviour):
            if inspect.isasyncgenfunction(behaviour):
                async def stream(request, context):
                    async for response in behaviour(_decoded(request), context):
                        yield response
                return stream

            async def unary(request, context):
                return await behaviour(_decoded(request), context)
            return unary

        return _rebuild(handler, wrap, wrap, _tolerant(handler.request_deserializer))
