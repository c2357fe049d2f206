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
import os
import random
import time
from typing import AsyncIterator, Iterable, Iterator

import grpc

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from . import messages, regions
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


class _Methods:
    """The RPC methods, written once for both clients."""

    def __init__(self, timeout: float | None, retries: int, token: str | None):
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        self.timeout = timeout
        self.retries = retries
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def _call(self, rpc: str, request, timeout, parse):
        raise NotImplementedError

    def _rpc(self, rpc: str):
        """The stub's method for ``rpc`` (of the LogitServe or the SharedMemory service)."""
        return getattr(self._shm_stub if rpc in regions.SHARED_MEMORY_RPCS else self._stub, rpc)

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

    def sample(self, logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
               filter_order="top_k_first", random_val=None, timeout=_DEFAULT) -> SampleResult:
        """Next token of every row of ``logits`` ``(batch_size, vocab_size)``.

        Each parameter is a scalar or one value per row (array or tensor of length B), with the
        meaning of ``logitserve.kernels.sample``: ``temperature`` (0 is greedy), ``top_k`` (0 is
        off), ``top_p`` (1 is off), ``min_p`` (0 is off), ``seed`` (None: the server draws one per
        row and returns it in ``.seeds``), ``step``, ``filter_order`` (``"top_k_first"`` or
        ``"joint"``), ``random_val`` (InfiniCore's exact ``random_sample`` mode).

        Returns a :class:`SampleResult` (``.token_ids`` int64 [B], ``.seeds``, ``.valid``).
        """
        request = messages.sample_request(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                          seed=seed, step=step, filter_order=filter_order, random_val=random_val)
        return self._call("Sample", request, timeout, messages.sample_result)

    def route_experts(self, gate_logits, k: int, renormalize: bool = False, *, timeout=_DEFAULT):
        """``(weights float32 [N, k], indices int32 [N, k])``: the top-k experts of every token."""
        return self._call("RouteExperts", messages.route_experts_request(gate_logits, k, renormalize), timeout,
                          messages.route_experts_result)

    def softmax(self, x, dim: int = -1, *, timeout=_DEFAULT):
        """``softmax(x, dim)`` as a numpy array (bfloat16 input comes back as float32)."""
        return self._call("Softmax", messages.softmax_request(x, dim), timeout, messages.tensor_result)

    def causal_softmax(self, x, *, timeout=_DEFAULT):
        """Causal softmax of scores ``[S, T]`` or ``[B, S, T]`` (row i sees columns j <= T - S + i)."""
        return self._call("CausalSoftmax", messages.causal_softmax_request(x), timeout, messages.tensor_result)

    def silu(self, x, *, timeout=_DEFAULT):
        """``x * sigmoid(x)``."""
        return self._call("Silu", messages.silu_request(x), timeout, messages.tensor_result)

    def swiglu(self, gate, up, *, timeout=_DEFAULT):
        """``silu(gate) * up``, broadcasting as numpy and torch do."""
        return self._call("Silu", messages.swiglu_request(gate, up), timeout, messages.tensor_result)

    def step(self, *, id: str = "", sample=None, route_experts=None, softmax=None, causal_softmax=None,
             silu=None, swiglu=None, timeout=_DEFAULT) -> StepResult:
        """Several operators in one round trip; each argument is a dict of that method's arguments,
        e.g. ``step(sample={"logits": x, "top_p": 0.9}, route_experts={"gate_logits": g, "k": 2})``.
        Returns a :class:`StepResult` whose fields hold what each method returns."""
        request = messages.step_request(id, sample=sample, route_experts=route_experts, softmax=softmax,
                                        causal_softmax=causal_softmax, silu=silu, swiglu=swiglu)
        return self._call("Step", request, timeout, messages.step_result)

    def server_info(self, *, timeout=_DEFAULT) -> ServerInfo:
        """The server's version, device, backend, dtypes, limits and counters."""
        return self._call("GetServerInfo", pb.GetServerInfoRequest(), timeout, messages.server_info)

    # Shared-memory regions (the SharedMemory service; helpers in logitserve.client.regions).

    def register_system(self, name: str, key, byte_size: int | None = None, offset: int = 0, *, timeout=_DEFAULT):
        """Register ``[offset, offset + byte_size)`` of the POSIX shared-memory object ``key`` as
        region ``name``. ``key`` may be a :class:`~.regions.SharedHostBuffer`
        (``regions.shared_array`` / ``shared_tensor``), whose size is then the default."""
        return self._call("RegisterSystemSharedMemory", regions.system_request(name, key, byte_size, offset),
                          timeout, regions.registered)

    def register_cuda(self, name: str, handle, device_id: int | None = None, byte_size: int | None = None,
                      offset: int = 0, *, timeout=_DEFAULT):
        """Register CUDA memory as region ``name``: ``handle`` a contiguous torch CUDA tensor (its
        allocation's IPC handle and its offset in it are sent; needs cuda-python), a
        :class:`~.regions.CudaIpcHandle`, or the 64 bytes of a ``cudaIpcMemHandle_t`` with
        ``device_id`` and ``byte_size``. ``offset`` is added to the tensor's own offset. The
        server must be on the same host; keep the memory alive until it is unregistered."""
        return self._call("RegisterCudaSharedMemory", regions.cuda_request(name, handle, device_id, byte_size, offset),
                          timeout, regions.registered)

    def shared_memory_status(self, name: str = "", *, kind: str | None = None, timeout=_DEFAULT):
        """This caller's regions (of ``kind``, "system" or "cuda", when given) as a list of
        :class:`~.regions.RegionStatus`; ``name``: that one region (NOT_FOUND when unknown)."""
        request = pb.SharedMemoryStatusRequest(name=name, kind=regions.kind_enum(kind))
        return self._call("SharedMemoryStatus", request, timeout, regions.status_result)

    def unregister(self, name: str = "", *, kind: str | None = None, timeout=_DEFAULT) -> list[str]:
        """Unregister region ``name`` (empty: every region of this caller, of ``kind`` when
        given); returns the names unregistered (none for a name not registered)."""
        request = pb.UnregisterSharedMemoryRequest(name=name, kind=regions.kind_enum(kind))
        return self._call("UnregisterSharedMemory", request, timeout, regions.unregister_result)


