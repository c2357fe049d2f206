"""Issue 32, item 5: a refused request is freed as its handler returns, not at the next garbage
collection. gRPC keeps an abort's error on the call's state, and an asyncio future the error it
failed with; with their tracebacks (the handler's frames, whose locals hold the request, and
the context, which holds that state; the frame that awaited the future) every refused request
sat in a reference cycle: five refused 32 MB Samples held +215 MiB of the server's RSS, five
refused 32 MB processor lists +655 MiB. The server here runs as it normally does, automatic
garbage collection on: an idle one freed the cycles every ten or so calls.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.server.process import ServerProcess
from logitserve.v1 import logitserve_pb2 as pb

MIB = 1 << 20
REQUEST_MIB = 24  # each refused request's tensor bytes
REFUSED = 12  # requests refused per case
WARM_UP = 6  # refused before them: the RSS they leave is the baseline
MAX_ROWS = 4
# How far the RSS may swing between its least and its most, before and after each refused
# request: a request or two in flight and gRPC's buffers (up to 60 MiB seen). The cycles held
# every request until the next young-generation collection, which an idle server runs every
# ten or so of them: the RSS climbed a request a call, then fell (swings of 200 to 800 MiB
# here on 4d75e10's guard).
BOUND_MIB = 4 * REQUEST_MIB


def _tensor(array: np.ndarray) -> pb.Tensor:
    dtypes = {np.dtype(np.float32): pb.DTYPE_FLOAT32, np.dtype(np.int64): pb.DTYPE_INT64}
    return pb.Tensor(dtype=dtypes[array.dtype], shape=list(array.shape), data=array.tobytes())


def _logits(rows: int) -> np.ndarray:
    return np.zeros((rows, REQUEST_MIB * MIB // 4 // rows), np.float32)


def _bad_top_p() -> bytes:
    return pb.SampleRequest(logits=_tensor(_logits(MAX_ROWS)), top_p=2.0).SerializeToString()


def _bad_list() -> bytes:
    """A banned-token list of REQUEST_MIB whose last id is past the vocabulary."""
    ids = np.zeros(REQUEST_MIB * MIB // 8, np.int64)
    ids[-1] = 10**6
    return pb.SampleRequest(logits=_tensor(np.zeros((1, 1000), np.float32)), banned_token_ids=_tensor(ids),
                            banned_offsets=_tensor(np.array([0, ids.size], np.int64))).SerializeToString()


def _too_many_rows() -> bytes:
    return pb.SampleRequest(logits=_tensor(_logits(2 * MAX_ROWS))).SerializeToString()


def _unknown_model() -> bytes:
    """A ModelInfer for a model that does not exist (NOT_FOUND)."""
    x = kpb.ModelInferRequest.InferInputTensor(name="X", datatype="FP32", shape=[REQUEST_MIB * MIB // 4])
    return kpb.ModelInferRequest(model_name="no-such-model", inputs=[x],
                                 raw_input_contents=[bytes(REQUEST_MIB * MIB)]).SerializeToString()


def _long_region_name() -> bytes:
    """A region registration whose name is REQUEST_MIB long: the SharedMemory handler aborts
    INVALID_ARGUMENT itself (regions_servicer), the guard gets gRPC's abort error."""
    return pb.RegisterSystemSharedMemoryRequest(name="n" * (REQUEST_MIB * MIB), key="k",
                                                byte_size=64).SerializeToString()


CASES = {
    "top_p out of range": ("/logitserve.v1.LogitServe/Sample", _bad_top_p, grpc.StatusCode.INVALID_ARGUMENT),
    "banned id out of range": ("/logitserve.v1.LogitServe/Sample", _bad_list, grpc.StatusCode.INVALID_ARGUMENT),
    "rows over --max-rows": ("/logitserve.v1.LogitServe/Sample", _too_many_rows,
                             grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unknown model": ("/inference.GRPCInferenceService/ModelInfer", _unknown_model, grpc.StatusCode.NOT_FOUND),
    "region name too long": ("/logitserve.v1.SharedMemory/RegisterSystemSharedMemory", _long_region_name,
                             grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.fixture(scope="module")
def server():
    """One server for every case, its garbage collection as always. glibc's allocator is told
    to map every block over 1 MiB on its own (by default it raises that threshold up to 32 MiB
    as blocks are freed, and keeps the freed blocks under it in its heap): the RSS is then the
    bytes alive, and memory one case freed cannot take the next case's requests unseen."""
    with ServerProcess("--max-message-bytes", str(64 * MIB), "--max-rows", str(MAX_ROWS),
                       "--max-vocab", str(REQUEST_MIB * MIB // 4), "--warmup-dtypes", "none",
                       "--busy-poll-us", "0", env={"MALLOC_MMAP_THRESHOLD_": str(MIB)}) as server:
        yield server


def _rss_mib(server) -> float:
    time.sleep(0.05)  # the call's handler returns just after its status is sent
    return server.rss_kib() / 1024


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_requests_are_freed_at_once(server, case):
    path, make, code = CASES[case]
    request = make()
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 * MIB)]) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)

        def refused() -> grpc.StatusCode:
            try:
                call(request, timeout=60)
            except grpc.RpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        assert {refused() for _ in range(WARM_UP)} == {code}  # gRPC's buffers, the allocator's arenas
        rss, codes = [_rss_mib(server)], set()
        for _ in range(REFUSED):
            codes.add(refused())
            rss.append(_rss_mib(server))
    swing = max(rss) - min(rss)
    print(f"{case}: RSS before and after each of {REFUSED} refused {REQUEST_MIB} MiB requests, MiB over the "
          f"least: {' '.join(f'{r - min(rss):.0f}' for r in rss)}")
    assert codes == {code}
    assert swing < BOUND_MIB, f"{case}: RSS swung by {swing:.0f} MiB over {REFUSED} refused {REQUEST_MIB} MiB requests"
