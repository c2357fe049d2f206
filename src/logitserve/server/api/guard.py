"""Every RPC handler, wrapped once when it is registered: request id, draining, bearer token,
request decoding, status codes, metrics and the log line, in that order.

:class:`Guard` wraps a method's handler; :class:`GuardedRegistrar` stands in for the server in a
generated ``add_*_to_server`` (LogitServe, health, reflection) and registers the wrapped
handlers. This is the work gRPC server interceptors would do, without them: with interceptors
grpc.aio runs an interceptor pipeline per call, which costs a large share of a short call's time
and of the server's throughput.

Status codes are decided in one place, :mod:`.status`.
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
from logitserve.v1.channel_format import MAX_REQUEST_ID  # the longest x-request-id accepted (below)

from ..errors import Draining, TooLarge, Unauthenticated, exception_chain
from ..identity import authorization_of
from ..logs import get_logger, log_event
from .status import status_for

log = get_logger("rpc")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REQUEST_ID_KEY = "x-request-id"
# A request id (echoed in the trailers, logged) over MAX_REQUEST_ID is INVALID_ARGUMENT before any
# work, answered under a fresh id.
# Where admit() notes an over-long id in the call's metadata dict: gRPC delivers lowercase keys
# only, so no client can send it.
_LONG_ID = "Long-Request-Id"

@dataclass
class CallRecord:
    """What the log line and metrics of one RPC say; handlers add the rows they carried."""

    rpc: str
    request_id: str
    counted: bool  # in the occupancy the guard counts calls in (health checks are not)
    rows: int = 0
    code: grpc.StatusCode = grpc.StatusCode.OK
    reason: str = ""  # a failed call's status message


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("logitserve_call", default=None)


def note_rows(rows: int) -> None:
    """Count ``rows`` toward the current RPC's log line (a no-op outside one)."""
    record = _current.get()
    if record is not None:
        record.rows += rows


def let_go(exc: BaseException) -> None:
    """Drop what ``exc``, which ended a call, holds of that call: the tracebacks of it and of
    the exceptions chained to it, and the chain. Called once its status is decided and logged.

    A traceback holds the frames it went through, and they their locals: the request, its
    tensors, the call's context. An exception reached back from those locals sat in a
    reference cycle with them, freed only by a garbage collection: gRPC keeps an abort's error
    on the call's state, which the context holds; an asyncio future keeps the error it failed
    with, which the awaiting frame holds (the batcher's deadline, Sample's processor checks on
    a worker thread). Every refused request stayed so (five refused 32 MB Samples: +215 MiB of
    RSS; docs/RELIABILITY.md). Cut loose, they are freed by reference counting as the handler
    returns."""
    for link in exception_chain(exc):
        link.__traceback__ = link.__cause__ = link.__context__ = None


def _metadata(pairs) -> dict[str, str]:
    return {k: v for k, v in pairs if isinstance(v, str)}


# New request ids: a random prefix per process and a counter, unique across restarts and
# replicas without a random draw per call.
_ID_PREFIX = secrets.token_hex(4)
_ids = itertools.count()


def _new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ids):08x}"


def _parsed(request, parse):
    """``request`` (raw bytes, or a stream of them) parsed by ``parse``; bytes that do not parse
    as the method's message raise ValueError (INVALID_ARGUMENT). Runs after the token check, so a
    caller without a valid token costs no parsing and learns nothing of its request (gRPC itself
    would answer UNKNOWN for a unary call and the stream would end INTERNAL)."""
    if parse is None:
        return request
    if hasattr(request, "__aiter__"):
        return _parsed_stream(request, parse)
    try:
        return parse(request)
    except Exception as exc:  # noqa: BLE001 - DecodeError, or anything a corrupt message raises
        raise ValueError(f"request: not a valid protobuf message for this method ({exc})") from None


async def _parsed_stream(requests, parse):
    async for request in requests:
        yield _parsed(request, parse)


