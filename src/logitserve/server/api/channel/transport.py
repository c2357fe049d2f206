"""iceoryx2 under the channels: the shared memory calls and answers cross, and the events that
wake each side.

Per server process: one request-response service (``<prefix>/calls``, payloads slices of bytes)
whose one server port takes every channel's requests, and one event service (``<prefix>/wake``)
that callers notify after sending. Per channel: an event service the server notifies after
answering it. iceoryx2's request-response has no blocking receive, hence the events.

The event loop watches the wake event's socket as it watches gRPC's, and a busy-polling loop
(server/engine/busy_poll.py) also polls the server port: a call reaches the loop with no thread between.
Where the socket cannot be found, a thread sleeps on the event instead (iceoryx2's blocking wait
lets go of the GIL) and hands the loop each drain; on an H200 host that hand-over cost a
RouteExperts 1x8 call 428-553 us p50 against 264-382 us watched by the loop (two runs, 2026-11-27).
Receiving, answering and notifying run on the loop alone, so each port is used by one thread. A
caller that went away mid-call leaves a request whose answer cannot be delivered: the answer is
dropped, nothing else changes.

An answer is written only into pages reserved for it (logitserve.v1.channel_memory): one that
``/dev/shm`` has no room for raises NoRoom, for the service to refuse the call, where its write
was a SIGBUS that ended the server. An answered request is kept until its caller lets go of it
(has read the answer, given up, or died): iceoryx2 drops the answers a server port has sent but
its callers not yet received when the port goes, so a stopping server keeps its ports until its
answers are read (:meth:`Iceoryx2Transport.unread`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import threading

from logitserve.v1 import channel_memory

from ...logs import get_logger, log_event

log = get_logger("channel")

# The iceoryx2 release this server is built against; OpenChannel tells callers, whose release must
# be the same (the shared-memory layout is not stable across releases).
ICEORYX2_VERSION = "0.10.0"
# Calls one channel may have in flight: one, and one whose caller stopped waiting (its deadline
# passed) that the server has not answered yet. iceoryx2 sizes each connection's shared memory by
# it and by the callers there may be (2 x --max-channels): about 1.6 MB a channel at 32 channels,
# growing with --max-channels (docs/SERVICE.md).
MAX_CALLS_PER_CHANNEL = 2
# First size of a port's message slots; they grow by powers of two up to the channel's limit.
INITIAL_SLICE_BYTES = 4096
# The /dev/shm one channel takes, which iceoryx2 writes (unreserved) when its caller makes its ports:
# 48 KiB per --max-channels (the caller's connection, sized for every caller the service may
# have) and 80 KiB more. Measured with iceoryx2 0.10.0: 278,528 bytes at --max-channels 4,
# 475,136 at 8, 1,650,688 at 32, 6,352,896 at 128.
CHANNEL_BYTES_PER_MAX_CHANNEL = 48 << 10
CHANNEL_BYTES_BASE = 80 << 10


def channel_bytes(max_channels: int) -> int:
    """The /dev/shm a channel of a server with ``max_channels`` takes (an upper bound)."""
    return CHANNEL_BYTES_PER_MAX_CHANNEL * max_channels + CHANNEL_BYTES_BASE


def available() -> str | None:
    """None where iceoryx2 (of :data:`ICEORYX2_VERSION`) can be imported, else why not."""
    try:
        import importlib.metadata

        import iceoryx2  # noqa: F401
    except ImportError as exc:
        return f"iceoryx2 is not installed ({exc}): pip install 'iceoryx2=={ICEORYX2_VERSION}'"
    version = importlib.metadata.version("iceoryx2")
    if version != ICEORYX2_VERSION:
        return f"iceoryx2 {version} is installed, this server needs {ICEORYX2_VERSION}"
    return None


def _sockets() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:
            continue
    return found


def _listener_and_fd(event_service):
    """A listener of ``event_service`` and the socket it waits on, for the event loop to watch
    (None where not found: the wake thread waits instead). iceoryx2's listener waits on a Unix
    datagram socket, which its Rust API hands to reactors (FileDescriptorBased, as its WaitSet
    uses it) and its Python binding does not: it is found as the one socket the creation opened."""
    before = _sockets()
    listener = event_service.listener_builder().create()
    opened = _sockets() - before
    return listener, (opened.pop() if len(opened) == 1 else None)


class ChannelEvent:
    """A channel's wake-up event: its service (kept open while the channel is) and notifier."""

    def __init__(self, service, notifier):
        self._service, self._notifier = service, notifier

    def notify(self) -> None:
        self._notifier.notify()


