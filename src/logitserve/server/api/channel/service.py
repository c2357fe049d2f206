"""The server's half of the same-host channel: OpenChannel and CloseChannel, and each call that
comes through a channel, served by the very handler gRPC's call would reach.

A channel call is read from its header (logitserve.v1.channel_format), then handed to
LogitServe's guarded handler for its method with a :class:`~.context.ChannelCallContext`: the
guard admits it (draining, the token, the request id), parses it, counts it in the metrics and
the log, the handler validates it and queues it in the batcher; the answer, or the status the
guard decided, goes back through the channel. What differs from gRPC is only the transport.
Requests and answers obey --max-message-bytes, as over gRPC.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time

import grpc
from prometheus_client.core import GaugeMetricFamily

from logitserve.v1 import channel_format as fmt
from logitserve.v1 import channel_memory
from logitserve.v1 import logitserve_pb2 as pb

from ...engine.busy_poll import BusyPollEventLoop
from ...errors import TooLarge, Unsupported
from ...logs import get_logger, log_event
from ...tenancy import per_token_bound
from . import transport
from .context import ChannelCallContext
from .table import ChannelTable

log = get_logger("channel")

LOGITSERVE = pb.DESCRIPTOR.services_by_name["LogitServe"].full_name
# How long a stopping server keeps its ports for callers to read the answers it has sent (iceoryx2
# drops those not yet received with the ports): a live caller reads within milliseconds, a dead
# one is let go of by the clean-up of dead nodes; only a stopped caller (SIGSTOP) takes it all.
COLLECT_S = 1.0
SHM_ADVICE = "call over gRPC, or give the server's host more /dev/shm (e.g. docker run --shm-size)"


def _status_code(code: grpc.StatusCode) -> int:
    return code.value[0]


class ChannelCounts:
    """``logitserve_channels_open{owner}``, read from the table at each scrape: owners are the
    regions' (owner_of: a digest of the token, never the token; empty without one)."""

    def __init__(self, table: ChannelTable):
        self._table = table

    def collect(self):
        family = GaugeMetricFamily("logitserve_channels_open", "Same-host channels open, by the owner id of the "
                                   "token that opened them (empty without a token)", labels=["owner"])
        for owner, count in sorted(self._table.by_owner().items(), key=lambda item: item[0] or ""):
            family.add_metric([owner or ""], count)
        yield family


