#!/usr/bin/env bash
# Issue 45's figures on the lent GPU machine: a call's host path, each step one bench. Results
# (JSON, tables, logs) land in $OUT (or ./gpu-results).
#   run: bash scripts/gpu_host.sh [lone|profile|channel|processors ...]   (carry .whl: iceoryx2,
#   health, reflection; and, for `lone`, the baseline's tree: issue 45's "today", made here with
#   `bash scripts/tree_at.sh 3ba2b80 .gpu/b45` and carried as .gpu/b45)
#   lone:       bench.lone_call compare, baseline against this tree (RouteExperts 1x8 and Sample
#               1x32000 over gRPC and the channel: p50, p99, server CPU a call), about 4 minutes
#   profile:    bench.processors_service with the server's threads sampled (bench.stack_profile):
#               where a processors call, a sequence call and a VerifyDraft spend the host's time
#   channel:    bench.channel_service: Sample 1 / 256 rows in CUDA regions against the kernel, and
#               8 client processes' calls/s, about 3 minutes
#   processors: bench.processors_service unprofiled: every feature against the plain call
#   channel-profile: the channel cases (1 client of throughput) with the server and the client sampled:
#               channel_profile.txt, by case and side
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh || exit 1
out="${OUT:-gpu-results}"
mkdir -p "$out"
for step in ${@:-lone channel}; do
  case "$step" in
    lone)
      python3 -m bench.lone_call compare --device cuda:0 --backend auto --before .gpu/b45/src --after src \
        --rounds "${LONE_ROUNDS:-5}" --seconds 1.5 --out "$out/lone.json" 2> "$out/lone.log" | tail -20 ;;
    profile)
      python3 -m bench.processors_service --device cuda:0 --calls 60 --case-seconds 8 \
        --stack-samples "$out/stacks.json" --out "$out/profile.md" > "$out/profile.log" 2>&1
      tail -5 "$out/profile.log" ;;
    channel)
      python3 -m bench.channel_service --device cuda:0 --out "$out/channel.json" 2> "$out/channel.log" | tail -16 ;;
    channel-profile)
      # bench.channel_service's server and its cases' client process sampled; each case's last shm round
      # summarized from both (its wall-clock window; samples are counted by the second, hence 3 s rounds)
      BENCH_SERVER_STACK_SAMPLES="$out/channel_stacks.json" BENCH_CLIENT_STACK_SAMPLES="$out/client_stacks.json" \
        python3 -m bench.channel_service --device cuda:0 --clients 1 --loop-seconds 1 --case-seconds 3 --rounds 2 \
        --out "$out/channel_profiled.json" 2> "$out/channel_profiled.log" | tail -12
      python3 -c 'import json, sys; from bench.stack_profile import summarize
for case in json.load(open(sys.argv[1]))["cases"]:
    start, end = case["rounds"]["shm"][-1]["window"]
    label = case["label"]
    for side, samples in (("server", sys.argv[2]), ("client", sys.argv[3])):
        print(f"### {label} over shm, its last round: the {side}"); print("\n".join(summarize(samples, start, end)))
' "$out/channel_profiled.json" "$out/channel_stacks.json" "$out/client_stacks.json" > "$out/channel_profile.txt" ;;
    processors)
      python3 -m bench.processors_service --device cuda:0 --out "$out/processors.md" 2> "$out/processors.log" \
        | tail -20 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
