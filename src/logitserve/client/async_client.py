"""``AsyncClient``: :class:`~.client.Client` for asyncio, with its arguments and methods, each
awaited: how a call is made and retried, the stream of steps and closing, as coroutines."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import AsyncIterator

import grpc

from .construction import CLOSE_TIMEOUT_S, server_gone
from .devices import DeviceRouting
from .errors import LogitServeError
from .operators import OperatorMethods
from .region_table import Registrations
from .results import StepResult
from .retrying import after_failure
from .same_host import ChannelError, closing_calls
from .transport import CLIENT_TIMEOUT, time_left


class AsyncClient(DeviceRouting, OperatorMethods):
    """asyncio client, with :class:`~.client.Client`'s arguments (``retries``,
    ``wait_for_ready``, ``channel`` ... and its ordering and closing rules); every method is
    awaited. The CUDA stream synchronization before a call blocks the event loop for as long as
    the stream's pending work takes.

    >>> async with AsyncClient("127.0.0.1:50051") as client:       # doctest: +SKIP
    ...     result = await client.sample(logits, temperature=0.7)
    """

    _grpc = grpc.aio

    def _call(self, rpc: str, request: bytes, timeout, parse, on_error=None, *, idempotent: bool = True,
              wait_for_ready: bool | None = None):
        return self._acall(self._plan(rpc, idempotent, wait_for_ready), request, self._deadline(timeout), parse,
                           on_error)

    async def _acall(self, plan, request: bytes, deadline, parse, on_error):
        method, kwargs, retries, wait_for_channel = plan
        attempt = 0
        while True:
            try:
                if wait_for_channel and not self._same_host.is_open:
                    await self._channel_ready(deadline)
                return parse(await method(request, timeout=time_left(deadline), metadata=self._metadata, **kwargs))
            except grpc.RpcError as exc:
                outcome = after_failure(exc, attempt, retries, deadline)
                if isinstance(outcome, LogitServeError):
                    raise (outcome if on_error is None else on_error(outcome)) from None
            await asyncio.sleep(outcome)
            attempt += 1

    async def _channel_ready(self, deadline: float | None) -> None:
        """Wait for the gRPC channel to be ready (wait_for_ready before the same-host channel opens)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), time_left(deadline))
        except asyncio.TimeoutError:
            raise ChannelError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded waiting for the server "
                                                                  "(wait_for_ready)") from None

    def _call_each(self, calls, combine, wait_for_ready: bool | None = None):
        async def each():
            return combine([await self._call(*call, wait_for_ready=wait_for_ready) for call in calls])

        return each()

    async def stream_steps(self, steps, *, timeout=CLIENT_TIMEOUT,
                           wait_for_ready: bool | None = None) -> AsyncIterator[StepResult]:
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

        method, kwargs, _, _ = self._plan("StreamSteps", False, wait_for_ready)
        deadline = self._deadline(timeout)
        call = method(requests(), timeout=time_left(deadline), metadata=self._metadata, **kwargs)
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
        gone = False
        for rpc, request in closing_calls(self._same_host, self._unregister_requests()):
            if gone:
                continue  # the generator still runs to its end: it drops the same-host channel's ports
            try:
                await self._methods[rpc](request, timeout=max(deadline - time.monotonic(), 0.01),
                                         metadata=self._metadata, wait_for_ready=False)
            except Exception as exc:  # noqa: BLE001 - best effort: close never raises
                gone = server_gone(exc)
        self._regions.remove(names)
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
