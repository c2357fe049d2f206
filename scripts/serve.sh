#!/usr/bin/env bash
# Set up .venv on a fresh machine and start the server on the default device (cuda:0 where a
# GPU is present, else the CPU). Extra arguments go to `logitserve serve` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
# Serving needs the server extra (the tests' dev extra is scripts/test.sh's). An install already
# holding the dev extra, which includes the server's, serves as it is.
if ! ls .venv/.installed-*-server,dev >/dev/null 2>&1; then
  VENV_EXTRAS="server"
fi
source scripts/venv.sh
exec .venv/bin/logitserve serve "$@"
