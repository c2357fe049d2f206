#!/usr/bin/env bash
# Regenerates the checked-in Python code of the wire contracts (protos/logitserve/v1/*_pb2*.py[i],
# and protos/logitserve/kserve/*_pb2*.py[i]: the KServe v2 / Triton protocol, package `inference`)
# with the pinned generator (grpcio-tools 1.84.0, pyproject's dev extra: stubs from a newer
# generator refuse the grpcio 1.84 runtime). tests/test_protos_generated.py runs the same
# command into a temporary folder and fails when the checked-in files differ.
#   scripts/gen_protos.sh            (uses $PYTHON, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m grpc_tools.protoc -Iprotos \
  --python_out=protos --pyi_out=protos --grpc_python_out=protos \
  protos/logitserve/v1/logitserve.proto \
  protos/logitserve/kserve/grpc_service.proto
