#!/usr/bin/env bash
# Move the pins: resolve logitserve's [server,dev] dependencies afresh (the newest releases
# pyproject.toml admits) in a scratch virtual environment and write them, transitive packages
# included, to constraints.txt, which scripts/venv.sh (so the README's test command and CI) and
# the Dockerfile install with. torch is left out: venv.sh pins it first (TORCH_SPEC) and the
# image takes its base image's build. Review the diff, run scripts/test.sh, commit both.
#   scripts/update_constraints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PYTHON:=python3}"
: "${TORCH_SPEC:=torch==2.13.0}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --upgrade pip
"$scratch/venv/bin/python" -m pip install -q "$TORCH_SPEC"
"$scratch/venv/bin/python" -m pip install -q ".[server,dev]"
{
  echo "# Every package the tests' environment installs (logitserve[server,dev] and what they bring),"
  echo "# pinned: scripts/venv.sh and the Dockerfile install with -c constraints.txt, so a fresh clone"
  echo "# installs what was tested. torch is pinned apart (scripts/venv.sh's TORCH_SPEC)."
  echo "# Made by scripts/update_constraints.sh on $(date -u +%Y-%m-%d) ($("$PYTHON" --version), $(uname -m)); rerun it to move the pins."
  "$scratch/venv/bin/python" -m pip freeze --exclude-editable | grep -viE '^(torch|logitserve)( ?@|==)' | LC_ALL=C sort -f
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages pinned" >&2