def _rebuild(handler: grpc.RpcMethodHandler, unary, stream, parse=None) -> grpc.RpcMethodHandler:
    """A handler like ``handler`` whose behaviour is wrapped by the ``unary`` / ``stream``
    factories (each called with the behaviour, the request parser: ``parse`` when given, else
    the handler's own deserializer, and the response serializer). gRPC hands the wrapped
    behaviour raw bytes: they are parsed only once the call is admitted (token checked). A
    wrapper that serializes its answers itself (``serializes``) gets no serializer from gRPC."""
    parse = parse or handler.request_deserializer
    serialize = handler.response_serializer
    if handler.unary_unary:
        kind, behaviour, factory = grpc.unary_unary_rpc_method_handler, handler.unary_unary, unary
    elif handler.unary_stream:
        kind, behaviour, factory = grpc.unary_stream_rpc_method_handler, handler.unary_stream, stream
    elif handler.stream_unary:
        kind, behaviour, factory = grpc.stream_unary_rpc_method_handler, handler.stream_unary, unary
    else:
        kind, behaviour, factory = grpc.stream_stream_rpc_method_handler, handler.stream_stream, stream
    wrapped = factory(behaviour, parse, serialize)
    return kind(wrapped, request_deserializer=None,
                response_serializer=None if getattr(wrapped, "serializes", False) else serialize)