class ChannelService:
    """Channels of one server process. ``handlers``: the guarded handlers by method path (what
    GuardedRegistrar registered with gRPC); ``max_message_bytes``: the limit of requests and answers;
    ``token_share`` of ``max_channels`` is one token's where ``tokens_on``; ``registry``: the
    metrics' registry, which gets the channels open by owner."""

    def __init__(self, enabled: bool, max_channels: int, idle_s: float, max_message_bytes: int, handlers: dict,
                 occupancy=None, *, token_share: float = 1.0, tokens_on: bool = False, registry=None):
        self._unavailable = None if enabled else "this server runs with --channels off"
        if self._unavailable is None:
            self._unavailable = transport.available()
        self._table = ChannelTable(max_channels, idle_s, per_token_bound(max_channels, token_share, tokens_on))
        if registry is not None:
            registry.register(ChannelCounts(self._table))
        self._max_message_bytes = max_message_bytes
        self._handlers = {number: handlers[f"/{LOGITSERVE}/{name}"] for number, name in fmt.METHODS.items()}
        self._transport: transport.Iceoryx2Transport | None = None
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._occupancy = occupancy  # told when a channel call arrives (server/engine/busy_poll.py's rule)

    @property
    def open_channels(self) -> int:
        return len(self._table)

    def start(self) -> None:
        """Create the ports and start serving (on the running loop); a server without iceoryx2,
        or whose ports cannot be made (no writable /dev/shm or /tmp/iceoryx2), logs why and goes
        on without channels: OpenChannel then says why."""
        if self._unavailable is None:
            try:
                self._transport = transport.Iceoryx2Transport(self._table.max_channels)
            except Exception as exc:  # noqa: BLE001 - whatever iceoryx2 raises: gRPC serves on
                self._unavailable = f"iceoryx2 could not create this server's ports ({exc!r})"
        if self._unavailable is not None:
            log_event(log, "channels off", reason=self._unavailable)
            return
        loop = asyncio.get_running_loop()
        self._transport.start(loop, self._on_request)
        if isinstance(loop, BusyPollEventLoop):  # polls the channel's port too while it polls for calls
            loop.poll_also(self._transport.poll)
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep)
        log_event(log, "channels on", service=self._transport.service_name, max_channels=self._table.max_channels)

    def _sweep_every(self) -> float:
        # A quarter of the idle time (at most a minute): a dead client's channel, its event
        # service and its shared memory go at most that long after its idle time.
        return min(self._table.idle_s / 4, 60.0)

    def _sweep(self) -> None:
        """Close the channels idle past their time (also done at each OpenChannel), and again later;
        free the places of callers that died."""
        self._transport.clean_up_dead_nodes()
        closed = self._table.sweep()
        if closed:
            log_event(log, "idle channels closed", closed=closed, open=len(self._table))
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_every(), self._sweep)

    def open(self, authorization: str | None) -> pb.OpenChannelResponse:
        if self._transport is None:
            raise Unsupported(f"channels: {self._unavailable or 'the server has stopped'}; call over gRPC")
        try:
            # The caller's ports are written by iceoryx2 as it makes them, with nothing reserved.
            channel_memory.check_room("channels: a channel's ports", transport.channel_bytes(self._table.max_channels))
        except channel_memory.NoRoom as exc:
            raise TooLarge(f"{exc}; {SHM_ADVICE}") from None
        channel = self._table.open(authorization, self._transport.event)
        return pb.OpenChannelResponse(
            service_name=self._transport.service_name, server_event=self._transport.wake_name,
            client_event=channel.event_name, key=channel.key, format_version=fmt.FORMAT_VERSION,
            max_request_bytes=self._request_limit(), max_answer_bytes=self._answer_limit(),
            iceoryx2_version=transport.ICEORYX2_VERSION, idle_timeout_s=self._table.idle_s)

    def close(self, key: bytes, authorization: str | None) -> bool:
        return self._table.close(key, authorization)

    def _request_limit(self) -> int:
        return fmt.REQUEST_HEADER.size + fmt.MAX_REQUEST_ID + self._max_message_bytes

    def _answer_limit(self) -> int:
        return fmt.ANSWER_HEADER.size + fmt.MAX_REQUEST_ID + self._max_message_bytes + 4096  # + the status message

    def _refuse(self, active, code: grpc.StatusCode, details: str, event=None) -> None:
        self._send(active, fmt.answer(_status_code(code), b"", details.encode()), event)

    def _send(self, active, parts: tuple[bytes, ...], event) -> None:
        """Answer ``active`` with ``parts``; where /dev/shm has no room for them, with
        RESOURCE_EXHAUSTED saying so (the request id kept), or with nothing where even that does not fit."""
        try:
            self._transport.answer(active, parts, event)
        except channel_memory.NoRoom as exc:
            log_event(log, "answer refused", level=logging.WARNING, reason=str(exc))
            _, request_id, _, _ = parts  # fmt.answer's: header, request id, status message, response
            refusal = fmt.answer(_status_code(grpc.StatusCode.RESOURCE_EXHAUSTED), request_id,
                                 f"{exc}; {SHM_ADVICE}".encode())
            try:
                self._transport.answer(active, refusal, event)
            except channel_memory.NoRoom as again:
                self._transport.drop(active, again, event)

    def _on_request(self, active, address: int, size: int) -> None:
        """A request arrived (on the loop): read its header, start its call."""
        if size < fmt.REQUEST_HEADER.size:
            return self._refuse(active, grpc.StatusCode.INVALID_ARGUMENT,
                                f"channel request: {size} bytes, shorter than its {fmt.REQUEST_HEADER.size}-byte header")
        key, method, id_bytes, timeout_us = fmt.REQUEST_HEADER.unpack(ctypes.string_at(address, fmt.REQUEST_HEADER.size))
        channel = self._table.get(key)
        if channel is None:
            # The caller's event is not known: it finds this answer when its wait for one times out.
            return self._refuse(active, grpc.StatusCode.UNAUTHENTICATED,
                                f"{fmt.UNKNOWN_KEY} (closed, idle past its idle_timeout_s, or opened on "
                                "another server process); open a new one")
        handler = self._handlers.get(method)
        message_at = fmt.REQUEST_HEADER.size + id_bytes
        if handler is None:
            return self._refuse(active, grpc.StatusCode.INVALID_ARGUMENT,
                                f"channel request: method {method} is none of the channel's "
                                f"({', '.join(f'{n} {m}' for n, m in fmt.METHODS.items())})", channel.event)
        if id_bytes > fmt.MAX_REQUEST_ID or message_at > size:
            return self._refuse(active, grpc.StatusCode.INVALID_ARGUMENT,
                                f"channel request: request_id_bytes {id_bytes} must be at most {fmt.MAX_REQUEST_ID} and "
                                f"within the request's {size} bytes", channel.event)
        if size - message_at > self._max_message_bytes:
            return self._refuse(active, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request: a {size - message_at}-byte message, over this server's limit of "
                                f"{self._max_message_bytes} (--max-message-bytes)", channel.event)
        if self._occupancy is not None:
            self._occupancy.channel_call_at = time.monotonic()
        request_id = ctypes.string_at(address + fmt.REQUEST_HEADER.size, id_bytes).decode("ascii", "replace")
        message = ctypes.string_at(address + message_at, size - message_at)
        context = ChannelCallContext(channel.peer, channel.authorization, request_id,
                                     timeout_us * 1e-6 if timeout_us else None)
        task = asyncio.get_running_loop().create_task(self._serve(active, channel, handler, message, context))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, active, channel, handler, message: bytes, context: ChannelCallContext) -> None:
        """Run the guarded handler, answer with its response or the status the guard set."""
        try:
            response = await handler.unary_unary(message, context)
        except asyncio.CancelledError:
            # The server is stopping under it (the guard answers a drain's cancellation itself).
            context.status, context.details, response = grpc.StatusCode.CANCELLED, "server stopping", None
        try:
            code = context.status or grpc.StatusCode.OK
            body = response if code == grpc.StatusCode.OK and response is not None else b""
            if self._transport is not None:
                self._send(active, fmt.answer(_status_code(code), context.request_id.encode("ascii", "replace"),
                                              context.details.encode("utf-8", "replace"), body), channel.event)
        finally:
            context.done()

    async def stop(self) -> None:
        """Close every channel, then the ports once the answers sent have been read (after the
        drain: calls still here have answered or are cancelled now)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        self._table.clear()  # a call sent from here on is refused (its key unknown), then read
        if self._transport is not None:
            await self._until_answers_read()
            self._transport.close()
            self._transport = None

    async def _until_answers_read(self) -> None:
        """Wait, at most COLLECT_S, until every caller has let go of its answered request: closed
        ports take the answers not yet received with them (an answer sent as a drain ended was
        lost to a caller that had not run since)."""
        self._transport.clean_up_dead_nodes()
        unread = self._transport.unread()
        if not unread:
            return
        log_event(log, "answers unread at stop", unread=unread, wait_s=COLLECT_S)
        end = time.monotonic() + COLLECT_S
        while self._transport.unread() and time.monotonic() < end:
            await asyncio.sleep(0.002)
