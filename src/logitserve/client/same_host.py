"""``Client(..., channel="shm")``: the operator calls through a same-host channel (shared memory,
iceoryx2) instead of gRPC; everything else (regions, sequences' opening, streams) stays on gRPC.

The channel is opened through gRPC's OpenChannel at the first call (with the client's token, so
its calls run as the client's, with its regions), and opened again when the server says it no
longer knows it (idle past its timeout, or a restarted server). A call sends its request, exactly
the bytes gRPC would carry, behind the header of logitserve.v1.channel_format, wakes the server,
then waits for the answer: it polls for ``poll_us``, then sleeps on the channel's event. A
request over the channel's limit goes by gRPC. One call at a time crosses a channel: calls from
several threads (or an AsyncClient's tasks) queue for it; open one client per thread for more.

The channel is an optimisation: a client that cannot have one (the server has channels off, has
all it may open, or has given this token its share; the server is on another host; its
``/dev/shm`` is short) calls over gRPC, says so once in its log (logger ``logitserve.client``)
and asks again every ``reopen_after_s`` (:class:`SameHost`, 30 s). A request ``/dev/shm`` has
no room for goes by gRPC (its pages are reserved before it is written:
logitserve.v1.channel_memory). A channel idle past the server's sweep lets go of its ports (its
iceoryx2 node and port take one of the service's places for callers, which a live idle client
would otherwise keep).

Errors are raised as :class:`ChannelError`, a ``grpc.RpcError`` with the server's status code and
message, so the client retries and reports them as it does gRPC's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import threading
import time
from dataclasses import dataclass

import grpc

from logitserve.v1 import channel_format as fmt
from logitserve.v1 import channel_memory
from logitserve.v1 import logitserve_pb2 as pb

from .same_host_ports import CODES, ChannelError, NoChannelHere, Ports
from .transport import time_left

# How often a call waiting for its answer asks iceoryx2 to clean up the ports of dead processes
# (a few ms each): bounds how late it learns that its server was killed.
DEAD_SERVER_CHECK_S = 0.25
# OpenChannel's refusals that mean "no channel for you now": channels off or not built in
# (FAILED_PRECONDITION), a server without them (UNIMPLEMENTED), all taken, the token's share
# taken, no room in /dev/shm (RESOURCE_EXHAUSTED). Any other error is the call's.
NO_CHANNEL_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED)

log = logging.getLogger("logitserve.client")


@dataclass(frozen=True)
class SameHost:
    """A same-host channel; ``poll_us``: how long a call polls for its answer before sleeping;
    ``reopen_after_s``: how long a client that could not have a channel calls over gRPC before
    it asks for one again."""

    poll_us: int = 200
    reopen_after_s: float = 30.0

    def __post_init__(self):
        value = self.reopen_after_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"SameHost.reopen_after_s: must be a finite number of seconds >= 0, got {value!r}")


def options(channel) -> SameHost | None:
    """The channel a client was asked for: None for gRPC, else its :class:`SameHost` options."""
    if channel == "grpc":
        return None
    if channel == "shm":
        return SameHost()
    if isinstance(channel, SameHost):
        return channel
    raise ValueError(f"channel: must be 'grpc', 'shm' or a SameHost(...), got {channel!r}")


class SameHostChannel:
    """One channel to one server: its ports while open (OpenChannel's answer, taken through gRPC
    by :func:`bind`'s methods), one call at a time through them."""

    def __init__(self, settings: SameHost):
        self._poll_s = settings.poll_us * 1e-6
        self._reopen_after_s = settings.reopen_after_s
        self._ports: Ports | None = None
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # one OpenChannel at a time: threads share the one channel
        self.opens = 0  # channels opened so far (a new one after the server forgot the last)
        self._ask_again_at = 0.0  # no OpenChannel before this (time.monotonic): none could be had
        self._said: set[str] = set()  # what has been logged, once each
        self._last_used = 0.0
        self._idle_timer: threading.Timer | None = None

    def ports(self, open_channel, close_channel) -> Ports | None:
        """The open channel's ports; where none is open, OpenChannel's answer first
        (``open_channel()``: its bytes, or grpc.RpcError); None where no channel can be had
        (``close_channel(key)`` closes one the server opened whose ports cannot be made here)."""
        with self._opening:
            if self.may_open():
                try:
                    opened = open_channel()
                except grpc.RpcError as exc:
                    self.refused(exc)
                else:
                    unusable = self.take(opened)
                    if unusable is not None:
                        close_channel(unusable)
            return self._ports

    def may_open(self) -> bool:
        """Whether to ask for a channel now: none is open, and none was refused lately."""
        return self._ports is None and time.monotonic() >= self._ask_again_at

    def take(self, opened: bytes) -> bytes | None:
        """Make the ports of OpenChannel's answer ``opened``; where they cannot be made here, the
        client calls by gRPC, and the channel's key is returned for the caller to close."""
        response = pb.OpenChannelResponse.FromString(opened)
        try:
            ports = Ports(response)
        except NoChannelHere as exc:
            self._go_without(f"the server's channel is of no use here: {exc}")
            return response.key
        self._ports = ports
        self.opens += 1
        self._last_used = time.monotonic()
        self._release_when_idle(ports.release_after_s)
        return None

    def refused(self, exc: grpc.RpcError) -> None:
        """OpenChannel failed with ``exc``: raised again, unless it says no channel can be had."""
        if exc.code() not in NO_CHANNEL_CODES:
            raise exc
        self._go_without(f"OpenChannel: {exc.code().name}: {exc.details()}")

    def _go_without(self, reason: str) -> None:
        self._ask_again_at = time.monotonic() + self._reopen_after_s
        self.say_once("no channel", f"channel='shm': no same-host channel, calling over gRPC ({reason}); asking "
                                    f"again every {self._reopen_after_s:g} s")

    def say_once(self, what: str, message: str) -> None:
        """Log ``message`` (a warning) the first time ``what`` happens to this client."""
        if what not in self._said:
            self._said.add(what)
            log.warning(message)

    def _release_when_idle(self, after_s: float) -> None:
        """(Re)arm the idle timer: one per client, whatever its channels before."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        timer = threading.Timer(after_s, self._release_if_idle)
        timer.daemon = True
        self._idle_timer = timer
        timer.start()

    def _release_if_idle(self) -> None:
        """The idle timer: let go of the ports once the server has closed their channel (past its
        idle time and sweep), or look again when a call came meanwhile."""
        with self._opening, self._lock:
            ports = self._ports
            if ports is None:
                return
            left = self._last_used + ports.release_after_s - time.monotonic()
            if left > 0:
                self._release_when_idle(left)
            else:
                self._ports = None

    def _forget(self, ports: Ports) -> None:
        """Drop ``ports`` (the server forgot their channel, or has gone), unless another call
        has opened a new channel since."""
        if self._ports is ports:
            self._ports = None

    @property
    def is_open(self) -> bool:
        return self._ports is not None

    @property
    def key(self) -> bytes | None:
        return None if self._ports is None else self._ports.key

    @staticmethod
    def fits(ports: Ports, request: bytes) -> bool:
        """Whether the server takes ``request`` by the channel: max_request_bytes leaves room for
        a request id, which this client does not send."""
        return fmt.REQUEST_HEADER.size + fmt.MAX_REQUEST_ID + len(request) <= ports.max_request_bytes

    def call(self, ports: Ports, method: str, request: bytes, timeout: float | None) -> bytes:
        """The answer's response message to ``request``, sent through ``ports``; raises
        :class:`ChannelError`, or channel_memory.NoRoom (nothing sent) where ``/dev/shm`` has no
        room for the request."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        head = fmt.REQUEST_HEADER.pack(ports.key, fmt.METHOD_NUMBERS[method], 0,
                                       0 if timeout is None else max(1, int(timeout * 1e6)))
        with self._lock:
            try:
                pending = ports.send(head, request)
                ports.wake.notify()
                try:
                    answer = self._wait(ports, pending, deadline)
                finally:
                    pending.delete()
            except (ChannelError, channel_memory.NoRoom):
                raise
            except Exception as exc:  # noqa: BLE001 - iceoryx2's own: this channel is of no more use
                self._forget(ports)
                raise ChannelError(grpc.StatusCode.UNAVAILABLE, f"channel: {exc!r}; open a new one") from None
            finally:
                self._last_used = time.monotonic()
        code, _request_id, details, message = fmt.read_answer(answer)
        if code != 0:
            if details.startswith(fmt.UNKNOWN_KEY):
                self._forget(ports)  # the caller opens a new one and sends the call again
            raise ChannelError(CODES.get(code, grpc.StatusCode.UNKNOWN), details)
        return message

    def _wait(self, ports: Ports, pending, deadline: float | None) -> bytes:
        poll_until = time.perf_counter() + self._poll_s
        look_for_dead_at = poll_until + DEAD_SERVER_CHECK_S
        while True:
            # Read before receiving: a server that answers and lets go of the request between
            # the two would otherwise look gone with its answer waiting.
            connected = pending.is_connected
            response = pending.receive()
            if response is not None:
                payload = response.payload()
                answer = ctypes.string_at(payload.data_ptr, payload.number_of_elements)
                response.delete()
                return answer
            now = time.perf_counter()
            if now < poll_until:
                continue
            if deadline is not None and now >= deadline:
                # gRPC's own words for a deadline its client saw pass, so both transports read alike.
                raise ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if now >= look_for_dead_at:
                # A killed server never lets go of its ports: iceoryx2 removes a dead process's
                # ports when asked, which disconnects this call (read as the server gone).
                ports.node.try_cleanup_dead_nodes()
                look_for_dead_at = now + DEAD_SERVER_CHECK_S
            if not connected:
                self._forget(ports)
                raise ChannelError(grpc.StatusCode.UNAVAILABLE, "channel: the server has gone (stopped or restarted)")
            ports.answered.timed_wait(ports.slice_wait)

    def close(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._ports = None


def _close_request(key: bytes) -> bytes:
    return pb.CloseChannelRequest(key=key).SerializeToString()


def _quietly(call, rpc: str, message: bytes) -> None:
    """A best-effort call (CloseChannel: the server closes the channel when idle otherwise)."""
    with contextlib.suppress(grpc.RpcError):
        call(rpc, message)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def bind(channel, grpc_methods: dict, is_async: bool) -> tuple[SameHostChannel | None, dict]:
    """For a client asked for ``channel`` ("grpc", "shm" or a :class:`SameHost`): the same-host
    channel (None for gRPC) and the method callables of the calls it carries, to use in place of
    ``grpc_methods``' (each ``method(request, timeout=, metadata=)`` like a gRPC multicallable,
    awaitable when ``is_async``)."""
    settings = options(channel)
    if settings is None:
        return None, {}
    same_host = SameHostChannel(settings)
    grpc_methods = dict(grpc_methods)  # gRPC's own: the caller puts the carried methods in its dict
    open_request = pb.OpenChannelRequest().SerializeToString()

    def no_room(exc: channel_memory.NoRoom) -> None:
        same_host.say_once("no room", f"channel='shm': {exc}; such calls go over gRPC")

    opening = None  # the AsyncClient's lock around OpenChannel (made on its loop)

    def blocking(name):
        def method(request, timeout=None, metadata=()):
            deadline = _deadline(timeout)

            def by_grpc(rpc, message):
                return grpc_methods[rpc](message, timeout=time_left(deadline), metadata=metadata)
            for resend in (False, True):
                ports = same_host.ports(lambda: by_grpc("OpenChannel", open_request),
                                        lambda key: _quietly(by_grpc, "CloseChannel", _close_request(key)))
                if ports is None or not same_host.fits(ports, request):
                    return by_grpc(name, request)
                try:
                    return same_host.call(ports, name, request, time_left(deadline))
                except channel_memory.NoRoom as exc:
                    no_room(exc)
                    return by_grpc(name, request)
                except ChannelError as exc:
                    if resend or not exc.details().startswith(fmt.UNKNOWN_KEY):
                        raise
                    # The server refused it unread (its channel closed): sent again on a new one.
        return method

    def awaitable(name):
        async def ports_for(deadline, metadata) -> Ports | None:
            nonlocal opening
            opening = opening or asyncio.Lock()
            async with opening:
                if same_host.may_open():
                    try:
                        opened = await grpc_methods["OpenChannel"](open_request, timeout=time_left(deadline),
                                                                   metadata=metadata)
                    except grpc.RpcError as exc:
                        same_host.refused(exc)
                    else:
                        unusable = same_host.take(opened)
                        if unusable is not None:
                            with contextlib.suppress(grpc.RpcError):  # best effort: closed when idle otherwise
                                await grpc_methods["CloseChannel"](_close_request(unusable),
                                                                   timeout=time_left(deadline), metadata=metadata)
                return same_host._ports

        async def method(request, timeout=None, metadata=()):
            deadline = _deadline(timeout)
            for resend in (False, True):
                ports = await ports_for(deadline, metadata)
                if ports is None or not same_host.fits(ports, request):
                    return await grpc_methods[name](request, timeout=time_left(deadline), metadata=metadata)
                try:
                    return await asyncio.to_thread(same_host.call, ports, name, request, time_left(deadline))
                except channel_memory.NoRoom as exc:
                    no_room(exc)
                    return await grpc_methods[name](request, timeout=time_left(deadline), metadata=metadata)
                except ChannelError as exc:
                    if resend or not exc.details().startswith(fmt.UNKNOWN_KEY):
                        raise
        return method

    make = awaitable if is_async else blocking
    return same_host, {name: make(name) for name in fmt.METHOD_NUMBERS}


def closing_calls(same_host: SameHostChannel | None, unregister_requests):
    """The best-effort calls a closing client makes, as ``(rpc, request bytes)``: CloseChannel
    for its open channel (whose ports it then drops), then ``unregister_requests``'."""
    if same_host is not None:
        if same_host.key is not None:
            yield "CloseChannel", _close_request(same_host.key)
        same_host.close()
    for request in unregister_requests:
        yield "UnregisterSharedMemory", request
