"""Calls ordered on the GPU: a stream-ordered session (``client.ordered_session()``).

    session = client.ordered_session()
    for n in range(steps):
        forward(tokens)                                       # enqueued on `stream`: writes logits
        step = session.sample(logits, out={"token_ids": tokens}, stream=stream, seed=seeds, step=n)
        # returns once the server has enqueued the draw; `stream`'s next work waits for it on the GPU
    step.result()                                             # the host's values, when it wants them
    session.close()

Instead of synchronizing its stream before each call, the client writes the step's mark into the
session's ``ready`` word on ``stream`` (after the logits' producer), sends the call, and has
``stream`` wait until the server has written ``done`` for that mark (``cuStreamWriteValue64`` /
``cuStreamWaitValue64``, cuda.bindings). The server's stream waits on the GPU for ``ready``, so
neither side's host waits for the other's device: the draw runs right after the forward, and the
next forward right after the draw. The logits and every output must be CUDA regions registered
through this client (``register_cuda``). docs/SERVICE.md, "Calls ordered on the GPU", gives the
protocol for engines in other languages.

The session is the OrderedSession call: it lives until :meth:`OrderedSession.close` (or the
process's end), and the server ends it when a step waits longer than ``wait_timeout_s`` for its
mark. A step the device could not run as asked is reported by :meth:`OrderedStep.result`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import messages
from .errors import LogitServeError
from .regions import _cuda_bindings
from .transport import CLIENT_TIMEOUT

PATH = "/logitserve.v1.LogitServe/OrderedSession"  # not in transport.METHOD_PATHS: see there
READY, DONE, ENDED = 0, 1, 2
# How long result() waits for the session's `ended` event once the marks say it ended.
ENDED_EVENT_S = 5.0


def _check(result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


class OrderedSession:
    """A stream-ordered session of ``client`` (made by ``Client.ordered_session``)."""

    def __init__(self, client, wait_timeout_s: float = 0.0, max_steps_ahead: int = 0, owned_regions=()):
        import torch

        self._client = client
        owned = [client._regions.server_name(name) for name in owned_regions]
        registered = client._regions.registrations()
        self._owned = {name: registered[name] for name in owned if name in registered}  # with their serials
        method = client._channel.unary_stream(PATH, request_serializer=pb.OrderedSessionRequest.SerializeToString,
                                              response_deserializer=pb.OrderedSessionEvent.FromString)
        self._call = method(pb.OrderedSessionRequest(wait_timeout_s=wait_timeout_s, max_steps_ahead=max_steps_ahead,
                                                     owned_regions=owned), metadata=client._metadata)
        try:
            first = next(self._call)
        except grpc.RpcError as exc:
            raise LogitServeError.from_rpc_error(exc) from None
        opened = first.opened
        self.id, self.device = opened.session_id, torch.device("cuda", opened.device_id)
        self.wait_timeout_s, self.max_steps_ahead = opened.wait_timeout_s, opened.max_steps_ahead
        try:
            runtime, self._driver = _cuda_bindings()
            handle = runtime.cudaIpcMemHandle_t()
            handle.reserved = opened.marks_handle
            with torch.cuda.device(self.device):
                self._base = int(_check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess),
                                        "cudaIpcOpenMemHandle"))
        except BaseException:
            self._call.cancel()  # the session ends with its call: nothing of it is left on the server
            raise
        self._words = self._base + opened.marks_offset
        self._next_mark = 1
        # The calls serving this session's marks: (first mark, the mark after its repetitions,
        # outputs, seeds answered), in the order sent; a later one takes over from its first mark.
        self._standing: list[tuple[int, int, dict, np.ndarray | None]] = []
        self._streams: dict[int, object] = {}  # every stream that waits on the marks, by handle
        self._failed: dict[int, pb.OrderedStepFailed] = {}
        self.ended: pb.OrderedSessionEnded | None = None
        self._ended = threading.Event()
        self._reader = threading.Thread(target=self._read_events, name=f"logitserve-ordered-{self.id}", daemon=True)
        self._reader.start()
        self._closed = False

    def _read_events(self) -> None:
        try:
            for event in self._call:
                if event.HasField("failed"):
                    self._failed[event.failed.mark] = event.failed
                elif event.HasField("ended"):
                    self.ended = event.ended
        except grpc.RpcError as exc:
            if self.ended is None:
                self.ended = pb.OrderedSessionEnded(reason=f"the OrderedSession call ended: {exc.code().name}")
        finally:
            self._ended.set()

    def _stream_op(self, stream, word: int, mark: int, wait: bool) -> None:
        d = self._driver
        address, handle = d.CUdeviceptr(self._words + 8 * word), d.CUstream(stream.cuda_stream)
        if wait:
            _check(d.cuStreamWaitValue64(handle, address, mark, d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                   "cuStreamWaitValue64")
        else:
            _check(d.cuStreamWriteValue64(handle, address, mark,
                                          d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
                   "cuStreamWriteValue64")

    def sample(self, logits, *, out, stream=None, repeat: int = 1, mark: int | None = None, timeout=CLIENT_TIMEOUT,
               **params) -> "OrderedStep":
        """``Client.sample``'s call ordered on ``stream`` (default: the logits' device's current
        stream): the logits are read once the work enqueued on ``stream`` before this call is
        done, and the work enqueued on it after this call runs once the outputs are written.
        ``out``: ``token_ids`` (required) and optionally ``seeds``, ``valid``, registered CUDA
        tensors. ``params``: ``Client.sample``'s sampling parameters (scalars, or per-row arrays
        on the host). Returns an :class:`OrderedStep` once the server has enqueued the work.

        ``repeat``: the call serves this many steps, the k-th with ``step`` + k; the steps after
        the first are :meth:`step`'s, with no call to the server. ``mark``: the step this call
        starts at (default: the next); a later call may replace the remaining repetitions from a
        mark the server has not enqueued yet (it enqueues at most ``max_steps_ahead`` unfinished
        steps), the steps before it still :meth:`step`'s."""
        import torch

        self._check_open()
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        client = self._client
        enc = client._encoder()
        msg = messages.build_sample(enc, (), logits, out=out, **params)
        mark = self._next_mark if mark is None else mark
        if mark < self._next_mark:
            raise ValueError(f"mark: {mark}, but this session's stream has reached mark {self._next_mark}")
        msg.ordered.session_id, msg.ordered.mark, msg.ordered.repeat = self.id, mark, repeat
        now = mark == self._next_mark  # else a call ahead: its first step is step()'s when the stream gets there
        if now:
            self._streams[stream.cuda_stream] = stream
            self._stream_op(stream, READY, mark, wait=False)  # after the logits' producer, on its stream
        answer = client._call("Sample", enc.serialize(msg), timeout, pb.SampleResponse.FromString, idempotent=False)
        seeds = np.frombuffer(answer.seeds.data, dtype="<i8") if answer.seeds.data else None
        self._standing = [s for s in self._standing if s[0] < mark] + [(mark, mark + max(repeat, 1),
                                                                          dict(enc.outputs), seeds)]
        return self._after_ready(stream, mark) if now else OrderedStep(self, mark, None, dict(enc.outputs), seeds)

    def step(self, stream=None) -> "OrderedStep":
        """The next step of a call serving several (``sample(repeat=)``), with no call to the
        server: its ready mark written on ``stream`` (after the logits' producer), the stream's
        next work held until its outputs are written."""
        import torch

        self._check_open()
        if self._serving(self._next_mark) is None:
            raise ValueError(f"step: no call serves mark {self._next_mark}; send one (sample)")
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        self._streams[stream.cuda_stream] = stream
        mark = self._next_mark
        self._stream_op(stream, READY, mark, wait=False)
        return self._after_ready(stream, mark)

    def _serving(self, mark: int):
        """The call serving ``mark``: ``(first, end, outputs, seeds)``, the latest to start at or before it."""
        found = [s for s in self._standing if s[0] <= mark < s[1]]
        return found[-1] if found else None

    def _after_ready(self, stream, mark: int) -> "OrderedStep":
        import torch

        self._stream_op(stream, DONE, mark, wait=True)  # the stream's next work waits for the outputs
        self._next_mark = mark + 1
        done = torch.cuda.Event()
        done.record(stream)
        _, _, outputs, seeds = self._serving(mark)
        self._standing = [s for s in self._standing if s[1] > self._next_mark]
        return OrderedStep(self, mark, done, outputs, seeds)

    def _check_open(self) -> None:
        if self._closed or self.ended is not None:
            raise LogitServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"ordered session {self.id} ended: {self._ended_reason()}")

    def _ended_reason(self) -> str:
        return self.ended.reason if self.ended is not None else "closed"

    def failure(self, mark: int) -> pb.OrderedStepFailed | None:
        """What the server reported of step ``mark`` after its call returned (None: nothing so
        far). A logits processor field in a CUDA region that broke its rule is reported within
        milliseconds of the step's end, so a step read at once may show it only later."""
        return self._failed.get(mark)

    def check(self, mark: int) -> None:
        """``LogitServeError`` if step ``mark`` did not run as asked (after the device passed it)."""
        if mark in self._failed:
            failed = self._failed[mark]
            raise LogitServeError(grpc.StatusCode(_code(failed.code)), failed.message)
        if not self._ended_word():
            return
        self._ended.wait(ENDED_EVENT_S)
        broken = self.ended.first_broken_mark if self.ended is not None else 1
        if broken and mark >= broken:
            raise LogitServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"ordered session {self.id} ended before mark {mark} ran: {self._ended_reason()}")

    def _ended_word(self) -> bool:
        """The marks' ``ended`` word, read from the device (after the step's event has passed)."""
        value = np.zeros(1, dtype=np.int64)
        _check(self._driver.cuMemcpyDtoH(value.ctypes.data, self._words + 8 * ENDED, 8), "cuMemcpyDtoH")
        return bool(value[0])

    def close(self) -> None:
        """End the session. This side's streams are synchronized first (every step was given its
        ready mark, so the server finishes them, or its wait limit releases them), then the marks
        are unmapped, then the call is cancelled: the server frees the marks only after that, so
        no wait of this process reads them freed."""
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.synchronize()
        runtime, _ = _cuda_bindings()
        runtime.cudaIpcCloseMemHandle(self._base)
        self._call.cancel()
        self._reader.join()
        self._client._regions.drop(self._owned)  # the server unregistered them as the call ended

    def __enter__(self) -> "OrderedSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _code(value: int) -> tuple:
    return next((c.value for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN.value)


@dataclass
class OrderedStep:
    """One enqueued call of a session: its mark, and its values when the host asks."""

    session: OrderedSession
    mark: int
    done: object  # a CUDA event on the caller's stream, after its wait for the step's outputs (None: sent ahead)
    outputs: dict
    seeds: np.ndarray | None

    def result(self):
        """Wait for the step on the host; its ``SampleResult`` read from the output regions.
        ``LogitServeError`` when the session ended before the step ran as asked. (A call sent
        ahead of its mark has no result: its steps are :meth:`OrderedSession.step`'s.)"""
        from .results import SampleResult

        if self.done is None:
            raise ValueError(f"result: mark {self.mark}'s call was sent ahead of it; its steps are session.step()'s")
        self.done.synchronize()
        self.session.check(self.mark)
        tokens = _host_array(self._output("token_ids"))
        valid = tokens >= 0
        seeds = self.seeds if self.seeds is not None else _host_array(self._output("seeds"))
        return SampleResult(token_ids=tokens, seeds=seeds, valid=valid)

    def _output(self, name: str):
        return next(value for path, value in self.outputs.items() if path[-1] == name)


def _host_array(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()
