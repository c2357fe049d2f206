"""What the channel tests share: a raw caller of a same-host channel (its own iceoryx2 ports,
any bytes as a request, as a C++ frontend or a misbehaving caller would send), OpenChannel and
CloseChannel over plain gRPC, and a field-by-field comparison of the client's results.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time

import grpc
import numpy as np

from logitserve.v1 import channel_format as fmt
from logitserve.v1 import logitserve_pb2 as pb

SERVICE = "/logitserve.v1.LogitServe/"


def bearer(token: str | None) -> tuple:
    return () if token is None else (("authorization", f"Bearer {token}"),)


def open_channel(target: str, token: str | None = None) -> pb.OpenChannelResponse:
    """OpenChannel over gRPC, under ``token``; raises grpc.RpcError."""
    with grpc.insecure_channel(target) as ch:
        rpc = ch.unary_unary(SERVICE + "OpenChannel", request_serializer=pb.OpenChannelRequest.SerializeToString,
                             response_deserializer=pb.OpenChannelResponse.FromString)
        return rpc(pb.OpenChannelRequest(), timeout=10, metadata=bearer(token))


def close_channel(target: str, key: bytes, token: str | None = None) -> bool:
    """CloseChannel over gRPC, under ``token``: whether a channel was closed."""
    with grpc.insecure_channel(target) as ch:
        rpc = ch.unary_unary(SERVICE + "CloseChannel", request_serializer=pb.CloseChannelRequest.SerializeToString,
                             response_deserializer=pb.CloseChannelResponse.FromString)
        return rpc(pb.CloseChannelRequest(key=key), timeout=10, metadata=bearer(token)).closed


def grpc_raw(target: str, rpc: str, data: bytes, token: str | None = None):
    """``(code, details)`` of a gRPC call with ``data`` as its request bytes."""
    with grpc.insecure_channel(target) as ch:
        method = ch.unary_unary(SERVICE + rpc, request_serializer=None, response_deserializer=None)
        try:
            method(data, timeout=10, metadata=bearer(token))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""


class RawChannel:
    """Ports on the channel service an OpenChannelResponse names, sending whatever bytes it is
    given; answers are polled for (the server wakes only callers whose key it knows)."""

    def __init__(self, opened: pb.OpenChannelResponse):
        import iceoryx2 as iox2

        iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
        self.opened = opened
        self.key = opened.key
        self._node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
        byte_slice = iox2.Slice[ctypes.c_uint8]
        self._calls = (self._node.service_builder(iox2.ServiceName.new(opened.service_name))
                       .request_response(byte_slice, byte_slice).open())
        self._client = (self._calls.client_builder().initial_max_slice_len(64 * 1024)
                        .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo).create())
        self._wake_service = self._node.service_builder(iox2.ServiceName.new(opened.server_event)).event().open()
        self._wake = self._wake_service.notifier_builder().create()

    def send_bytes(self, data: bytes, timeout: float = 10.0) -> tuple[int, str, str, bytes]:
        """``(code, request id, details, response message)`` of the answer to ``data``."""
        out = self._client.loan_slice_uninit(len(data))
        ctypes.memmove(out.payload().data_ptr, data, len(data))
        pending = out.assume_init().send()
        self._wake.notify()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                response = pending.receive()
                if response is not None:
                    payload = response.payload()
                    answer = ctypes.string_at(payload.data_ptr, payload.number_of_elements)
                    response.delete()
                    code, request_id, details, message = fmt.read_answer(answer)
                    return code, request_id, details, bytes(message)
                time.sleep(0.001)
            raise TimeoutError(f"no answer within {timeout} s")
        finally:
            pending.delete()

    def call(self, method: str | int, message: bytes, *, key: bytes | None = None, request_id: bytes = b"",
             timeout_us: int = 0) -> tuple[grpc.StatusCode, str, str, bytes]:
        number = fmt.METHOD_NUMBERS[method] if isinstance(method, str) else method
        data = fmt.request(self.key if key is None else key, number, request_id, timeout_us, message)
        code, request_id, details, body = self.send_bytes(data)
        return _CODES[code], request_id, details, body


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def assert_same(a, b, path: str = "result") -> None:
    """``a`` and ``b`` equal field by field: dataclasses, tuples, lists, dicts, numpy arrays
    (same dtype, shape and values, NaN equal to NaN)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: ndarray vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
