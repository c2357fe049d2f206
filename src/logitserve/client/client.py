"""``Client``: the blocking client, one method per RPC, numpy out.

Its methods are :class:`~.operators.OperatorMethods`' (the operators),
:class:`~.region_methods.RegionMethods`' (the SharedMemory service) and
:class:`~.sequences.SequenceMethods`', made of :class:`~.construction.ClientBase`; this module
writes how a call is made and retried, the stream of steps, and closing.
:class:`~.async_client.AsyncClient` is the same for asyncio.
"""

from __future__ import annotations

import collections
import time
from typing import Iterable, Iterator

import grpc

from .construction import CLOSE_TIMEOUT_S, server_gone
from .devices import DeviceRouting
from .errors import LogitServeError
from .operators import OperatorMethods
from .ordered import OrderedSession
from .region_table import Registrations
from .results import StepResult
from .retrying import after_failure
from .same_host import ChannelError, closing_calls
from .transport import CLIENT_TIMEOUT, time_left


class Client(DeviceRouting, OperatorMethods):
    """Blocking client; a context manager that closes its channel.

    >>> with Client("127.0.0.1:50051") as client:                  # doctest: +SKIP
    ...     result = client.sample(np.random.randn(2, 32000).astype(np.float32), top_p=0.9)
    ...     result.token_ids, result.seeds

    ``timeout``: the default per-call deadline in seconds (None: none), overridden by each
    method's ``timeout=``.

    ``retries``: how many times a call that fails UNAVAILABLE (a server starting, draining or
    unreachable) is sent again, 0 to 4, with backoff (50 ms doubling, at most 2 s) inside its
    deadline; other codes raise at once, and a deadline that passes first ends the call
    DEADLINE_EXCEEDED. gRPC's retry policy does it (the channel's service config), except for a
    ``sample`` naming ``sequence_ids``, which is never sent twice (it advances the sequences),
    and the calls of a same-host channel, which the client retries itself (:mod:`.retrying`).

    ``wait_for_ready``: False (gRPC's default, and tritonclient's): a call to a server that
    cannot be reached fails UNAVAILABLE at once, after its retries (about 0.35 s with the
    default 3), so a client learns at once that its server is down. True: a call waits for the
    server to be reachable, until its deadline (without one: for as long as it takes), as for
    a script that starts a server and calls it, or a client made before its server. Each method
    takes ``wait_for_ready=`` for one call (None: the client's).

    TLS: ``root_certificates`` (PEM bytes or a path) to verify the server, plus
    ``certificate_chain`` and ``private_key`` for mutual TLS. ``token`` is sent as
    ``authorization: Bearer <token>``. ``options`` are extra gRPC channel options (a
    ``grpc.service_config`` may set method configs, not the load-balancing or retry policy).
    ``load_balancing="round_robin"`` spreads calls over the target's addresses and refuses regions
    and sequences, which belong to one server (default ``"pick_first"``: one server; :mod:`.balancing`).
    ``channel="shm"`` (or a :class:`~.same_host.SameHost`): the operators' calls cross a same-host
    channel, not gRPC (:mod:`.same_host`); refused with ImportError when this Python lacks
    iceoryx2 of the server's release (``pip install 'logitserve[channel]'``).

    Regions registered through the client are unregistered when it closes (best effort, within
    ``CLOSE_TIMEOUT_S``; ``unregister_on_close=False`` leaves them registered). The server knows
    each as ``<region_scope>.<name>``: ``region_scope`` random per client by default (:mod:`.region_names`).

    Ordering, for tensors in shared memory: before a call whose tensors or ``out=`` name CUDA
    memory, the client synchronizes the stream that produced them (``stream=``, or each
    device's ``torch.cuda.current_stream``), so its writes are complete before the server reads;
    the server's writes into ``out=`` regions are complete before the call returns. Host memory
    needs nothing: a process's writes precede its later calls.
    """

    def _call(self, rpc: str, request: bytes, timeout, parse, on_error=None, *, idempotent: bool = True,
              wait_for_ready: bool | None = None):
        method, kwargs, retries, wait_for_channel = self._plan(rpc, idempotent, wait_for_ready)
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            try:
                if wait_for_channel and not self._same_host.is_open:
                    self._channel_ready(deadline)
                return parse(method(request, timeout=time_left(deadline), metadata=self._metadata, **kwargs))
            except grpc.RpcError as exc:
                outcome = after_failure(exc, attempt, retries, deadline)
                if isinstance(outcome, LogitServeError):
                    raise (outcome if on_error is None else on_error(outcome)) from None
            time.sleep(outcome)
            attempt += 1

    def _channel_ready(self, deadline: float | None) -> None:
        """Wait for the gRPC channel to be ready (wait_for_ready before the same-host channel opens)."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=time_left(deadline))
        except grpc.FutureTimeoutError:
            ready.cancel()
            raise ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded waiting for the server "
                                                                  "(wait_for_ready)") from None

    def _call_each(self, calls, combine, wait_for_ready: bool | None = None):
        return combine([self._call(*call, wait_for_ready=wait_for_ready) for call in calls])

    def stream_steps(self, steps: Iterable, *, timeout=CLIENT_TIMEOUT,
                     wait_for_ready: bool | None = None) -> Iterator[StepResult]:
        """One :class:`StepResult` per step of ``steps`` (dicts of :meth:`step`'s arguments,
        ``stream`` and ``out`` included, or StepRequests), in order, over one stream. ``steps`` is
        read as the stream goes: a generator can make each step from the previous results (feed
        it through a queue). An error ends the stream and raises :class:`LogitServeError`;
        streams are not retried."""
        method, kwargs, _, _ = self._plan("StreamSteps", False, wait_for_ready)
        deadline = self._deadline(timeout)
        pending: collections.deque = collections.deque()
        named: Registrations = {}
        call = method((self._step_bytes(s, pending, named) for s in steps), timeout=time_left(deadline),
                      metadata=self._metadata, **kwargs)
        try:
            for raw in call:
                yield pending.popleft()(raw)
        except grpc.RpcError as exc:
            raise self._region_error(LogitServeError.from_rpc_error(exc), named) from None
        finally:
            call.cancel()

    def ordered_session(self, *, wait_timeout_s: float = 0.0, max_steps_ahead: int = 0,
                        owned_regions=()) -> OrderedSession:
        """A stream-ordered session (:mod:`.ordered`): Sample calls ordered on the GPU, not on the
        host. ``wait_timeout_s``: how long a step may wait on the GPU for this client's ready
        mark before the server ends the session (0: the server's ``--ordered-wait-s``);
        ``max_steps_ahead``: steps the server holds enqueued for it (0: its default, 8).
        ``owned_regions``: names of regions registered through this client that the server
        unregisters when the session ends, however it ends (this process killed included), so
        that their memory is not held mapped by the server after the engine is gone. A context
        manager; close it to end the session."""
        return OrderedSession(self, wait_timeout_s, max_steps_ahead, owned_regions)

    def close(self) -> None:
        """Unregister the regions registered through this client (best effort: never raises),
        then close the channel; first those of its device clients (:mod:`.devices`)."""
        for device_client in self._routes.clients():
            device_client.close()
        names = self._regions.names
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        gone = False
        for rpc, request in closing_calls(self._same_host, self._unregister_requests()):
            if gone:
                continue  # the generator still runs to its end: it drops the same-host channel's ports
            try:
                self._methods[rpc](request, timeout=max(deadline - time.monotonic(), 0.01), metadata=self._metadata,
                                   wait_for_ready=False)
            except Exception as exc:  # noqa: BLE001 - best effort: close never raises
                gone = server_gone(exc)
        self._regions.remove(names)
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
