"""Server reflection: grpc.reflection.v1 (server/api/reflection.py) and grpc.reflection.v1alpha
answer alike on a real server, through the guard."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

from logitserve.reflection_v1 import reflection_pb2 as v1_pb
from logitserve.reflection_v1 import reflection_pb2_grpc as v1_grpc
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

SERVED = {"logitserve.v1.LogitServe", "logitserve.v1.SharedMemory", "inference.GRPCInferenceService",
          "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
TOKEN = "tok-reflection-3e9d"


def config(**kw) -> ServerConfig:
    return ServerConfig(**{**dict(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=()), **kw})


@pytest.fixture(scope="module")
def channel():
    with ServerThread(config()) as server, grpc.insecure_channel(server.target) as channel:
        yield channel


def ask(channel, *requests, grpc_module=v1_grpc, metadata=None):
    """The answers to ``requests``, asked on one reflection stream."""
    stub = grpc_module.ServerReflectionStub(channel)
    return list(stub.ServerReflectionInfo(iter(requests), timeout=10, metadata=metadata))


def files_of(response) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in response.file_descriptor_response.file_descriptor_proto]
    return {f.name: f for f in files}


def test_v1_lists_every_service(channel):
    [reply] = ask(channel, v1_pb.ServerReflectionRequest(list_services=""))
    assert isinstance(reply, v1_pb.ServerReflectionResponse)
    assert {s.name for s in reply.list_services_response.service} == SERVED
    assert reply.original_request.list_services == ""


def test_v1_gives_the_file_of_a_symbol_with_its_imports(channel):
    [reply] = ask(channel, v1_pb.ServerReflectionRequest(file_containing_symbol="logitserve.v1.LogitServe"))
    files = files_of(reply)
    contract = files["logitserve/v1/logitserve.proto"]
    service = next(s for s in contract.service if s.name == "LogitServe")
    assert {"Sample", "Softmax", "StreamSteps", "GetServerInfo"} <= {m.name for m in service.method}
    assert set(contract.dependency) <= set(files)  # every import comes along

    [reply] = ask(channel, v1_pb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    [own] = files_of(reply).values()
    assert own.package == "grpc.reflection.v1" and [s.name for s in own.service] == ["ServerReflection"]


def test_v1_answers_each_question_of_a_stream_in_order(channel):
    replies = ask(channel,
                  v1_pb.ServerReflectionRequest(file_by_filename="logitserve/kserve/grpc_service.proto"),
                  v1_pb.ServerReflectionRequest(file_containing_symbol="no.such.Symbol"),
                  v1_pb.ServerReflectionRequest(list_services=""),
                  v1_pb.ServerReflectionRequest(host="h"))  # no question: INVALID_ARGUMENT
    assert [r.WhichOneof("message_response") for r in replies] == [
        "file_descriptor_response", "error_response", "list_services_response", "error_response"]
    assert "logitserve/kserve/grpc_service.proto" in files_of(replies[0])
    assert replies[1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert replies[1].original_request.file_containing_symbol == "no.such.Symbol"
    assert replies[3].error_response.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_v1alpha_still_answers_and_alike(channel):
    questions = [dict(list_services=""), dict(file_containing_symbol="inference.GRPCInferenceService"),
                 dict(file_by_filename="no/such.proto")]
    old = ask(channel, *(v1alpha_pb.ServerReflectionRequest(**q) for q in questions),
              grpc_module=v1alpha_grpc)
    new = ask(channel, *(v1_pb.ServerReflectionRequest(**q) for q in questions))
    assert all(isinstance(r, v1alpha_pb.ServerReflectionResponse) for r in old)
    assert {s.name for s in old[0].list_services_response.service} == SERVED
    # Same messages, same field numbers: the same bytes.
    assert [r.SerializeToString(deterministic=True) for r in old] == \
        [r.SerializeToString(deterministic=True) for r in new]


def test_v1_needs_a_token_when_tokens_are_on(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    request = v1_pb.ServerReflectionRequest(list_services="")
    with ServerThread(config(auth_token_file=str(tokens))) as server, grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            ask(channel, request)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        [reply] = ask(channel, request, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert "grpc.reflection.v1.ServerReflection" in {s.name for s in reply.list_services_response.service}


def test_v1_contract_is_v1alpha_in_another_package():
    # What the transcoding relies on: every message, field name, number and type, and the
    # service, as grpcio-reflection's v1alpha has them; only the package and file differ.
    def shape(module, package):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        assert proto.package == package
        for cleared in ("name", "package", "options"):
            proto.ClearField(cleared)
        return str(proto).replace(f".{package}.", ".")

    assert shape(v1_pb, "grpc.reflection.v1") == shape(v1alpha_pb, "grpc.reflection.v1alpha")
