"""``Client`` (blocking) and ``AsyncClient`` (asyncio): one method per RPC, numpy out.

Both share :class:`_Methods`, where every method builds its request and hands it to the class's
``_call``: ``Client._call`` returns the result, ``AsyncClient._call`` a coroutine of it, so
``client.sample(x)`` and ``await aclient.sample(x)`` take the same arguments. Calls that fail
with UNAVAILABLE (server starting, draining, unreachable) are retried ``retries`` times with
exponential backoff inside the call's timeout; any other status raises
:class:`~.errors.LogitServeError` at once.

The channel, method paths, timeout sentinel, backoff constants and CUDA synchronization are
:mod:`.transport`'s; the SharedMemory service's methods (``register`` ... ``unregister``) come
from :class:`~.region_methods.RegionMethods`, which ``_Methods`` inherits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import AsyncIterator, Iterable, Iterator

import grpc

from logitserve.v1 import logitserve_pb2 as pb

from . import balancing, messages, results, same_host, sequences, wire
from .devices import DeviceRouting
from .errors import LogitServeError
from .results import SampleResult, ServerInfo, StepResult, VerifyDraftResult
from .region_methods import RegionMethods
from .region_names import NEW_SCOPE, Scope
from .region_table import Registrations, RegionTable
from .transport import CLIENT_TIMEOUT, METHOD_PATHS, open_channel, parse_as, retry_delay, synchronize, time_left

# How long close() gives the unregistering of the client's regions, in all.
CLOSE_TIMEOUT_S = 5.0


class _Methods(RegionMethods, sequences.SequenceMethods):
    """The RPC methods, written once for both clients.

    Requests go to gRPC as bytes the client serialized itself (``_send``, of
    :class:`~.devices.DeviceRouting`, which sends each to its device's process: each tensor's bytes
    copied once) and answers come back as bytes the client reads (:mod:`.wire`): the channel's
    methods have no serializers of their own.
    """

    def __init__(self, target: str, timeout: float | None, retries: int, token: str | None,
                 unregister_on_close: bool, region_scope, load_balancing: str):
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        self.target = target
        self.load_balancing = balancing.policy(load_balancing)
        self.timeout = timeout
        self.retries = retries
        self.unregister_on_close = unregister_on_close
        self._token = token
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._regions = RegionTable(Scope(region_scope))
        self._recycler = wire.Recycler()

    def _bind(self, module, channel, **channel_args) -> None:
        """The channel (``module`` is ``grpc`` or ``grpc.aio``) and its raw-bytes methods, one per RPC;
        with ``channel="shm"``, the operators' through a same-host channel (:mod:`.same_host`)."""
        self._channel = open_channel(module, self.target, load_balancing=self.load_balancing, **channel_args)
        self._methods = {rpc: (self._channel.stream_stream(path) if streaming else self._channel.unary_unary(path))
                         for rpc, (path, streaming) in METHOD_PATHS.items()}
        self._same_host, carried = same_host.bind(channel, self._methods, module is grpc.aio)
        self._methods.update(carried)

    def _call(self, rpc: str, request: bytes, timeout, parse, on_error=None):
        """``parse(answer)``; a failure raises ``on_error(LogitServeError)`` (default: the error)."""
        raise NotImplementedError

    def _call_each(self, calls, combine):
        """``combine([result of each call])``: ``calls`` are ``_call``'s arguments, made in order."""
        raise NotImplementedError

    def _deadline(self, timeout) -> float | None:
        timeout = self.timeout if timeout is CLIENT_TIMEOUT else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _simple(self, rpc: str, msg, response_type, convert, timeout, after=None, on_error=None):
        return self._call(rpc, msg.SerializeToString(), timeout, parse_as(response_type, convert, after), on_error)

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

    # ------------------------------------------------------------------------------ operators
    #
    # Tensors: numpy arrays, torch tensors (any device) or array-likes. A contiguous one that lies
    # inside a region registered through this client (register_system with a SharedHostBuffer,
    # register_cuda with a torch CUDA tensor) is sent as a reference to it (Tensor.region), by
    # its address; any other as bytes, copied once into the request. ``out=``: outputs the
    # server writes into registered regions, returned in place of new arrays. ``stream``: the
    # CUDA stream that produced the CUDA tensors a call names (default: each device's current
    # stream), synchronized before the call is sent; the server's writes are complete when the
    # call returns.

    def sample(self, logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
               filter_order="top_k_first", random_val=None, out=None, stream=None,
               timeout=CLIENT_TIMEOUT, **processors) -> SampleResult:
        """Next token of every row of ``logits`` ``(batch_size, vocab_size)``.

        Each parameter is a scalar or one value per row (array or tensor of length B), with the
        meaning of ``logitserve.kernels.sample``: ``temperature`` (0 is greedy), ``top_k`` (0 is
        off), ``top_p`` (1 is off), ``min_p`` (0 is off), ``seed`` (None: the server draws one per
        row and returns it in ``.seeds``), ``step``, ``filter_order`` (``"top_k_first"`` or
        ``"joint"``), ``random_val`` (InfiniCore's exact ``random_sample`` mode).

        ``out``: a dict (or an object with these attributes) of registered outputs, any of
        ``token_ids`` (int64 [B]), ``seeds`` (int64 [B]), ``valid`` (bool [B]); the server writes
        them in place and they come back as the result's fields.

        Logits processors and logprobs, keywords as ``logitserve.kernels.sample``'s:
        ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``min_tokens``
        (scalar or per row); ragged lists as ids + ``[B + 1]`` offsets (``prompt_token_ids`` /
        ``prompt_offsets``, ``output_*``, ``logit_bias_ids`` / ``logit_bias_values`` /
        ``logit_bias_offsets``, ``allowed_*``, ``banned_*``, ``stop_*``); ``grammar_bitmask``
        int32 [B, ceil(V / 32)]; ``logprobs`` (top-n, n <= 20), ``logprobs_mode`` ("raw" or
        "processed") and ``return_kept`` (the kept set as ``.kept_bitmask``).

        Returns a :class:`SampleResult` (``.token_ids`` int64 [B], ``.seeds``, ``.valid``; with
        ``logprobs``: ``.token_logprobs``, ``.token_ranks``, ``.top_token_ids``, ``.top_logprobs``).
        """
        if processors.get("sequence_ids") is not None:
            balancing.require_one_server(self, "sample(sequence_ids=)")
        enc = self._encoder()
        msg = messages.build_sample(enc, (), logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    seed=seed, step=step, filter_order=filter_order, random_val=random_val, out=out,
                                    **processors)
        return self._send("Sample", enc, msg, pb.SampleResponse, results.sample_result, timeout, stream)

    def route_experts(self, gate_logits, k: int, renormalize: bool = False, *, scoring: str = "softmax",
                      correction_bias=None, n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                      routed_scaling_factor: float = 1.0, out=None, stream=None, timeout=CLIENT_TIMEOUT):
        """``(weights float32 [N, k], indices int32 [N, k])``: the k experts of every token.
        Router options as ``kernels.route_experts``: ``scoring`` ("softmax" or "sigmoid"),
        ``correction_bias`` (float32 [E], selection only), ``n_group`` / ``topk_group`` /
        ``group_score`` ("top2_sum" or "max"), ``routed_scaling_factor``; the defaults are
        softmax top-k. ``out``: registered ``weights`` / ``indices`` (a dict, an object with
        those attributes, or a ``(weights, indices)`` tuple), written in place and returned."""
        enc = self._encoder()
        msg = messages.build_route_experts(enc, (), gate_logits, k, renormalize, scoring=scoring,
                                           correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                                           group_score=group_score, routed_scaling_factor=routed_scaling_factor,
                                           out=out)
        return self._send("RouteExperts", enc, msg, pb.RouteExpertsResponse, results.route_experts_result, timeout,
                          stream)

    def verify_draft(self, draft_token_ids, target_logits, *, draft_probs=None, draft_logits=None,
                     draft_temperature=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
                     filter_order="top_k_first", out=None, stream=None, timeout=CLIENT_TIMEOUT) -> VerifyDraftResult:
        """Chain speculative sampling of ``draft_token_ids`` ``(batch_size, n)`` against
        ``target_logits`` ``(batch_size, n + 1, vocab_size)``, as ``logitserve.kernels.verify``.

        The draft's distribution: ``draft_probs`` ``(batch_size, n, vocab_size)``, or
        ``draft_logits`` of that shape with ``draft_temperature`` (scalar or per row; unset: 1.0).
        The target's ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``step`` and
        ``filter_order`` are :meth:`sample`'s. ``out``: registered outputs, any of ``token_ids``
        (int64 [B, n + 1]), ``num_accepted`` (int64 [B]), ``valid`` (bool [B]), ``seeds`` (int64 [B]).

        Returns a :class:`VerifyDraftResult` (``.token_ids``: the accepted prefix, then the
        correction or bonus token, then -1; ``.num_accepted``, ``.valid``, ``.seeds``).
        """
        enc = self._encoder()
        msg = messages.build_verify_draft(enc, (), draft_token_ids, target_logits, draft_probs=draft_probs,
                                          draft_logits=draft_logits, draft_temperature=draft_temperature,
                                          temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                          step=step, filter_order=filter_order, out=out)
        return self._send("VerifyDraft", enc, msg, pb.VerifyDraftResponse, results.verify_draft_result, timeout, stream)

    def softmax(self, x, dim: int = -1, *, out=None, stream=None, timeout=CLIENT_TIMEOUT):
        """``softmax(x, dim)`` as a numpy array (bfloat16 input comes back as float32), or
        written into ``out`` (registered, x's dtype and shape) and returned."""
        enc = self._encoder()
        msg = messages.build_softmax(enc, (), x, dim, out=out)
        return self._send("Softmax", enc, msg, pb.SoftmaxResponse, results.tensor_result, timeout, stream)

    def causal_softmax(self, x, *, out=None, stream=None, timeout=CLIENT_TIMEOUT):
        """Causal softmax of scores ``[S, T]`` or ``[B, S, T]`` (row i sees columns j <= T - S + i);
        ``out`` as in :meth:`softmax`."""
        enc = self._encoder()
        msg = messages.build_causal_softmax(enc, (), x, out=out)
        return self._send("CausalSoftmax", enc, msg, pb.CausalSoftmaxResponse, results.tensor_result, timeout, stream)

    def silu(self, x, *, out=None, stream=None, timeout=CLIENT_TIMEOUT):
        """``x * sigmoid(x)``; ``out`` as in :meth:`softmax`."""
        enc = self._encoder()
        msg = messages.build_silu(enc, (), x, out=out)
        return self._send("Silu", enc, msg, pb.SiluResponse, results.tensor_result, timeout, stream)

    def swiglu(self, gate, up, *, out=None, stream=None, timeout=CLIENT_TIMEOUT):
        """``silu(gate) * up``, broadcasting as numpy and torch do; ``out``: registered, gate's
        dtype and the broadcast shape."""
        enc = self._encoder()
        msg = messages.build_swiglu(enc, (), gate, up, out=out)
        return self._send("Silu", enc, msg, pb.SiluResponse, results.tensor_result, timeout, stream)

    def step(self, *, id: str = "", sample=None, route_experts=None, softmax=None, causal_softmax=None,
             silu=None, swiglu=None, stream=None, timeout=CLIENT_TIMEOUT) -> StepResult:
        """Several operators in one round trip; each argument is a dict of that method's arguments,
        ``out`` included, e.g. ``step(sample={"logits": x, "top_p": 0.9}, route_experts={"gate_logits": g, "k": 2})``.
        Returns a :class:`StepResult` whose fields hold what each method returns, by the names asked."""
        enc = self._encoder()
        msg = messages.build_step(enc, id, sample=sample, route_experts=route_experts, softmax=softmax,
                                  causal_softmax=causal_softmax, silu=silu, swiglu=swiglu)
        return self._send("Step", enc, msg, pb.StepResponse, results.step_read(msg), timeout, stream)

    def server_info(self, *, timeout=CLIENT_TIMEOUT) -> ServerInfo:
        """The server's version, device, backend, dtypes, limits and counters."""
        return self._simple("GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse,
                            results.server_info, timeout)


