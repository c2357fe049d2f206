#!/usr/bin/env bash
# One call on the lent GPU machine: the whole test suite (the CUDA tests included), then the
# kernel and service benchmarks. Logs and tables land in $OUT (or ./gpu-results).
#   run: bash scripts/gpu_check.sh [tests|kernels|service ...]   (carry .whl: health,
#   reflection, cryptography and FlashInfer wheels, and .whl-tc: tritonclient's, for
#   tests/test_kserve.py; that machine has no network)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh || exit 1
out="${OUT:-gpu-results}"
mkdir -p "$out"
steps=("${@:-tests kernels service}")
for step in ${steps[*]}; do
  case "$step" in
    tests)  # The compiled backend and the full-size CUDA tests. The interpreter and torch paths are
      # CI's (triton 3.9 here): triton 3.6's interpreter on that machine trips over NumPy 2 in
      # the sampling kernels (test_backend's interpreted launches too), and grpcio-tools (the proto
      # freshness test) is not installed there. --dist loadgroup: the xdist_group marks hold (tests that time
      # one client against another's stall run in turn); no pytest-benchmark: its teardown under xdist hung a run.
      python3 -m pytest tests -q -n 12 --dist loadgroup -p no:cacheprovider -p no:benchmark -k "(triton or cuda) and not interpreted" --ignore tests/test_protos_generated.py \
        2>&1 | tee "$out/tests.log" | tail -25 ;;
    kernels)
      python3 -m bench.kernels ${BENCH_KERNELS_ARGS:-} --out "$out/kernels.md" 2>&1 | tee "$out/kernels.log" | tail -80 ;;
    service)
      python3 -m bench.service --device cuda:0 --calls 1000 --retries 2 --out "$out/service.md" \
        2>&1 | tee "$out/service.log" | tail -30 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
