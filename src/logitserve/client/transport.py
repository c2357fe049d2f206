"""What both clients need around a call: the channel, the RPCs' method paths, the timeout
sentinel, the retry backoff (:func:`retry_delay`), parsing an answer and the CUDA synchronization before a call.

Retries are this module's, not gRPC's: the channel's service config sets no retryPolicy (gRPC
itself only retries transparently, a call that never reached a server); :func:`retry_delay`
retries UNAVAILABLE inside the call's deadline, and with round_robin (:mod:`.balancing`) the
retry is picked like any call, onto a server still ready.

:mod:`.client` builds ``Client`` and ``AsyncClient`` on these; nothing here knows the operators.
"""

from __future__ import annotations

import os
import random
import time

import grpc

from logitserve.v1 import logitserve_pb2 as pb

from . import balancing

CLIENT_TIMEOUT = object()  # a method's default timeout: "the client's timeout" (None means no deadline)
# Exponential backoff of UNAVAILABLE retries: 50 ms, 100 ms, 200 ms, ... capped at 2 s, each
# drawn uniformly from [half, full] so clients retrying together spread out.
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0
# No client-side size limit: the server's --max-message-bytes is the one that counts.
DEFAULT_OPTIONS = {"grpc.max_send_message_length": -1, "grpc.max_receive_message_length": -1}


def read_pem(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def open_channel(module, target: str, *, root_certificates, certificate_chain, private_key, options,
                 load_balancing: str = "pick_first"):
    """A channel of ``module`` (``grpc`` or ``grpc.aio``) to ``target``: TLS when certificates are
    given, ``options`` over :data:`DEFAULT_OPTIONS`, the service config with ``load_balancing``'s
    policy (:func:`~.balancing.service_config`: the one place it is built)."""
    opts = {**DEFAULT_OPTIONS, **dict(options)}
    opts["grpc.service_config"] = balancing.service_config(load_balancing, opts)
    if root_certificates is None and certificate_chain is None:
        return module.insecure_channel(target, options=list(opts.items()))
    creds = grpc.ssl_channel_credentials(read_pem(root_certificates), read_pem(private_key),
                                         read_pem(certificate_chain))
    return module.secure_channel(target, creds, options=list(opts.items()))


def synchronize(devices: set[int], stream) -> None:
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


def time_left(deadline: float | None) -> float | None:
    """The seconds left before ``deadline`` (a ``time.monotonic()`` time), at least 0; None for none."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def retry_delay(exc: grpc.RpcError, attempt: int, retries: int, deadline: float | None) -> float | None:
    """Seconds to wait before retrying failed attempt ``attempt`` (from 0) of at most ``retries``
    retries, or None to give up: only UNAVAILABLE is retried, never past ``deadline``."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= retries:
        return None
    delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**attempt) * random.uniform(0.5, 1.0)
    if deadline is not None and time.monotonic() + delay >= deadline:
        return None
    return delay


def parse_as(response_type, convert, after=None):
    """``raw -> convert(response_type.FromString(raw))``, calling ``after(message)`` first."""

    def parse(raw: bytes):
        msg = response_type.FromString(raw)
        if after is not None:
            after(msg)
        return convert(msg)

    return parse


def method_paths() -> dict[str, tuple[str, bool]]:
    """Every RPC's full method path and whether it streams requests (both services)."""
    paths = {}
    for service in (pb.DESCRIPTOR.services_by_name["LogitServe"], pb.DESCRIPTOR.services_by_name["SharedMemory"]):
        for method in service.methods:
            paths[method.name] = (f"/{service.full_name}/{method.name}", method.client_streaming)
    return paths


METHOD_PATHS = method_paths()
