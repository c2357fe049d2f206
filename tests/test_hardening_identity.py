"""Issue 32, item 2: one call, one identity. The token check read the last ``authorization``
header and the owner of a region the first, so ``[Bearer made-up, Bearer A]`` passed A's token
check and registered a region under "made-up". Every guarded call with more than one
``authorization`` header is now UNAUTHENTICATED, tokens on or off, on logitserve.v1, the
SharedMemory service and the KServe front alike; health checks stay exempt (they name no one).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from logitserve.client import messages
from logitserve.client.keys import key_prefix
from logitserve.client.regions import shared_array
from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.server import ServerConfig
from logitserve.server.errors import Unauthenticated
from logitserve.server.identity import authorization_of
from logitserve.server.regions import owner_of
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb

TOKEN = "tok-identity-7c1e"
GOOD = f"Bearer {TOKEN}"
MADE_UP = "Bearer made-up"
TWO_HEADERS = {"made-up first": (MADE_UP, GOOD), "made-up last": (GOOD, MADE_UP)}
RULE = "authorization: one header per call, got 2"
X = np.array([[1.0, 2.0, 3.0]], np.float32)
V1 = "/logitserve.v1.LogitServe/"
SHM = "/logitserve.v1.SharedMemory/"
KSERVE = "/inference.GRPCInferenceService/"
REGION_BYTES = 64


def _infer_request() -> kpb.ModelInferRequest:
    x = kpb.ModelInferRequest.InferInputTensor(name="X", datatype="FP32", shape=list(X.shape))
    return kpb.ModelInferRequest(model_name="softmax", inputs=[x], raw_input_contents=[X.tobytes()])


# Each call that names or needs an identity: (method path, its request for a region name and key).
CALLS = {
    "RegisterSystemSharedMemory": (SHM + "RegisterSystemSharedMemory", lambda name, key: pb.RegisterSystemSharedMemoryRequest(
        name=name, key=key, byte_size=REGION_BYTES)),
    "Sample": (V1 + "Sample", lambda name, key: messages.sample_request(X, temperature=0.0)),
    "StreamSteps": (V1 + "StreamSteps", lambda name, key: messages.step_request("s", softmax={"x": X})),
    "ModelInfer": (KSERVE + "ModelInfer", lambda name, key: _infer_request()),
    "SystemSharedMemoryRegister": (KSERVE + "SystemSharedMemoryRegister",
                                   lambda name, key: kpb.SystemSharedMemoryRegisterRequest(
                                       name=name, key=key, byte_size=REGION_BYTES)),
}


def _call(channel, path: str, request, authorizations) -> tuple[grpc.StatusCode, str]:
    """(status, details) of one raw call carrying one ``authorization`` header per item of
    ``authorizations``, in that order."""
    metadata = tuple(("authorization", a) for a in authorizations)
    kw = dict(request_serializer=None, response_deserializer=None)
    data = request.SerializeToString()
    try:
        if path.endswith("StreamSteps"):
            list(channel.stream_stream(path, **kw)(iter([data]), timeout=30, metadata=metadata))
        else:
            channel.unary_unary(path, **kw)(data, timeout=30, metadata=metadata)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def _config(**changes) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=(), **changes)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("identity") / "tokens"
    path.write_text(f"{TOKEN}\n")
    with ServerThread(_config(auth_token_file=str(path))) as server:
        yield server


@pytest.fixture(scope="module")
def open_server():
    with ServerThread(_config()) as server:
        yield server


@pytest.fixture(scope="module")
def shm():
    """A shared-memory object under the token's key prefix (the only keys it may register)."""
    with shared_array(REGION_BYTES, "uint8", key=key_prefix(TOKEN) + "identity") as buf:
        yield buf


def _registered(server, owner) -> list[str]:
    return [info.name for info in server.service.regions.status("", owner)]


@pytest.mark.parametrize("order", sorted(TWO_HEADERS))
@pytest.mark.parametrize("rpc", sorted(CALLS))
def test_two_authorization_headers_are_refused(token_server, shm, rpc, order):
    path, request = CALLS[rpc]
    with grpc.insecure_channel(token_server.target) as channel:
        code, details = _call(channel, path, request(f"two-{rpc}", shm.key), TWO_HEADERS[order])
    assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, RULE)
    assert _registered(token_server, owner_of(MADE_UP)) == []
    assert f"two-{rpc}" not in _registered(token_server, owner_of(GOOD))


@pytest.mark.parametrize("rpc", sorted(CALLS))
def test_one_good_header_still_works(token_server, shm, rpc):
    path, request = CALLS[rpc]
    with grpc.insecure_channel(token_server.target) as channel:
        assert _call(channel, path, request(f"one-{rpc}", shm.key), (GOOD,)) == (grpc.StatusCode.OK, "")
    if "Register" in rpc:
        assert f"one-{rpc}" in _registered(token_server, owner_of(GOOD))
        token_server.service.regions.unregister(f"one-{rpc}", owner_of(GOOD))


@pytest.mark.parametrize("rpc", ["RegisterSystemSharedMemory", "Sample", "ModelInfer"])
def test_without_tokens_two_headers_are_refused_too(open_server, rpc):
    path, request = CALLS[rpc]
    with shared_array(REGION_BYTES, "uint8") as buf, grpc.insecure_channel(open_server.target) as channel:
        try:
            for order in TWO_HEADERS.values():
                assert _call(channel, path, request("two", buf.key), order) == (grpc.StatusCode.UNAUTHENTICATED, RULE)
            assert _registered(open_server, owner_of(MADE_UP)) == []
            assert _call(channel, path, request("one", buf.key), (MADE_UP,)) == (grpc.StatusCode.OK, "")
            assert _call(channel, path, request("none", buf.key), ()) == (grpc.StatusCode.OK, "")
        finally:
            open_server.service.regions.unregister("", owner_of(MADE_UP))
            open_server.service.regions.unregister("", None)


def test_health_checks_stay_exempt(token_server):
    """A health check names no one: answered whatever its headers (load balancers send none)."""
    request = health_pb2.HealthCheckRequest(service="")
    with grpc.insecure_channel(token_server.target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        answer = check(request.SerializeToString(), timeout=10,
                       metadata=tuple(("authorization", a) for a in TWO_HEADERS["made-up first"]))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_one_rule_for_the_token_and_the_owner():
    """identity.authorization_of is what both the token check and regions_servicer.caller read."""
    assert authorization_of(()) is None
    assert authorization_of((("x-request-id", "r"), ("authorization", GOOD))) == GOOD
    for pairs in (TWO_HEADERS["made-up first"], (GOOD, GOOD), (GOOD, MADE_UP, GOOD)):
        with pytest.raises(Unauthenticated, match=f"authorization: one header per call, got {len(pairs)}"):
            authorization_of(tuple(("authorization", a) for a in pairs))