class Guard:
    """Wraps handlers: maps exceptions to status codes, records metrics, logs one line per RPC.

    ``is_draining()`` true turns new calls away with UNAVAILABLE; a call with several
    ``authorization`` headers is UNAUTHENTICATED (identity.py), and with ``tokens``
    (auth.TokenStore) every call needs ``authorization: Bearer <token>``. Health checks are
    exempt from all three.

    The line of a call that succeeded (or was cancelled by its client) is at debug level: at
    info, formatting and writing a line per call costs a large share of the throughput.
    Failures log at warning, faults at error.
    """

    def __init__(self, metrics=None, is_draining=lambda: False, tokens=None, occupancy=None,
                 max_message_bytes: int | None = None):
        self._metrics = metrics
        # gRPC's send limit (--max-message-bytes): an answer over it is refused here, logged and
        # counted as RESOURCE_EXHAUSTED, instead of failing inside gRPC after the handler returned
        # (which the log and metrics would count as OK).
        self._max_message_bytes = max_message_bytes
        self._is_draining = is_draining
        self._tokens = tokens
        # Counts calls admitted and not yet finished (enter() / leave(); occupancy.Occupancy),
        # if given.
        self._occupancy = occupancy
        # The tasks of the calls admitted and not finished (health checks aside), and whether
        # the drain's grace period is over: those still running then end UNAVAILABLE.
        self._tasks: set[asyncio.Task] = set()
        self._grace_over = False

    def wrap(self, method: str, handler: grpc.RpcMethodHandler, parse=None) -> grpc.RpcMethodHandler:
        """``handler`` guarded; ``parse``, when given, deserializes its requests instead of the
        handler's own deserializer."""
        rpc = method.rsplit("/", 1)[-1]
        exempt = method.startswith(HEALTH_PREFIX)

        def admit(context):
            """The call's record (set as the current one), its metadata (a dict) and its
            metadata as sent (pairs, a key possibly more than once)."""
            pairs = context.invocation_metadata() or ()
            metadata = _metadata(pairs)
            given = metadata.get(REQUEST_ID_KEY)
            if given is not None and len(given) > MAX_REQUEST_ID:
                metadata[_LONG_ID] = str(len(given))
                given = None
            record = CallRecord(rpc, given or _new_request_id(), counted=not exempt)
            if record.counted:
                if self._occupancy is not None:
                    self._occupancy.enter()
                self._tasks.add(asyncio.current_task())
            # Runs inside the handler's task: the record it sets is that call's alone.
            _current.set(record)
            context.set_trailing_metadata(((REQUEST_ID_KEY, record.request_id),))
            return record, metadata, pairs

        def check(metadata, pairs, request, parse):
            """The request, parsed, once the call may go on (identity first: one
            ``authorization`` header, its token if tokens are on; then any per-call work)."""
            if not exempt:  # health checks: answered while draining, no identity, no token
                if self._is_draining():
                    raise Draining("server is draining; retry on another replica")
                authorization = authorization_of(pairs)
                if self._tokens is not None and not self._tokens.check(authorization):
                    raise Unauthenticated("missing or invalid bearer token (metadata 'authorization: Bearer <token>')")
            if _LONG_ID in metadata:
                raise ValueError(f"{REQUEST_ID_KEY}: at most {MAX_REQUEST_ID} characters, got "
                                 f"{metadata[_LONG_ID]}")
            return _parsed(request, parse)

        async def ended_by(exc: BaseException, record: CallRecord, context) -> None:
            """Record how a call that raised ``exc`` ended and answer its status. A cancellation
            (the client left) is re-raised. Anything else ends in gRPC's abort, whose error is
            not raised on through the handler's frames: the handler returns, and gRPC, which
            keeps the error, raises it again from its own code (see :func:`let_go`)."""
            if isinstance(exc, asyncio.CancelledError):
                if not (self._grace_over and record.counted):
                    record.code = grpc.StatusCode.CANCELLED
                    raise exc
                # Cancelled by end_calls(): the drain's grace period ended before the answer.
                exc = Draining("server stopped: the drain's grace period ended before this call was answered; "
                               "retry on another replica")
            if isinstance(exc, grpc.aio.AbortError):  # the handler aborted: its status is sent
                record.code = context.code() or grpc.StatusCode.UNKNOWN
                let_go(exc)
                return
            record.code, message = status_for(exc)
            record.reason = message
            if record.code == grpc.StatusCode.INTERNAL:
                log_event(log, "fault", level=logging.ERROR, exc_info=exc, request_id=record.request_id, rpc=rpc)
            let_go(exc)
            try:
                await context.abort(record.code, message)
            except grpc.aio.AbortError as aborted:
                let_go(aborted)

        def unary(behaviour, parse, serialize, writes=False):
            """``writes``: a streaming behaviour written as a coroutine that calls
            context.write(), which gRPC serializes."""
            async def wrapped(request, context):
                t0 = time.perf_counter()
                record, metadata, pairs = admit(context)
                try:
                    response = await behaviour(check(metadata, pairs, request, parse), context)
                    return response if writes else self._sendable(response, serialize)
                except (asyncio.CancelledError, Exception) as exc:  # noqa: BLE001 - mapped to a status, never lost
                    await ended_by(exc, record, context)
                finally:
                    self._finish(record, t0, asyncio.current_task())
            wrapped.serializes = not writes
            return wrapped

        def stream(behaviour, parse, serialize):
            if not inspect.isasyncgenfunction(behaviour):
                # A streaming handler written as a coroutine that calls context.write() (the
                # health service's Watch): wrapped like a unary one.
                return unary(behaviour, parse, serialize, writes=True)

            async def wrapped(request, context):
                t0 = time.perf_counter()
                record, metadata, pairs = admit(context)
                task = asyncio.current_task()
                try:
                    async for response in behaviour(check(metadata, pairs, request, parse), context):
                        # The message let go as it is serialized: while the answer waits
                        # for the client to read it, only its bytes are held (server/api/held.py).
                        response = self._sendable(response, serialize)
                        yield response
                except GeneratorExit:
                    # The client left while an answer waited here: gRPC cancelled its task (which
                    # was writing) and closes this generator later, from another task. CANCELLED.
                    record.code = grpc.StatusCode.CANCELLED
                    raise
                except (asyncio.CancelledError, Exception) as exc:  # noqa: BLE001 - as in unary
                    await ended_by(exc, record, context)
                finally:
                    self._finish(record, t0, task)
            wrapped.serializes = True
            return wrapped

        return _rebuild(handler, unary, stream, parse)

    def _sendable(self, response, serialize):
        """``response`` serialized (by ``serialize``), if gRPC will send it (its size within
        --max-message-bytes). Serialized here, the message and its result tensors are freed as
        the handler returns: gRPC then holds only these bytes and its own copy of them while the
        answer waits for the client to read it (not the message as well)."""
        if response is None:
            return None
        limit = self._max_message_bytes
        if limit is not None and hasattr(response, "ByteSize"):
            size = response.ByteSize()
            if size > limit:
                raise TooLarge(f"the answer is a {size}-byte message, over this server's message limit of "
                               f"{limit} (--max-message-bytes)")
        return serialize(response) if serialize is not None else response

    def end_calls(self) -> int:
        """The drain's grace period is over: every call still running ends UNAVAILABLE (never
        CANCELLED: clients retry UNAVAILABLE elsewhere). Returns how many were running."""
        self._grace_over = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        return len(tasks)

    @property
    def running(self) -> int:
        """Calls admitted and not finished (health checks aside)."""
        return len(self._tasks)

    def _finish(self, record: CallRecord, t0: float, task: asyncio.Task) -> None:
        if record.counted:
            if self._occupancy is not None:
                self._occupancy.leave()
            self._tasks.discard(task)
        # Metrics and the log line wait for the loop's next turn: the answer is on its way by then
        # (gRPC sends it as the handler returns), and the caller does not wait for them.
        asyncio.get_running_loop().call_soon(self._report, record, time.perf_counter() - t0)

    def _report(self, record: CallRecord, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_rpc(record.rpc, record.code.name, seconds)
        level = logging.DEBUG if record.code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) else logging.WARNING
        failed = {"code": record.code.value[0], "reason": record.reason} if record.reason else {}
        log_event(log, "rpc", level=level, request_id=record.request_id, rpc=record.rpc, rows=record.rows,
                  status=record.code.name, latency_ms=round(seconds * 1e3, 3), **failed)