class Iceoryx2Transport:
    """The server's ports. ``on_request(active_request, address, size)`` runs on the loop for
    every request received, with where its bytes lie (valid until the request is answered)."""

    def __init__(self, max_channels: int):
        import iceoryx2 as iox2

        self._iox2 = iox2
        # Every process would warn that it runs on iceoryx2's default config (it has no file).
        iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
        self._node = iox2.NodeBuilder.new().name(iox2.NodeName.new("logitserve-server")).create(iox2.ServiceType.Ipc)
        self._node.try_cleanup_dead_nodes()  # files a killed process left behind
        # Unique per process and start, so a restarted server never meets its predecessor's services.
        self.prefix = f"logitserve/{os.getpid()}-{secrets.token_hex(6)}"
        self.service_name = f"{self.prefix}/calls"
        self.wake_name = f"{self.prefix}/wake"
        byte_slice = iox2.Slice[ctypes.c_uint8]
        calls = (self._node.service_builder(iox2.ServiceName.new(self.service_name))
                 .request_response(byte_slice, byte_slice)
                 # Room for the callers of every channel, and as many again whose process died
                 # and whose ports iceoryx2 has not cleaned up yet.
                 .max_clients(2 * max_channels).max_nodes(2 * max_channels + 1).max_servers(1)
                 .max_active_requests_per_client(MAX_CALLS_PER_CHANNEL)
                 .max_response_buffer_size(1).max_borrowed_responses_per_pending_response(1).create())
        self._server = (calls.server_builder().initial_max_slice_len(INITIAL_SLICE_BYTES)
                        .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo).create())
        self._calls = calls
        wake = (self._node.service_builder(iox2.ServiceName.new(self.wake_name)).event()
                .max_notifiers(2 * max_channels + 1).max_nodes(2 * max_channels + 1).max_listeners(1).create())
        self._wake = wake
        self._listener, self.wake_fd = _listener_and_fd(wake)
        self._stopper = wake.notifier_builder().create()
        self._loop = None
        self._on_request = None
        self._drain_scheduled = False
        self._closing = False
        self._thread: threading.Thread | None = None
        self._answered = []  # answered requests whose callers may not have read the answer yet

    def event(self, number: int) -> tuple[str, ChannelEvent]:
        """A new channel's wake-up event: ``(service name, event)``."""
        iox2 = self._iox2
        name = f"{self.prefix}/answered/{number}"
        service = self._node.service_builder(iox2.ServiceName.new(name)).event().create()
        return name, ChannelEvent(service, service.notifier_builder().create())

    def start(self, loop, on_request) -> None:
        self._loop, self._on_request = loop, on_request
        if self.wake_fd is not None:
            loop.add_reader(self.wake_fd, self._woken)
            return
        self._thread = threading.Thread(target=self._wait, name="logitserve-channel-wake", daemon=True)
        self._thread.start()

    def _woken(self) -> None:
        """The wake event's socket is readable (on the loop): take its notifications, drain."""
        self._listener.try_wait()
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._drain()

    def poll(self) -> bool:
        """Whether a request waits (then a drain is scheduled on the loop, which calls this): a
        busy-polling loop (server/engine/busy_poll.py) finds requests without the wake thread."""
        if self._closing or self._drain_scheduled or not self._server.has_requests:
            return False
        self._drain_scheduled = True
        self._loop.call_soon(self._drain)
        return True

    def _wait(self) -> None:
        """The wake thread: sleeps until a caller notifies, then has the loop drain the port (one
        drain scheduled at a time: notifications that come meanwhile are served by it)."""
        while not self._closing:
            try:
                self._listener.blocking_wait()
            except Exception as exc:  # noqa: BLE001 - a signal, or iceoryx2 failing: logged, the loop goes on
                log_event(log, "wake wait failed", error=repr(exc))
                continue
            if self._closing:
                return
            if not self._drain_scheduled:
                self._drain_scheduled = True
                self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False  # before receiving: a request sent from here on schedules another
        if self._closing:
            return
        self._let_go_of_read()  # before receiving: iceoryx2 counts them in a caller's requests in flight
        while True:
            try:
                active = self._server.receive()
            except Exception as exc:  # noqa: BLE001 - ExceedsMaxBorrows: a caller's calls in flight are
                # at MAX_CALLS_PER_CHANNEL (one whose caller gave up still runs); taken once one is answered
                log_event(log, "receive deferred", level=logging.DEBUG, error=repr(exc))
                return
            if active is None:
                return
            payload = active.payload()
            self._on_request(active, payload.data_ptr, payload.number_of_elements)

    def answer(self, active, parts: tuple[bytes, ...], event: ChannelEvent | None) -> None:
        """Send ``parts``, joined, as the answer to ``active`` and wake its caller (``event``,
        when known). Each part is copied once, into the answer's shared memory, reserved first.
        Raises channel_memory.NoRoom, with nothing sent and ``active`` still to answer, where
        ``/dev/shm`` has no room for the answer."""
        size = sum(len(part) for part in parts)
        if size > INITIAL_SLICE_BYTES:  # a loan past the first slots may make iceoryx2 write a new segment
            channel_memory.check_room("channel: the answer", size)
        try:
            out = active.loan_slice_uninit(size)
        except Exception as exc:  # noqa: BLE001 - the caller is gone (or its slots full): the answer is dropped
            return self.drop(active, exc, event)
        at = out.payload().data_ptr
        try:
            channel_memory.reserve("channel: the answer", at, size)
        except channel_memory.NoRoom:
            out.delete()
            raise
        for part in parts:
            ctypes.memmove(at, part, len(part))
            at += len(part)
        try:
            out.assume_init().send()
        except Exception as exc:  # noqa: BLE001 - the caller is gone meanwhile
            return self.drop(active, exc, event)
        self._answered.append(active)
        self._after_answer(event)

    def drop(self, active, reason, event: ChannelEvent | None) -> None:
        """Let go of ``active`` unanswered (its caller is gone, or no answer fits): the caller
        sees the request let go of."""
        log_event(log, "answer dropped", level=logging.DEBUG, error=repr(reason))
        active.delete()
        self._after_answer(event)

    def _after_answer(self, event: ChannelEvent | None) -> None:
        if event is not None:
            event.notify()
        if not (self._closing or self._drain_scheduled) and self._server.has_requests:
            # A request left unread while its caller was at its limit (see _drain): read it now,
            # as no caller will wake the server for it.
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _let_go_of_read(self) -> None:
        """Let go of the answered requests whose callers have let go of theirs."""
        unread = []
        for active in self._answered:
            if active.is_connected:
                unread.append(active)
            else:
                active.delete()
        self._answered = unread

    def unread(self) -> int:
        """Answers sent whose callers have not let go of their requests yet (read them, given up
        or died: a dead caller's only once its node is cleaned up, :meth:`clean_up_dead_nodes`)."""
        self._let_go_of_read()
        return len(self._answered)

    def clean_up_dead_nodes(self) -> None:
        """Remove the ports of processes that died (iceoryx2 does it when asked): their places in
        the service are free again and their requests let go of."""
        self._node.try_cleanup_dead_nodes()

    def close(self) -> None:
        """Stop the wake thread and drop the ports: callers see the server gone."""
        self._closing = True
        if self.wake_fd is not None and self._loop is not None:
            self._loop.remove_reader(self.wake_fd)
        self._stopper.notify()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for active in self._answered:
            active.delete()
        self._answered = []
        self._server = self._calls = self._listener = self._stopper = self._wake = None
