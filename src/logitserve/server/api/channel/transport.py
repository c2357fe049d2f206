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
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import threading

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
        when known). Each part is copied once, into the answer's shared memory."""
        try:
            out = active.loan_slice_uninit(sum(len(part) for part in parts))
            at = out.payload().data_ptr
            for part in parts:
                ctypes.memmove(at, part, len(part))
                at += len(part)
            out.assume_init().send()
        except Exception as exc:  # noqa: BLE001 - the caller is gone (or its slots full): the answer is dropped
            log_event(log, "answer dropped", level=logging.DEBUG, error=repr(exc))
        finally:
            active.delete()
        if event is not None:
            event.notify()
        if not (self._closing or self._drain_scheduled) and self._server.has_requests:
            # A request left unread while its caller was at its limit (see _drain): read it now,
            # as no caller will wake the server for it.
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def close(self) -> None:
        """Stop the wake thread and drop the ports: callers see the server gone."""
        self._closing = True
        if self.wake_fd is not None and self._loop is not None:
            self._loop.remove_reader(self.wake_fd)
        self._stopper.notify()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._server = self._calls = self._listener = self._stopper = self._wake = None
