#!/usr/bin/env bash
# Set up .venv on a fresh machine and start the server on the default device (cuda:0 where a
# GPU is present, else the CPU). Extra arguments go to `logitserve serve` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec .venv/bin/logitserve serve "$@"
