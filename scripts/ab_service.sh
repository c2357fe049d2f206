#!/usr/bin/env bash
# Interleaved A/B of whole servers on the GPU machine: this tree's `logitserve serve` (twice,
# the A/A pair) against the server of each checkout given, beside the echo server, at the
# acceptance settings (Sample 1x128256 bf16, 1 / 8 / 64 calls in flight). Results (ab.md, ab.json,
# ab.log) land in $OUT (or ./ab-results).
#
#   bash scripts/ab_service.sh old=DIR [NAME=DIR ...]     (or just DIR: named old)
#
# A checkout DIR holds src/logitserve/ of another commit (before the src layout: kernels/, server/,
# client/ and protos/logitserve/v1):   git archive REV src | tar -x -C DIR
# More variants through AB_ARGS, e.g. AB_ARGS='--variant nopoll="serve --busy-poll-us 0"'.
# AB_ROUNDS (12) and AB_CALLS (300,1500,3000: calls per round at c=1, 8, 64) set the length;
# AB_SERVER_ARGS the flags of every serve variant (default: cuda:0, warm-up bf16 x 128256).
#
# Duration, estimated from bench.service's H100 numbers for this payload (one server process:
# about 800 calls/s at c=1, 1,500 at 8, 1,300 at 64): 0.4 + 1.0 + 2.3 s of calls plus ~0.5 s
# of warm-up calls and channels, ~4.2 s per variant and round; with 6 servers ~25 s a round,
# 12 rounds ~5 min, plus ~1-2 min for the servers' start (warm-up, all at once): 6-7 min.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh || exit 1
out="${OUT:-ab-results}"
mkdir -p "$out"
[ $# -ge 1 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
args=(--variant echo=echo)
for checkout in "$@"; do
  case "$checkout" in
    *=*) name="${checkout%%=*}"; dir="${checkout#*=}" ;;
    *) name=old; dir="$checkout" ;;
  esac
  args+=(--checkout "$name=$dir" --variant "$name=$name:serve")
done
args+=(--variant new=serve --variant new2=serve)
eval "extra=(${AB_ARGS:-})"
python3 -m bench.service_ab "${args[@]}" "${extra[@]}" \
  --server-arg="${AB_SERVER_ARGS:---device cuda:0 --warmup-dtypes bfloat16 --warmup-widths 128256}" \
  --vocab 128256 --concurrency 1,8,64 --calls "${AB_CALLS:-300,1500,3000}" --rounds "${AB_ROUNDS:-12}" \
  --max-seconds 10 --out "$out/ab.md" 2> "$out/ab.log"
status=$?
tail -5 "$out/ab.log" >&2
exit $status
