#!/usr/bin/env bash
# Regenerates the checked-in Python code of every wire contract under src/ (*_pb2.py, .pyi and
# _pb2_grpc.py beside each .proto: logitserve/v1, the KServe v2 / Triton protocol in
# logitserve/kserve, gRPC reflection v1 in logitserve/reflection_v1) with the pinned generator.
#
# The generator is grpcio-tools 1.66.2, old on purpose: its protoc writes protobuf 5.27.2 code,
# which protobuf's Python runtimes 5.27.2 to 7.x load (Python keeps gencode since 3.20 working
# until at least 8.x: protobuf.dev/support/cross-version-runtime-guarantee), and its stubs ask
# for grpcio >= 1.66.2. Those are the client's floors in pyproject.toml. A newer generator
# would raise them (grpcio-tools 1.84 writes 7.35.1 code, refused by protobuf 5 and 6).
# Its protobuf requirement (< 6) clashes with the server's, so it is not in .venv: it is
# installed, without dependencies (protoc needs none), into a cache folder of its own on first
# use and put first on PYTHONPATH. tests/test_protos_generated.py runs this script into a
# temporary folder and fails when the checked-in files differ.
#   scripts/gen_protos.sh [OUT]    (OUT: default src; uses $PYTHON, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-src}"
python="${PYTHON:-python3}"
version=1.66.2
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
tools="${LOGITSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/logitserve}/grpcio-tools-$version-$tag"
if [ ! -d "$tools/grpc_tools" ]; then
  # Into a scratch folder first, moved in place when complete: a run cut short leaves no half.
  mkdir -p "$(dirname "$tools")"
  scratch=$(mktemp -d "$tools.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$scratch" "grpcio-tools==$version"
  mv -T "$scratch" "$tools" 2>/dev/null || [ -d "$tools/grpc_tools" ]  # another run may have won the race
fi
mapfile -t protos < <(find src -name '*.proto' | sort)
mkdir -p "$out"
PYTHONPATH="$tools" "$python" -m grpc_tools.protoc -Isrc \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "${protos[@]}"
