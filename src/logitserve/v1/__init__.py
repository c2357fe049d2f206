"""logitserve's wire contract, version 1: the generated messages and service stubs.

``logitserve_pb2`` holds the messages, ``logitserve_pb2_grpc`` the stubs and servicers of the
``LogitServe`` and ``SharedMemory`` services. Both are generated from ``logitserve.proto`` by
``scripts/gen_protos.sh``: never edit them by hand.
"""
