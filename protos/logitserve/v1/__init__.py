"""logitserve's wire contract, version 1: the generated messages and service stubs.

``logitserve_pb2`` holds the messages, ``logitserve_pb2_grpc`` the ``LogitServe`` stub and
servicer. Both are generated from ``logitserve.proto`` by ``scripts/gen_protos.sh``: never edit
them by hand.
"""
