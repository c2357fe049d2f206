"""The service benchmarks' requests: Sample and RouteExperts payloads, serialized ahead of timing.

A :class:`Payload` is a pool of distinct requests, cycled through, already serialized: a load
generator sends raw bytes, so what it times is the server plus the transport, not the client's
protobuf work. Sample requests vary temperature, top_k, top_p and seed from call to call, so
batched rows carry mixed parameters. :func:`check_response` parses one answer: a benchmark of
failing calls measures nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

SERVICE = "/logitserve.v1.LogitServe/"
POOL = 16  # distinct requests per payload, cycled through


def _bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2").tobytes()


def _tensor(x: np.ndarray, dtype: str) -> pb.Tensor:
    if dtype == "bf16":
        return pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=x.shape, data=_bf16_bytes(x))
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.astype("<f4").tobytes())


@dataclasses.dataclass
class Payload:
    name: str
    method: str  # full gRPC method path
    requests: list[bytes]  # serialized, cycled through
    response_type: type

    @property
    def request_bytes(self) -> int:
        return len(self.requests[0])


def sample_payload(vocab: int, dtype: str, rng: np.random.Generator) -> Payload:
    """Sample [1, vocab]: every request has its own logits, temperature, top_k, top_p and seed."""
    temperatures = (0.6, 0.7, 0.8, 1.0, 1.2)
    top_ks = (0, 20, 50, 100)
    top_ps = (0.8, 0.9, 0.95, 1.0)
    requests = []
    for i in range(POOL):
        logits = rng.standard_normal((1, vocab), dtype=np.float32) * 3.0
        request = pb.SampleRequest(
            logits=_tensor(logits, dtype),
            temperature=temperatures[i % len(temperatures)],
            top_k=top_ks[i % len(top_ks)],
            top_p=top_ps[(i // 2) % len(top_ps)],
            seed=1000 + i,
        )
        requests.append(request.SerializeToString())
    return Payload(f"Sample 1x{vocab} {dtype}", SERVICE + "Sample", requests, pb.SampleResponse)


def route_payload(tokens: int, experts: int, k: int, rng: np.random.Generator) -> Payload:
    requests = [
        pb.RouteExpertsRequest(
            gate_logits=_tensor(rng.standard_normal((tokens, experts), dtype=np.float32), "bf16"),
            k=k,
            renormalize=bool(i % 2),
        ).SerializeToString()
        for i in range(POOL)
    ]
    return Payload(f"RouteExperts {tokens}x{experts} bf16 k{k}", SERVICE + "RouteExperts", requests,
                   pb.RouteExpertsResponse)


def payloads(seed: int = 0) -> list[Payload]:
    """The service benchmark's payloads: Sample 1x128256 bf16 and f32, RouteExperts 64x256 bf16 k=8."""
    rng = np.random.default_rng(seed)
    return [
        sample_payload(128256, "bf16", rng),
        sample_payload(128256, "f32", rng),
        route_payload(64, 256, 8, rng),
    ]


def check_response(payload: Payload, raw: bytes) -> None:
    """Parse one response and check its shape: a benchmark of failing calls measures nothing."""
    response = payload.response_type.FromString(raw)
    if payload.response_type is pb.SampleResponse:
        ids = np.frombuffer(response.token_ids.data, dtype="<i8")
        if list(response.token_ids.shape) != [1] or ids.size != 1 or not 0 <= ids[0]:
            raise RuntimeError(f"{payload.name}: unexpected response {response}")
    else:
        if list(response.indices.shape)[1:] != [8]:
            raise RuntimeError(f"{payload.name}: unexpected response shape {response.indices.shape}")

