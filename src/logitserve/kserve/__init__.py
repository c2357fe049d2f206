"""The KServe v2 gRPC inference protocol with Triton's extensions (package ``inference``), as
logitserve serves it: the generated messages and service stubs.

``grpc_service_pb2`` holds the messages, ``grpc_service_pb2_grpc`` the stubs and servicer of
``inference.GRPCInferenceService``. Both are generated from ``grpc_service.proto`` by
``scripts/gen_protos.sh``: never edit them by hand.
"""
