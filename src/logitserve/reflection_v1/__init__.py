"""gRPC server reflection, version 1 (package ``grpc.reflection.v1``): the generated messages and
service stubs that server/api/reflection.py serves beside grpcio-reflection's ``v1alpha``.

``reflection_pb2`` holds the messages, ``reflection_pb2_grpc`` the stub and servicer of
``grpc.reflection.v1.ServerReflection``. Both are generated from ``reflection.proto`` by
``scripts/gen_protos.sh``: never edit them by hand.
"""
