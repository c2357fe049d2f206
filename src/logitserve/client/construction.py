"""What ``Client`` and ``AsyncClient`` are made of: their arguments, checked before anything
opens; the channel, with the options composed for it; and the steps every call goes through,
up to the one each class writes for itself (``_call``: blocking, or a coroutine).

Every method builds its request and hands it, as bytes, to ``_call``: the channel's methods have
no serializers of their own (:mod:`.wire` serializes with each tensor's bytes copied once). Who
retries what is :mod:`.retrying`'; :meth:`ClientBase._plan` says it for one call.
"""

from __future__ import annotations

import collections
import time

import grpc

from logitserve.v1 import channel_format as fmt
from logitserve.v1 import logitserve_pb2 as pb

from . import arguments, balancing, messages, results, retrying, same_host, wire
from .region_methods import RegionMethods
from .region_names import NEW_SCOPE, Scope
from .region_table import Registrations, RegionTable
from .sequences import SequenceMethods
from .transport import CLIENT_TIMEOUT, METHOD_PATHS, open_channel, parse_as, synchronize

# How long close() gives its calls (the same-host channel's closing, unregistering the client's
# regions), in all.
CLOSE_TIMEOUT_S = 5.0


def server_gone(exc: Exception) -> bool:
    """Whether a call of close() failed because the server is gone or draining (UNAVAILABLE once
    gRPC's retries ran out): its regions go with it, so close() skips its other calls."""
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class ClientBase(RegionMethods, SequenceMethods):
    """The construction and the call path both clients share; ``_grpc`` is the module of the
    client's channel (``grpc`` or ``grpc.aio``)."""

    _grpc = grpc

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, wait_for_ready: bool = False,
                 root_certificates=None, certificate_chain=None, private_key=None, token: str | None = None,
                 options=(), unregister_on_close: bool = True, region_scope=NEW_SCOPE,
                 load_balancing: str = "pick_first", channel="grpc"):
        """A client of ``target``; the arguments are described in :class:`~.client.Client`'s docstring."""
        self.target = target
        self.load_balancing = balancing.policy(load_balancing)
        self.timeout = timeout
        self.retries = retrying.checked(retries)
        self.wait_for_ready = arguments.wait_for_ready(wait_for_ready)
        self.unregister_on_close = unregister_on_close
        self._token = token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._regions = RegionTable(Scope(region_scope))
        self._recycler = wire.Recycler()
        self._bind(channel, root_certificates=root_certificates, certificate_chain=certificate_chain,
                   private_key=private_key, options=options)

    def _bind(self, channel, *, options, **tls) -> None:
        """The channel and its raw-bytes methods, one per RPC; with a same-host ``channel``
        (refused here when this Python cannot run it), the calls it carries through it
        (:mod:`.same_host`)."""
        settings = arguments.channel(channel)
        # The service config comes before the channel, and same_host.bind after it: what a channel
        # carries is the channel format's list of methods, which bind carries.
        self._retried_by_hand = retrying.retried_by_hand(fmt.METHOD_NUMBERS if settings is not None else ())
        given = dict(options)
        composed = {retrying.RETRY_BUFFER_OPTION: retrying.RETRY_BUFFER_BYTES, **given}
        composed["grpc.service_config"] = retrying.with_retry_policy(
            balancing.service_config(self.load_balancing, given), self.retries, self._retried_by_hand)
        self._channel = open_channel(self._grpc, self.target, composed, **tls)
        self._methods = {rpc: (self._channel.stream_stream(path) if streaming else self._channel.unary_unary(path))
                         for rpc, (path, streaming) in METHOD_PATHS.items()}
        self._same_host, carried = same_host.bind(channel, self._methods, self._grpc is grpc.aio)
        self._methods.update(carried)
        self._carried = frozenset(carried)

    def _call(self, rpc: str, request: bytes, timeout, parse, on_error=None, *, idempotent: bool = True,
              wait_for_ready: bool | None = None):
        """``parse(answer)`` of ``rpc`` for ``request``; a failure raises ``on_error(LogitServeError)``
        (default: the error). ``idempotent=False``: the call changes the server's state, and is
        not retried by the client (:mod:`.retrying`)."""
        raise NotImplementedError

    def _call_each(self, calls, combine, wait_for_ready: bool | None = None):
        """``combine([result of each call])``: ``calls`` are ``_call``'s positional arguments,
        made in order."""
        raise NotImplementedError

    def _deadline(self, timeout) -> float | None:
        timeout = self.timeout if timeout is CLIENT_TIMEOUT else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _plan(self, rpc: str, idempotent: bool, wait_for_ready: bool | None):
        """How one call of ``rpc`` is made: ``(method, its keyword arguments, the client's own
        retries, whether it waits for the gRPC channel before an attempt that opens the
        same-host channel)``. A same-host channel's method takes no ``wait_for_ready``: its
        OpenChannel (over gRPC) would fail at once, so the client waits for the channel first."""
        wait = self.wait_for_ready if wait_for_ready is None else arguments.wait_for_ready(wait_for_ready)
        by_hand = self.retries if idempotent and rpc in self._retried_by_hand else 0
        if rpc in self._carried:
            return self._methods[rpc], {}, by_hand, wait
        return self._methods[rpc], {"wait_for_ready": wait}, by_hand, False

    def _simple(self, rpc: str, msg, response_type, convert, timeout, after=None, on_error=None, *,
                wait_for_ready: bool | None = None):
        return self._call(rpc, msg.SerializeToString(), timeout, parse_as(response_type, convert, after), on_error,
                          wait_for_ready=wait_for_ready)

    def _step_bytes(self, step, pending: collections.deque, named: Registrations | None = None) -> bytes:
        """One step of a stream as bytes; the reader of its answer (with its ``out=`` outputs)
        queued, the registrations it names added to ``named`` (when given)."""
        enc = self._encoder()
        stream = step.get("stream") if isinstance(step, dict) else None
        msg = enc.given(step) if isinstance(step, pb.StepRequest) else \
            messages.build_step(enc, **{k: v for k, v in step.items() if k != "stream"})
        synchronize(enc.cuda_devices, stream)
        if named is not None:
            named.update(enc.referenced)
        pending.append(results.reader(pb.StepResponse, results.step_read(msg), enc.outputs))
        return enc.serialize(msg)
