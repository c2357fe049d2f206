"""``Client(..., channel="shm")``: the operator calls through a same-host channel (shared memory,
iceoryx2) instead of gRPC; everything else (regions, sequences' opening, streams) stays on gRPC.

The channel is opened through gRPC's OpenChannel at the first call (with the client's token, so
its calls run as the client's, with its regions), and opened again when the server says it no
longer knows it (idle past its timeout, or a restarted server). A call sends its request, exactly
the bytes gRPC would carry, behind the header of logitserve.v1.channel_format, wakes the server,
then waits for the answer: it polls for ``poll_us``, then sleeps on the channel's event. A
request over the channel's limit goes by gRPC. One call at a time crosses a channel: calls from
several threads (or an AsyncClient's tasks) queue for it; open one client per thread for more.

Errors are raised as :class:`ChannelError`, a ``grpc.RpcError`` with the server's status code and
message, so the client retries and reports them as it does gRPC's.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from dataclasses import dataclass

import grpc

from logitserve.v1 import channel_format as fmt
from logitserve.v1 import logitserve_pb2 as pb

from .transport import time_left

# Longest a waiting call sleeps before it looks again without being woken: bounds how late it
# learns of an answer whose notification it cannot get (a key the server no longer knows) or of
# a server that has gone.
WAIT_SLICE_S = 0.005
# How often a call waiting for its answer asks iceoryx2 to clean up the ports of dead processes
# (a few ms each): bounds how late it learns that its server was killed.
DEAD_SERVER_CHECK_S = 0.25


@dataclass(frozen=True)
class SameHost:
    """A same-host channel; ``poll_us``: how long a call polls for its answer before sleeping."""

    poll_us: int = 200


class ChannelError(grpc.RpcError):
    """A channel call's failure, with a gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def options(channel) -> SameHost | None:
    """The channel a client was asked for: None for gRPC, else its :class:`SameHost` options."""
    if channel == "grpc":
        return None
    if channel == "shm":
        return SameHost()
    if isinstance(channel, SameHost):
        return channel
    raise ValueError(f"channel: must be 'grpc', 'shm' or a SameHost(...), got {channel!r}")


class _Ports:
    """The iceoryx2 ports of one open channel."""

    def __init__(self, opened: pb.OpenChannelResponse):
        try:
            import importlib.metadata

            import iceoryx2 as iox2
        except ImportError as exc:
            raise ChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"channel='shm' needs iceoryx2 ({exc}): pip install 'logitserve[channel]'") from None
        installed = importlib.metadata.version("iceoryx2")
        if installed != opened.iceoryx2_version:
            raise ChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"channel: the server runs iceoryx2 {opened.iceoryx2_version}, this client "
                               f"{installed}; install iceoryx2=={opened.iceoryx2_version}")
        if opened.format_version != fmt.FORMAT_VERSION:
            raise ChannelError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"channel: the server speaks format {opened.format_version}, this client "
                               f"{fmt.FORMAT_VERSION}")
        iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
        byte_slice = iox2.Slice[ctypes.c_uint8]
        self.node = node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)

        def service(name):
            return node.service_builder(iox2.ServiceName.new(name))

        self.calls = service(opened.service_name).request_response(byte_slice, byte_slice).open()
        self.client = (self.calls.client_builder().initial_max_slice_len(4096)
                       .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo).create())
        self.wake_service = service(opened.server_event).event().open()
        self.wake = self.wake_service.notifier_builder().create()
        self.answered_service = service(opened.client_event).event().open()
        self.answered = self.answered_service.listener_builder().create()
        self.slice_wait = iox2.Duration.from_secs_f64(WAIT_SLICE_S)
        self.key = opened.key
        self.max_request_bytes = opened.max_request_bytes


