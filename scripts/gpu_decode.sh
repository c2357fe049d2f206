#!/usr/bin/env bash
# One call on the lent GPU machine: the decode loop (bench.decode_loop) and a client killed
# mid-decode (bench.ordered_kill), the server and the engines clients of one MPS daemon, as
# docs/DEPLOY.md deploys same-host engines (the daemon only: the GPU's compute mode is left as it is).
# Results (decode_loop.json/.md, ordered_kill.json, the logs) land in $OUT (or ./gpu-results).
#   run: bash scripts/gpu_decode.sh [bench.decode_loop's arguments]   (carry .whl: iceoryx2, health,
#   reflection; default arguments: the 5 ms cells of every feature, every mode, 2 repeats)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh || exit 1
out="${OUT:-gpu-results}"
mkdir -p "$out"
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d || exit 1
trap 'echo quit | nvidia-cuda-mps-control' EXIT
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--step-ms 5 --repeats 2 --budget-s 330)
python3 -m bench.decode_loop "${args[@]}" --out "$out/decode_loop.json" 2> "$out/decode_loop.log" | tail -60
timeout 150 python3 -m bench.ordered_kill --out "$out/ordered_kill.json" 2> "$out/ordered_kill.log" | tail -45