class _GuardedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose method handlers are wrapped by ``guard`` (once per method).

    Only methods the inner handler knows are kept: a path it does not know (a client may send
    any, of any length, before any token check) is answered UNIMPLEMENTED by gRPC and leaves
    nothing behind here."""

    def __init__(self, inner: grpc.GenericRpcHandler, guard: Guard, parsers: dict):
        self._inner, self._guard, self._parsers = inner, guard, parsers
        self._by_method: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        wrapped = self._by_method.get(method)
        if wrapped is None:
            handler = self._inner.service(handler_call_details)
            if handler is None:
                return None
            wrapped = self._by_method[method] = self._guard.wrap(method, handler, self._parsers.get(method))
        return wrapped


class GuardedRegistrar:
    """Passed as the server to a generated ``add_*_to_server`` (or to
    ``reflection.enable_server_reflection``): registers every handler on ``server`` wrapped by
    ``guard``, with the request deserializers ``parsers`` names (by method path) instead of the
    generated ones::

        pb_grpc.add_LogitServeServicer_to_server(servicer, GuardedRegistrar(server, guard))
    """

    def __init__(self, server: grpc.aio.Server, guard: Guard, parsers: dict | None = None):
        self._server, self._guard, self._parsers = server, guard, parsers or {}
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}  # the wrapped ones, by method path (channels')

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_GuardedGenericHandler(h, self._guard, self._parsers) for h in handlers))

    def add_registered_method_handlers(self, service: str, method_handlers: dict) -> None:
        wrapped = {name: self._guard.wrap(f"/{service}/{name}", h, self._parsers.get(f"/{service}/{name}"))
                   for name, h in method_handlers.items()}
        self.handlers.update({f"/{service}/{name}": h for name, h in wrapped.items()})
        self._server.add_registered_method_handlers(service, wrapped)
