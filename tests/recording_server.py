"""A fake gRPC server for the client tests: it records every call's method and raw request bytes
and answers with outputs of the right shapes (tests/test_client_bytes.py, test_client_regions.py).
"""

from __future__ import annotations

import contextlib
from concurrent import futures

import grpc
import numpy as np

from logitserve.client import codec, messages
from logitserve.v1 import logitserve_pb2 as pb


class Recorder(grpc.GenericRpcHandler):
    """Every call's method and raw request bytes; answers each LogitServe call with outputs of
    the right shapes (zeros, or a region reference for each output_regions entry), and each
    SharedMemory call with an empty answer (``fail_unregister``: UNAVAILABLE instead)."""

    def __init__(self):
        self.calls: list[tuple[str, bytes]] = []
        self.fail_unregister = False

    def service(self, details):
        method = details.method.rsplit("/", 1)[1]

        def answer(raw, context):
            self.calls.append((method, raw))
            if method == "UnregisterSharedMemory":
                if self.fail_unregister:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "down")
                return pb.UnregisterSharedMemoryResponse(
                    names=[pb.UnregisterSharedMemoryRequest.FromString(raw).name]).SerializeToString()
            if method.startswith("Register"):
                return b""
            return fake_answer(method, raw)

        if method == "StreamSteps":
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: (answer(r, ctx) for r in it))
        return grpc.unary_unary_rpc_method_handler(answer)

    def requests(self, method):
        return [raw for m, raw in self.calls if m == method]


def filled(shape, dtype, ref=None):
    if ref is not None and ref.region:
        return pb.Tensor(dtype=dtype, shape=shape, region=ref)
    size = int(np.prod(shape)) * codec.ITEMSIZE[dtype]
    return pb.Tensor(dtype=dtype, shape=shape, data=b"\x01" * size if dtype == pb.DTYPE_BOOL else b"\0" * size)


def fake_op(request):
    regions_ = request.output_regions
    if isinstance(request, pb.SampleRequest):
        b = [request.logits.shape[0]]
        return pb.SampleResponse(**{n: filled(b, d, regions_.get(n)) for n, d in (
            ("token_ids", pb.DTYPE_INT64), ("seeds", pb.DTYPE_INT64), ("valid", pb.DTYPE_BOOL))})
    if isinstance(request, pb.RouteExpertsRequest):
        s = [request.gate_logits.shape[0], request.k]
        return pb.RouteExpertsResponse(weights=filled(s, pb.DTYPE_FLOAT32, regions_.get("weights")),
                                       indices=filled(s, pb.DTYPE_INT32, regions_.get("indices")))
    shape = list(np.broadcast_shapes(tuple(request.x.shape), tuple(request.up.shape))) \
        if isinstance(request, pb.SiluRequest) and request.HasField("up") else list(request.x.shape)
    response = {pb.SoftmaxRequest: pb.SoftmaxResponse, pb.CausalSoftmaxRequest: pb.CausalSoftmaxResponse,
                pb.SiluRequest: pb.SiluResponse}[type(request)]
    return response(out=filled(shape, request.x.dtype, regions_.get("out")))


def fake_answer(method, raw) -> bytes:
    if method in ("Step", "StreamSteps"):
        request = pb.StepRequest.FromString(raw)
        answer = pb.StepResponse(id=request.id)
        for slot in messages.STEP_OPS[:5]:
            if request.HasField(slot):
                getattr(answer, slot).CopyFrom(fake_op(getattr(request, slot)))
        return answer.SerializeToString()
    kind = {"Sample": pb.SampleRequest, "RouteExperts": pb.RouteExpertsRequest, "Softmax": pb.SoftmaxRequest,
            "CausalSoftmax": pb.CausalSoftmaxRequest, "Silu": pb.SiluRequest}[method]
    return fake_op(kind.FromString(raw)).SerializeToString()


@contextlib.contextmanager
def recording_server():
    """A :class:`Recorder` serving on a free local port (its ``target``) until the block ends."""
    handler = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    handler.target = f"127.0.0.1:{port}"
    try:
        yield handler
    finally:
        server.stop(0)
