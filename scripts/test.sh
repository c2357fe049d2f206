#!/usr/bin/env bash
# Set up .venv on a fresh machine and run the whole test suite (extra arguments go to pytest).
# On a machine without CUDA the kernels run through the torch reference and Triton's
# interpreter; where CUDA is present the compiled Triton kernels and full sizes run too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
exec .venv/bin/python -m pytest "$@"
