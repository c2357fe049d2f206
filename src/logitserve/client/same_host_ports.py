"""The iceoryx2 ports of a same-host channel the server has opened for this client
(:mod:`.same_host`): made from OpenChannel's answer, or :class:`NoChannelHere` saying why they
cannot be (another channel format or iceoryx2 release, a server whose services this process
does not see, the service's places for callers all taken); a request written into them; and
:class:`ChannelError`, what a channel call raises.
"""

from __future__ import annotations

import ctypes
import importlib.metadata

import grpc

from logitserve.v1 import channel_format as fmt
from logitserve.v1 import channel_memory
from logitserve.v1 import logitserve_pb2 as pb

# Longest a waiting call sleeps before it looks again without being woken: bounds how late it
# learns of an answer whose notification it cannot get (a key the server no longer knows) or of
# a server that has gone.
WAIT_SLICE_S = 0.005
# First size of the request slots: larger requests may make iceoryx2 write a new, larger segment.
INITIAL_SLICE_BYTES = 4096


class ChannelError(grpc.RpcError):
    """A channel call's failure, with a gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


CODES = {code.value[0]: code for code in grpc.StatusCode}


class NoChannelHere(Exception):
    """An opened channel whose ports this process cannot make (why, in its text)."""


class Ports:
    """The iceoryx2 ports of one open channel; NoChannelHere where they cannot be made."""

    def __init__(self, opened: pb.OpenChannelResponse):
        if opened.format_version != fmt.FORMAT_VERSION:
            raise NoChannelHere(f"the server speaks channel format {opened.format_version}, this client "
                                f"{fmt.FORMAT_VERSION}")
        installed = importlib.metadata.version("iceoryx2")
        if installed != opened.iceoryx2_version:
            raise NoChannelHere(f"the server runs iceoryx2 {opened.iceoryx2_version}, this client {installed}")
        try:
            import iceoryx2 as iox2

            iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
            self.node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
            try:
                self._open(iox2, opened)
            except Exception:  # noqa: BLE001 - once more, after freeing the places of dead processes
                self.node.try_cleanup_dead_nodes()
                self._open(iox2, opened)
        except Exception as exc:  # noqa: BLE001 - iceoryx2's open and create errors
            raise NoChannelHere(f"its ports cannot be made here ({exc!r}): a server on another host or with "
                                "another /dev/shm and /tmp/iceoryx2, or its places for callers taken") from None
        self.slice_wait = iox2.Duration.from_secs_f64(WAIT_SLICE_S)
        self.key = opened.key
        self.max_request_bytes = opened.max_request_bytes
        # The server closes a channel idle for idle_timeout_s at its next sweep (a quarter of that
        # apart, at most a minute: server/api/channel/service.py); then these ports are let go of.
        self.release_after_s = opened.idle_timeout_s + min(opened.idle_timeout_s / 4, 60.0)

    def _open(self, iox2, opened: pb.OpenChannelResponse) -> None:
        byte_slice = iox2.Slice[ctypes.c_uint8]

        def service(name):
            return self.node.service_builder(iox2.ServiceName.new(name))

        self.calls = service(opened.service_name).request_response(byte_slice, byte_slice).open()
        self.client = (self.calls.client_builder().initial_max_slice_len(INITIAL_SLICE_BYTES)
                       .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo).create())
        self.wake_service = service(opened.server_event).event().open()
        self.wake = self.wake_service.notifier_builder().create()
        self.answered_service = service(opened.client_event).event().open()
        self.answered = self.answered_service.listener_builder().create()

    def send(self, head: bytes, request: bytes):
        """Write ``head`` and ``request`` into reserved pages of a loaned slice and send them: the
        pending answer. Raises channel_memory.NoRoom (nothing sent) where /dev/shm has no room."""
        size = len(head) + len(request)
        if size > INITIAL_SLICE_BYTES:  # a loan past the first slots may make iceoryx2 write a new segment
            channel_memory.check_room("channel: the request", size)
        try:
            out = self.client.loan_slice_uninit(size)
        except Exception as exc:  # noqa: BLE001 - iceoryx2's loan errors
            raise _slots_held(exc) from None
        at = out.payload().data_ptr
        try:
            channel_memory.reserve("channel: the request", at, size)
        except channel_memory.NoRoom:
            out.delete()
            raise
        ctypes.memmove(at, head, len(head))
        ctypes.memmove(at + len(head), request, len(request))
        try:
            return out.assume_init().send()
        except Exception as exc:  # noqa: BLE001 - iceoryx2's send errors
            raise _slots_held(exc) from None


def _slots_held(exc: Exception) -> ChannelError:
    return ChannelError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"channel: cannot send ({exc!r}): its slots are held by earlier calls whose deadlines "
                        f"passed before the server answered them; retry later")
