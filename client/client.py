"""``Client`` (blocking) and ``AsyncClient`` (asyncio): one method per RPC, numpy out.

Both share :class:`_Methods`, where every method builds its request and hands it to the class's
``_call``: ``Client._call`` returns the result, ``AsyncClient._call`` a coroutine of it, so
``client.sample(x)`` and ``await aclient.sample(x)`` take the same arguments. Calls that fail
with UNAVAILABLE (server starting, draining, unreachable) are retried ``retries`` times with
exponential backoff inside the call's timeout; any other status raises
:class:`~.errors.LogitServeError` at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import time
from typing import AsyncIterator, Iterable, Iterator

import grpc

from logitserve.v1 import logitserve_pb2 as pb

from . import codec, messages, regions, wire
from .errors import LogitServeError
from .messages import SampleResult, ServerInfo, StepResult

_DEFAULT = object()  # "the client's timeout" (None means no deadline)
# Exponential backoff of UNAVAILABLE retries: 50 ms, 100 ms, 200 ms, ... capped at 2 s, each
# drawn uniformly from [half, full] so clients retrying together spread out.
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
# No client-side size limit: the server's --max-message-bytes is the one that counts.
DEFAULT_OPTIONS = {"grpc.max_send_message_length": -1, "grpc.max_receive_message_length": -1}


def _read(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def _channel(module, target: str, *, root_certificates, certificate_chain, private_key, options):
    opts = list({**DEFAULT_OPTIONS, **dict(options)}.items())
    if root_certificates is None and certificate_chain is None:
        return module.insecure_channel(target, options=opts)
    creds = grpc.ssl_channel_credentials(_read(root_certificates), _read(private_key), _read(certificate_chain))
    return module.secure_channel(target, creds, options=opts)


def _synchronize(devices: set[int], stream) -> None:
    """The ordering rule's client half: before a call that names CUDA memory, the work that
    writes it (or reads an output's memory) is complete: ``stream`` when given, else the
    current stream of each device the call names."""
    if not devices:
        return
    if stream is not None:
        stream.synchronize()
        return
    import torch

    for device in sorted(devices):
        torch.cuda.current_stream(device).synchronize()


def _parse_as(response_type, convert, after=None):
    """``raw -> convert(response_type.FromString(raw))``, calling ``after(message)`` first."""

    def parse(raw: bytes):
        msg = response_type.FromString(raw)
        if after is not None:
            after(msg)
        return convert(msg)

    return parse


def _method_paths():
    """Every unary RPC's full method path (both services)."""
    paths = {}
    for service in (pb.DESCRIPTOR.services_by_name["LogitServe"], pb.DESCRIPTOR.services_by_name["SharedMemory"]):
        for method in service.methods:
            paths[method.name] = (f"/{service.full_name}/{method.name}", method.client_streaming)
    return paths


_PATHS = _method_paths()
# How long close() gives the unregistering of the client's regions, in all.
CLOSE_TIMEOUT_S = 5.0


class _Methods:
    """The RPC methods, written once for both clients.

    Requests go to gRPC as bytes the client serialized itself (:meth:`_send`: each tensor's bytes
    copied once) and answers come back as bytes the client reads (:mod:`.wire`): the channel's
    methods have no serializers of their own.
    """

    def __init__(self, timeout: float | None, retries: int, token: str | None, unregister_on_close: bool):
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        self.timeout = timeout
        self.retries = retries
        self.unregister_on_close = unregister_on_close
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._regions = regions.RegionTable()
        self._recycler = wire.Recycler()

    def _bind(self, channel) -> None:
        """The channel's raw-bytes methods, one per RPC."""
        self._channel = channel
        self._methods = {rpc: (channel.stream_stream(path) if streaming else channel.unary_unary(path))
                         for rpc, (path, streaming) in _PATHS.items()}

    @property
    def registered(self) -> list[str]:
        """The names of the regions registered through this client and not yet unregistered."""
        return self._regions.names

    def _call(self, rpc: str, request: bytes, timeout, parse):
        raise NotImplementedError

    def _deadline(self, timeout) -> float | None:
        timeout = self.timeout if timeout is _DEFAULT else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _retry_delay(self, exc: grpc.RpcError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before retrying a failed attempt, or None to give up."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self.retries:
            return None
        delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**attempt) * random.uniform(0.5, 1.0)
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay

    def _encoder(self) -> messages.Encoder:
        return messages.Encoder(self._regions)

    def _send(self, rpc: str, enc: messages.Encoder, msg, response_type, read, timeout, stream):
        """Synchronize what the request names on CUDA, serialize it (tensor bytes copied once)
        and call ``rpc``; the answer is read by ``read`` with the request's ``out=`` outputs."""
        _synchronize(enc.cuda_devices, stream)
        payload = enc.serialize(msg, self._recycler)
        self._recycler.give_back(payload)  # reused only once nothing references it (after this call)
        return self._call(rpc, payload, timeout, messages.reader(response_type, read, enc.outputs))

    def _simple(self, rpc: str, msg, response_type, convert, timeout, after=None):
        return self._call(rpc, msg.SerializeToString(), timeout, _parse_as(response_type, convert, after))

    def _step_bytes(self, step, pending: collections.deque) -> bytes:
        """One step of a stream as bytes; its ``out=`` outputs queued for its answer."""
        if isinstance(step, pb.StepRequest):
            pending.append({})
            return step.SerializeToString()
        enc = self._encoder()
        stream = step.get("stream") if isinstance(step, dict) else None
        msg = messages.build_step(enc, **{k: v for k, v in step.items() if k != "stream"})
        _synchronize(enc.cuda_devices, stream)
        pending.append(enc.outputs)
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
               filter_order="top_k_first", random_val=None, out=None, stream=None, timeout=_DEFAULT) -> SampleResult:
        """Next token of every row of ``logits`` ``(batch_size, vocab_size)``.

        Each parameter is a scalar or one value per row (array or tensor of length B), with the
        meaning of ``logitserve.kernels.sample``: ``temperature`` (0 is greedy), ``top_k`` (0 is
        off), ``top_p`` (1 is off), ``min_p`` (0 is off), ``seed`` (None: the server draws one per
        row and returns it in ``.seeds``), ``step``, ``filter_order`` (``"top_k_first"`` or
        ``"joint"``), ``random_val`` (InfiniCore's exact ``random_sample`` mode).

        ``out``: a dict (or an object with these attributes) of registered outputs, any of
        ``token_ids`` (int64 [B]), ``seeds`` (int64 [B]), ``valid`` (bool [B]); the server writes
        them in place and they come back as the result's fields.

        Returns a :class:`SampleResult` (``.token_ids`` int64 [B], ``.seeds``, ``.valid``).
        """
        enc = self._encoder()
        msg = messages.build_sample(enc, (), logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    seed=seed, step=step, filter_order=filter_order, random_val=random_val, out=out)
        return self._send("Sample", enc, msg, pb.SampleResponse, messages.sample_result, timeout, stream)

    def route_experts(self, gate_logits, k: int, renormalize: bool = False, *, out=None, stream=None,
                      timeout=_DEFAULT):
        """``(weights float32 [N, k], indices int32 [N, k])``: the top-k experts of every token.
        ``out``: registered ``weights`` / ``indices`` (a dict, an object with those attributes, or
        a ``(weights, indices)`` tuple), written in place and returned."""
        enc = self._encoder()
        msg = messages.build_route_experts(enc, (), gate_logits, k, renormalize, out=out)
        return self._send("RouteExperts", enc, msg, pb.RouteExpertsResponse, messages.route_experts_result, timeout,
                          stream)

    def softmax(self, x, dim: int = -1, *, out=None, stream=None, timeout=_DEFAULT):
        """``softmax(x, dim)`` as a numpy array (bfloat16 input comes back as float32), or
        written into ``out`` (registered, x's dtype and shape) and returned."""
        enc = self._encoder()
        msg = messages.build_softmax(enc, (), x, dim, out=out)
        return self._send("Softmax", enc, msg, pb.SoftmaxResponse, messages.tensor_result, timeout, stream)

    def causal_softmax(self, x, *, out=None, stream=None, timeout=_DEFAULT):
        """Causal softmax of scores ``[S, T]`` or ``[B, S, T]`` (row i sees columns j <= T - S + i);
        ``out`` as in :meth:`softmax`."""
        enc = self._encoder()
        msg = messages.build_causal_softmax(enc, (), x, out=out)
        return self._send("CausalSoftmax", enc, msg, pb.CausalSoftmaxResponse, messages.tensor_result, timeout,
                          stream)

    def silu(self, x, *, out=None, stream=None, timeout=_DEFAULT):
        """``x * sigmoid(x)``; ``out`` as in :meth:`softmax`."""
        enc = self._encoder()
        msg = messages.build_silu(enc, (), x, out=out)
        return self._send("Silu", enc, msg, pb.SiluResponse, messages.tensor_result, timeout, stream)

    def swiglu(self, gate, up, *, out=None, stream=None, timeout=_DEFAULT):
        """``silu(gate) * up``, broadcasting as numpy and torch do; ``out``: registered, gate's
        dtype and the broadcast shape."""
        enc = self._encoder()
        msg = messages.build_swiglu(enc, (), gate, up, out=out)
        return self._send("Silu", enc, msg, pb.SiluResponse, messages.tensor_result, timeout, stream)

    def step(self, *, id: str = "", sample=None, route_experts=None, softmax=None, causal_softmax=None,
             silu=None, swiglu=None, stream=None, timeout=_DEFAULT) -> StepResult:
        """Several operators in one round trip; each argument is a dict of that method's arguments,
        ``out`` included, e.g. ``step(sample={"logits": x, "top_p": 0.9}, route_experts={"gate_logits": g, "k": 2})``.
        Returns a :class:`StepResult` whose fields hold what each method returns."""
        enc = self._encoder()
        msg = messages.build_step(enc, id, sample=sample, route_experts=route_experts, softmax=softmax,
                                  causal_softmax=causal_softmax, silu=silu, swiglu=swiglu)
        return self._send("Step", enc, msg, pb.StepResponse, messages.step_result, timeout, stream)

    def server_info(self, *, timeout=_DEFAULT) -> ServerInfo:
        """The server's version, device, backend, dtypes, limits and counters."""
        return self._simple("GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse,
                            messages.server_info, timeout)

    # Shared-memory regions (the SharedMemory service; helpers in logitserve.client.regions).

    def register(self, name: str, x, *, timeout=_DEFAULT):
        """Register ``x`` as region ``name``: a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor`` / ``shared_copy``) through
        :meth:`register_system`, a contiguous torch CUDA tensor through :meth:`register_cuda`.
        Tensors inside it are then sent by reference, and it may hold ``out=`` outputs."""
        if isinstance(x, regions.SharedHostBuffer):
            return self.register_system(name, x, timeout=timeout)
        if codec.is_torch(x) and x.is_cuda:
            return self.register_cuda(name, x, timeout=timeout)
        raise TypeError(f"register: {name!r}: give a SharedHostBuffer (place host memory with regions.shared_copy "
                        f"or shared_array / shared_tensor) or a torch CUDA tensor, got {type(x).__name__}")

    def register_system(self, name: str, key, byte_size: int | None = None, offset: int = 0, *, timeout=_DEFAULT):
        """Register ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` as
        region ``name``. ``key`` may be a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor``), whose size is then the default, and
        whose tensors are then found by address and sent by reference."""
        request = regions.system_request(name, key, byte_size, offset)
        buf = key if isinstance(key, regions.SharedHostBuffer) else None

        def after(_):
            self._regions.add_system(name, buf, request.offset, request.byte_size)

        return self._simple("RegisterSystemSharedMemory", request, pb.RegisterSharedMemoryResponse,
                            regions.registered, timeout, after)

    def register_cuda(self, name: str, handle, device_id: int | None = None, byte_size: int | None = None,
                      offset: int = 0, *, timeout=_DEFAULT):
        """Register CUDA memory as region ``name``: ``handle`` a contiguous torch CUDA tensor (its
        allocation's IPC handle and its offset in it are sent; needs cuda-python), a
        :class:`~.regions.CudaIpcHandle`, or the 64 bytes of a ``cudaIpcMemHandle_t`` with
        ``device_id`` and ``byte_size``. ``offset`` is added to the tensor's own offset. The
        server must be on the same host. A tensor is kept alive by the client until the region
        is unregistered, and tensors inside its memory are sent by reference."""
        keep = None
        if codec.is_torch(handle):
            keep, handle = handle, regions.cuda_ipc_handle(handle)
        request = regions.cuda_request(name, handle, device_id, byte_size, offset)
        base = handle.base_ptr if isinstance(handle, regions.CudaIpcHandle) else None

        def after(_):
            start = None if base is None else base + request.offset
            self._regions.add_cuda(name, start, request.byte_size,
                                   handle.device_id if base is not None else request.device_id, keep)

        return self._simple("RegisterCudaSharedMemory", request, pb.RegisterSharedMemoryResponse,
                            regions.registered, timeout, after)

    def shared_memory_status(self, name: str = "", *, kind: str | None = None, timeout=_DEFAULT):
        """This caller's regions (of ``kind``, "system" or "cuda", when given) as a list of
        :class:`~.regions.RegionStatus`; ``name``: that one region (NOT_FOUND when unknown)."""
        request = pb.SharedMemoryStatusRequest(name=name, kind=regions.kind_enum(kind))
        return self._simple("SharedMemoryStatus", request, pb.SharedMemoryStatusResponse, regions.status_result,
                            timeout)

    def unregister(self, name: str = "", *, kind: str | None = None, timeout=_DEFAULT) -> list[str]:
        """Unregister region ``name`` (empty: every region of this caller, of ``kind`` when
        given); returns the names unregistered (none for a name not registered)."""
        request = pb.UnregisterSharedMemoryRequest(name=name, kind=regions.kind_enum(kind))
        return self._simple("UnregisterSharedMemory", request, pb.UnregisterSharedMemoryResponse,
                            regions.unregister_result, timeout, lambda msg: self._regions.remove(msg.names))

    def _unregister_requests(self) -> list[bytes]:
        """close()'s unregistering: one request per region registered through this client."""
        if not self.unregister_on_close:
            return []
        return [pb.UnregisterSharedMemoryRequest(name=name).SerializeToString() for name in self._regions.names]


