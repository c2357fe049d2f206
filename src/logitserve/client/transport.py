"""What both clients need around a call: the channel, the RPCs' method paths, the timeout
sentinel, parsing an answer and the CUDA synchronization before a call.

:mod:`.construction` opens the channel with the options it composes (the load-balancing policy
of :mod:`.balancing`, the retry policy of :mod:`.retries`); nothing here knows the operators.
"""

from __future__ import annotations

import os
import time

import grpc

from logitserve.v1 import logitserve_pb2 as pb

CLIENT_TIMEOUT = object()  # a method's default timeout: "the client's timeout" (None means no deadline)
# No client-side size limit: the server's --max-message-bytes is the one that counts.
DEFAULT_OPTIONS = {"grpc.max_send_message_length": -1, "grpc.max_receive_message_length": -1}


def read_pem(value: bytes | str | os.PathLike | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def open_channel(module, target: str, options: dict, *, root_certificates, certificate_chain, private_key):
    """A channel of ``module`` (``grpc`` or ``grpc.aio``) to ``target`` with channel ``options``
    (over :data:`DEFAULT_OPTIONS`); TLS when certificates are given."""
    opts = list({**DEFAULT_OPTIONS, **options}.items())
    if root_certificates is None and certificate_chain is None:
        return module.insecure_channel(target, options=opts)
    creds = grpc.ssl_channel_credentials(read_pem(root_certificates), read_pem(private_key),
                                         read_pem(certificate_chain))
    return module.secure_channel(target, creds, options=opts)


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


def parse_as(response_type, convert, after=None):
    """``raw -> convert(response_type.FromString(raw))``, calling ``after(message)`` first."""

    def parse(raw: bytes):
        msg = response_type.FromString(raw)
        if after is not None:
            after(msg)
        return convert(msg)

    return parse


def method_paths() -> dict[str, tuple[str, bool]]:
    """Every RPC's full method path and whether it streams requests (both services); not
    OrderedSession, a stream of answers only, whose call client/ordered.py makes itself (and
    which is never retried: a second attempt would open a second session)."""
    paths = {}
    for service in (pb.DESCRIPTOR.services_by_name["LogitServe"], pb.DESCRIPTOR.services_by_name["SharedMemory"]):
        for method in service.methods:
            if method.server_streaming and not method.client_streaming:
                continue
            paths[method.name] = (f"/{service.full_name}/{method.name}", method.client_streaming)
    return paths


METHOD_PATHS = method_paths()