class SameHostChannel:
    """One channel to one server: its ports while open (OpenChannel's answer, taken through gRPC
    by :func:`bind`'s methods), one call at a time through them."""

    def __init__(self, settings: SameHost):
        self._poll_s = settings.poll_us * 1e-6
        self._ports: _Ports | None = None
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # one OpenChannel at a time: threads share the one channel
        self.opens = 0  # channels opened so far (a new one after the server forgot the last)

    def ports(self, open_channel) -> _Ports:
        """The open channel's ports; ``open_channel()`` (OpenChannel's answer, bytes) first
        where none is open."""
        with self._opening:
            if self._ports is None:
                self.install(open_channel())
            return self._ports

    def install(self, opened: bytes) -> _Ports:
        """OpenChannel's answer, kept unless a channel is open already (another task opened one)."""
        if self._ports is None:
            self._ports = _Ports(pb.OpenChannelResponse.FromString(opened))
            self.opens += 1
        return self._ports

    def _forget(self, ports: _Ports) -> None:
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
    def fits(ports: _Ports, request: bytes) -> bool:
        """Whether the server takes ``request`` by the channel: max_request_bytes leaves room for
        a request id, which this client does not send."""
        return fmt.REQUEST_HEADER.size + fmt.MAX_REQUEST_ID + len(request) <= ports.max_request_bytes

    def call(self, ports: _Ports, method: str, request: bytes, timeout: float | None) -> bytes:
        """The answer's response message to ``request``, sent through ``ports``; raises
        :class:`ChannelError`."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        head = fmt.REQUEST_HEADER.pack(ports.key, fmt.METHOD_NUMBERS[method], 0,
                                       0 if timeout is None else max(1, int(timeout * 1e6)))
        with self._lock:
            try:
                out = ports.client.loan_slice_uninit(len(head) + len(request))
                at = out.payload().data_ptr
                ctypes.memmove(at, head, len(head))
                ctypes.memmove(at + len(head), request, len(request))
                pending = out.assume_init().send()
            except Exception as exc:  # noqa: BLE001 - iceoryx2's loan and send errors
                raise ChannelError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"channel: cannot send ({exc!r}): its slots are held by earlier calls whose "
                                   f"deadlines passed before the server answered them; retry later") from None
            ports.wake.notify()
            try:
                answer = self._wait(ports, pending, deadline)
            finally:
                pending.delete()
        code, _request_id, details, message = fmt.read_answer(answer)
        if code != 0:
            if details.startswith(fmt.UNKNOWN_KEY):
                self._forget(ports)  # the caller opens a new one and sends the call again
            raise ChannelError(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)
        return message

    def _wait(self, ports: _Ports, pending, deadline: float | None) -> bytes:
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
        self._ports = None


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

    opening = None  # the AsyncClient's lock around OpenChannel (made on its loop)

    def blocking(name):
        def method(request, timeout=None, metadata=()):
            deadline = _deadline(timeout)
            for resend in (False, True):
                ports = same_host.ports(lambda: grpc_methods["OpenChannel"](
                    open_request, timeout=time_left(deadline), metadata=metadata))
                if not same_host.fits(ports, request):
                    return grpc_methods[name](request, timeout=time_left(deadline), metadata=metadata)
                try:
                    return same_host.call(ports, name, request, time_left(deadline))
                except ChannelError as exc:
                    if resend or not exc.details().startswith(fmt.UNKNOWN_KEY):
                        raise
                    # The server refused it unread (its channel closed): sent again on a new one.
        return method

    def awaitable(name):
        async def method(request, timeout=None, metadata=()):
            nonlocal opening
            deadline = _deadline(timeout)
            for resend in (False, True):
                opening = opening or asyncio.Lock()
                async with opening:
                    ports = same_host._ports or same_host.install(await grpc_methods["OpenChannel"](
                        open_request, timeout=time_left(deadline), metadata=metadata))
                if not same_host.fits(ports, request):
                    return await grpc_methods[name](request, timeout=time_left(deadline), metadata=metadata)
                try:
                    return await asyncio.to_thread(same_host.call, ports, name, request, time_left(deadline))
                except ChannelError as exc:
                    if resend or not exc.details().startswith(fmt.UNKNOWN_KEY):
                        raise
        return method

    make = awaitable if is_async else blocking
    return same_host, {name: make(name) for name in fmt.METHOD_NUMBERS}


def closing_calls(same_host: SameHostChannel | None, unregister_requests):
    """The best-effort calls a closing client makes, as ``(rpc, request bytes)``: CloseChannel
    for its open channel (whose ports it then drops), then ``unregister_requests``'."""
    if same_host is not None and same_host.key is not None:
        yield "CloseChannel", pb.CloseChannelRequest(key=same_host.key).SerializeToString()
        same_host.close()
    for request in unregister_requests:
        yield "UnregisterSharedMemory", request
