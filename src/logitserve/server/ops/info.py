"""GetServerInfo's answer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from logitserve.v1 import logitserve_pb2 as pb

from ..tensors import FLOATS, PB_DTYPES


@dataclass
class ServerInfo:
    """What GetServerInfo answers: the server's version, device, backend, dtypes, limits, counters.
    The sequences' counters (``stats``' ``open_sequences``, ``sequence_bytes``) are the calling
    caller's alone: another token's sequences are none of its business (all callers' figures are
    in /metrics)."""

    version: str
    device: str
    device_name: str
    backend: str
    warmed_dtypes: list[torch.dtype]
    limits: dict[str, int]
    stats: dict[str, int]
    # Under --devices: every device's process, (device, address), in device order.
    device_endpoints: list[tuple[str, str]] = field(default_factory=list)

    def to_pb(self) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            version=self.version, device=self.device, device_name=self.device_name, backend=self.backend,
            dtypes=[PB_DTYPES[d] for d in FLOATS], warmed_dtypes=[PB_DTYPES[d] for d in self.warmed_dtypes],
            limits=pb.Limits(**self.limits), stats=pb.ServerStats(**self.stats),
            device_endpoints=[pb.DeviceEndpoint(device=d, address=a) for d, a in self.device_endpoints])