class Client(_Methods):
    """Blocking client; a context manager that closes its channel.

    >>> with Client("127.0.0.1:50051") as client:                  # doctest: +SKIP
    ...     result = client.sample(np.random.randn(2, 32000).astype(np.float32), top_p=0.9)
    ...     result.token_ids, result.seeds

    ``timeout`` is the default per-call deadline in seconds (None: none), overridden by each
    method's ``timeout=``. TLS: ``root_certificates`` (PEM bytes or a path) to verify the server,
    plus ``certificate_chain`` and ``private_key`` for mutual TLS. ``token`` is sent as
    ``authorization: Bearer <token>``. ``options`` are extra gRPC channel options.
    """

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, root_certificates=None,
                 certificate_chain=None, private_key=None, token: str | None = None, options=()):
        super().__init__(timeout, retries, token)
        self.target = target
        self._channel = _channel(grpc, target, root_certificates=root_certificates,
                                 certificate_chain=certificate_chain, private_key=private_key, options=options)
        self._stub = pb_grpc.LogitServeStub(self._channel)
        self._shm_stub = pb_grpc.SharedMemoryStub(self._channel)

    def _call(self, rpc: str, request, timeout, parse):
        method = self._rpc(rpc)
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
        """One :class:`StepResult` per step of ``steps`` (dicts of :meth:`step`'s arguments, or
        StepRequests), in order, over one stream. ``steps`` is read as the stream goes: a
        generator can make each step from the previous results (feed it through a queue).
        An error ends the stream and raises :class:`LogitServeError`; streams are not retried."""
        deadline = self._deadline(timeout)
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call = self._stub.StreamSteps((messages.as_step_request(s) for s in steps), timeout=remaining,
                                      metadata=self._metadata)
        try:
            for response in call:
                yield messages.step_result(response)
        except grpc.RpcError as exc:
            raise LogitServeError.from_rpc_error(exc) from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Methods):
    """asyncio client, with :class:`Client`'s arguments; every method is awaited.

    >>> async with AsyncClient("127.0.0.1:50051") as client:       # doctest: +SKIP
    ...     result = await client.sample(logits, temperature=0.7)
    """

    def __init__(self, target: str, *, timeout: float | None = None, retries: int = 3, root_certificates=None,
                 certificate_chain=None, private_key=None, token: str | None = None, options=()):
        super().__init__(timeout, retries, token)
        self.target = target
        self._channel = _channel(grpc.aio, target, root_certificates=root_certificates,
                                 certificate_chain=certificate_chain, private_key=private_key, options=options)
        self._stub = pb_grpc.LogitServeStub(self._channel)
        self._shm_stub = pb_grpc.SharedMemoryStub(self._channel)

    def _call(self, rpc: str, request, timeout, parse):
        return self._acall(self._rpc(rpc), request, self._deadline(timeout), parse)

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

        async def requests():
            if hasattr(steps, "__aiter__"):
                async for s in steps:
                    yield messages.as_step_request(s)
            else:
                for s in steps:
                    yield messages.as_step_request(s)

        deadline = self._deadline(timeout)
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call = self._stub.StreamSteps(requests(), timeout=remaining, metadata=self._metadata)
        try:
            async for response in call:
                yield messages.step_result(response)
        except grpc.RpcError as exc:
            raise LogitServeError.from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