class Client(_Methods):
    """Blocking client; a context manager that closes its channel.

    >>> with Client("127.0.0.1:50051") as client:                  # doctest: +SKIP
    ...     result = client.sample(np.random.randn(2, 32000).astype(np.float32), top_p=0.9)
    ...     result.token_ids, result.seeds

    ``timeout`` is the default per-call deadline in seconds (None: none), overridden by each
    method's ``timeout=``. TLS: ``root_certificates`` (PEM bytes or a path) to verify the server,
    plus ``certificate_chain`` and ``private_key`` for mutual TLS. ``token`` is sent as
    ``authorization: Bearer <token>``. ``options`` are extra gRPC channel options.

    Regions registered through the client are unregistered when it closes (best effort, within
    ``CLOSE_TIMEOUT_S``; ``unregister_on_close=False`` leaves them registered).

    Ordering, for tensors in shared memory: before a call whose tensors or ``out=`` name CUDA
    memory, the client synchronizes the stream that produced them (``stream=``, or each
    device's ``torch.cuda.current_stream``), so its writes are complete before the server reads;
    the server's writes into ``out=`` regions are complete before the call returns. Host memory
    needs nothing: a process's writes precede its later calls.
    """

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, root_certificates=None,
                 certificate_chain=None, private_key=None, token: str | None = None, options=(),
                 unregister_on_close: bool = True):
        super().__init__(timeout, retries, token, unregister_on_close)
        self.target = target
        self._bind(_channel(grpc, target, root_certificates=root_certificates, certificate_chain=certificate_chain,
                            private_key=private_key, options=options))

    def _call(self, rpc: str, request: bytes, timeout, parse):
        method = self._methods[rpc]
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return parse(method(request, timeout=remaining, metadata=self._metadata))
            except grpc.RpcError as exc:
                delay = self._retry_delay(exc, attempt, deadline)
                if delay is None:
                    raise LogitServeError.from_rpc_error(exc) from None
            time.sleep(delay)
            attempt += 1

    def stream_steps(self, steps: Iterable, *, timeout=_DEFAULT) -> Iterator[StepResult]:
        """One :class:`StepResult` per step of ``steps`` (dicts of :meth:`step`'s arguments,
        ``stream`` and ``out`` included, or StepRequests), in order, over one stream. ``steps`` is
        read as the stream goes: a generator can make each step from the previous results (feed
        it through a queue). An error ends the stream and raises :class:`LogitServeError`;
        streams are not retried."""
        deadline = self._deadline(timeout)
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        pending: collections.deque = collections.deque()
        call = self._methods["StreamSteps"]((self._step_bytes(s, pending) for s in steps), timeout=remaining,
                                            metadata=self._metadata)
        try:
            for raw in call:
                yield messages.reader(pb.StepResponse, messages.step_result, pending.popleft())(raw)
        except grpc.RpcError as exc:
            raise LogitServeError.from_rpc_error(exc) from None
        finally:
            call.cancel()

    def close(self) -> None:
        """Unregister the regions registered through this client (best effort: never raises),
        then close the channel."""
        names = self._regions.names
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for request in self._unregister_requests():
            with contextlib.suppress(Exception):
                self._methods["UnregisterSharedMemory"](request, timeout=max(deadline - time.monotonic(), 0.01),
                                                        metadata=self._metadata)
        self._regions.remove(names)
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Methods):
    """asyncio client, with :class:`Client`'s arguments (and its ordering and closing rules);
    every method is awaited. The CUDA stream synchronization before a call blocks the event
    loop for as long as the stream's pending work takes.

    >>> async with AsyncClient("127.0.0.1:50051") as client:       # doctest: +SKIP
    ...     result = await client.sample(logits, temperature=0.7)
    """

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, root_certificates=None,
                 certificate_chain=None, private_key=None, token: str | None = None, options=(),
                 unregister_on_close: bool = True):
        super().__init__(timeout, retries, token, unregister_on_close)
        self.target = target
        self._bind(_channel(grpc.aio, target, root_certificates=root_certificates,
                            certificate_chain=certificate_chain, private_key=private_key, options=options))

    def _call(self, rpc: str, request: bytes, timeout, parse):
        return self._acall(self._methods[rpc], request, self._deadline(timeout), parse)

    async def _acall(self, method, request, deadline, parse):
        attempt = 0
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return parse(await method(request, timeout=remaining, metadata=self._metadata))
            except grpc.RpcError as exc:
                delay = self._retry_delay(exc, attempt, deadline)
                if delay is None:
                    raise LogitServeError.from_rpc_error(exc) from None
            await asyncio.sleep(delay)
            attempt += 1

    async def stream_steps(self, steps, *, timeout=_DEFAULT) -> AsyncIterator[StepResult]:
        """:meth:`Client.stream_steps` for asyncio: ``steps`` may be an async or plain iterable."""
        pending: collections.deque = collections.deque()

        async def requests():
            if hasattr(steps, "__aiter__"):
                async for s in steps:
                    yield self._step_bytes(s, pending)
            else:
                for s in steps:
                    yield self._step_bytes(s, pending)

        deadline = self._deadline(timeout)
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call = self._methods["StreamSteps"](requests(), timeout=remaining, metadata=self._metadata)
        try:
            async for raw in call:
                yield messages.reader(pb.StepResponse, messages.step_result, pending.popleft())(raw)
        except grpc.RpcError as exc:
            raise LogitServeError.from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        """:meth:`Client.close` for asyncio."""
        names = self._regions.names
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for request in self._unregister_requests():
            with contextlib.suppress(Exception):
                await self._methods["UnregisterSharedMemory"](
                    request, timeout=max(deadline - time.monotonic(), 0.01), metadata=self._metadata)
        self._regions.remove(names)
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