class Client(DeviceRouting, _Methods):
    """Blocking client; a context manager that closes its channel.

    >>> with Client("127.0.0.1:50051") as client:                  # doctest: +SKIP
    ...     result = client.sample(np.random.randn(2, 32000).astype(np.float32), top_p=0.9)
    ...     result.token_ids, result.seeds

    ``timeout`` is the default per-call deadline in seconds (None: none), overridden by each
    method's ``timeout=``. TLS: ``root_certificates`` (PEM bytes or a path) to verify the server,
    plus ``certificate_chain`` and ``private_key`` for mutual TLS. ``token`` is sent as
    ``authorization: Bearer <token>``. ``options`` are extra gRPC channel options.
    ``load_balancing="round_robin"`` spreads calls over the target's addresses and refuses regions
    and sequences, which belong to one server (default ``"pick_first"``: one server; :mod:`.balancing`).
    ``channel="shm"``: the operators' calls cross a same-host channel, not gRPC (:mod:`.same_host`).

    Regions registered through the client are unregistered when it closes (best effort, within
    ``CLOSE_TIMEOUT_S``; ``unregister_on_close=False`` leaves them registered). The server knows
    each as ``<region_scope>.<name>``: ``region_scope`` random per client by default (:mod:`.region_names`).

    Ordering, for tensors in shared memory: before a call whose tensors or ``out=`` name CUDA
    memory, the client synchronizes the stream that produced them (``stream=``, or each
    device's ``torch.cuda.current_stream``), so its writes are complete before the server reads;
    the server's writes into ``out=`` regions are complete before the call returns. Host memory
    needs nothing: a process's writes precede its later calls.
    """

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, root_certificates=None,
                 certificate_chain=None, private_key=None, token: str | None = None, options=(),
                 unregister_on_close: bool = True, region_scope=NEW_SCOPE, load_balancing: str = "pick_first",
                 channel="grpc"):
        super().__init__(target, timeout, retries, token, unregister_on_close, region_scope, load_balancing)
        self._bind(grpc, channel, root_certificates=root_certificates, certificate_chain=certificate_chain,
                   private_key=private_key, options=options)

    def _call(self, rpc: str, request: bytes, timeout, parse, on_error=None):
        method = self._methods[rpc]
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            remaining = time_left(deadline)
            try:
                return parse(method(request, timeout=remaining, metadata=self._metadata))
            except grpc.RpcError as exc:
                delay = retry_delay(exc, attempt, self.retries, deadline)
                if delay is None:
                    error = LogitServeError.from_rpc_error(exc)
                    raise (error if on_error is None else on_error(error)) from None
            time.sleep(delay)
            attempt += 1

    def _call_each(self, calls, combine):
        return combine([self._call(*call) for call in calls])

    def stream_steps(self, steps: Iterable, *, timeout=CLIENT_TIMEOUT) -> Iterator[StepResult]:
        """One :class:`StepResult` per step of ``steps`` (dicts of :meth:`step`'s arguments,
        ``stream`` and ``out`` included, or StepRequests), in order, over one stream. ``steps`` is
        read as the stream goes: a generator can make each step from the previous results (feed
        it through a queue). An error ends the stream and raises :class:`LogitServeError`;
        streams are not retried."""
        deadline = self._deadline(timeout)
        remaining = time_left(deadline)
        pending: collections.deque = collections.deque()
        named: Registrations = {}
        call = self._methods["StreamSteps"]((self._step_bytes(s, pending, named) for s in steps), timeout=remaining,
                                            metadata=self._metadata)
        try:
            for raw in call:
                yield pending.popleft()(raw)
        except grpc.RpcError as exc:
            raise self._region_error(LogitServeError.from_rpc_error(exc), named) from None
        finally:
            call.cancel()

    def close(self) -> None:
        """Unregister the regions registered through this client (best effort: never raises),
        then close the channel; first those of its device clients (:mod:`.devices`)."""
        for device_client in self._routes.clients():
            device_client.close()
        names = self._regions.names
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for rpc, request in same_host.closing_calls(self._same_host, self._unregister_requests()):
            with contextlib.suppress(Exception):
                self._methods[rpc](request, timeout=max(deadline - time.monotonic(), 0.01), metadata=self._metadata)
        self._regions.remove(names)
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(DeviceRouting, _Methods):
    """asyncio client, with :class:`Client`'s arguments (and its ordering and closing rules);
    every method is awaited. The CUDA stream synchronization before a call blocks the event
    loop for as long as the stream's pending work takes.

    >>> async with AsyncClient("127.0.0.1:50051") as client:       # doctest: +SKIP
    ...     result = await client.sample(logits, temperature=0.7)
    """

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, root_certificates=None,
                 certificate_chain=None, private_key=None, token: str | None = None, options=(),
                 unregister_on_close: bool = True, region_scope=NEW_SCOPE, load_balancing: str = "pick_first",
                 channel="grpc"):
        super().__init__(target, timeout, retries, token, unregister_on_close, region_scope, load_balancing)
        self._bind(grpc.aio, channel, root_certificates=root_certificates, certificate_chain=certificate_chain,
                   private_key=private_key, options=options)

    def _call(self, rpc: str, request: bytes, timeout, parse, on_error=None):
        return self._acall(self._methods[rpc], request, self._deadline(timeout), parse, on_error)

    async def _acall(self, method, request, deadline, parse, on_error):
        attempt = 0
        while True:
            remaining = time_left(deadline)
            try:
                return parse(await method(request, timeout=remaining, metadata=self._metadata))
            except grpc.RpcError as exc:
                delay = retry_delay(exc, attempt, self.retries, deadline)
                if delay is None:
                    error = LogitServeError.from_rpc_error(exc)
                    raise (error if on_error is None else on_error(error)) from None
            await asyncio.sleep(delay)
            attempt += 1

    def _call_each(self, calls, combine):
        async def each():
            return combine([await self._call(*call) for call in calls])

        return each()

    async def stream_steps(self, steps, *, timeout=CLIENT_TIMEOUT) -> AsyncIterator[StepResult]:
        """:meth:`Client.stream_steps` for asyncio: ``steps`` may be an async or plain iterable."""
        pending: collections.deque = collections.deque()
        named: Registrations = {}

        async def requests():
            if hasattr(steps, "__aiter__"):
                async for s in steps:
                    yield self._step_bytes(s, pending, named)
            else:
                for s in steps:
                    yield self._step_bytes(s, pending, named)

        deadline = self._deadline(timeout)
        remaining = time_left(deadline)
        call = self._methods["StreamSteps"](requests(), timeout=remaining, metadata=self._metadata)
        try:
            async for raw in call:
                yield pending.popleft()(raw)
        except grpc.RpcError as exc:
            raise self._region_error(LogitServeError.from_rpc_error(exc), named) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        """:meth:`Client.close` for asyncio."""
        for device_client in self._routes.clients():
            await device_client.close()
        names = self._regions.names
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for rpc, request in same_host.closing_calls(self._same_host, self._unregister_requests()):
            with contextlib.suppress(Exception):
                await self._methods[rpc](request, timeout=max(deadline - time.monotonic(), 0.01), metadata=self._metadata)
        self._regions.remove(names)
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
