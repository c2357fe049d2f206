# Sourced by scripts/test.sh and scripts/serve.sh: make .venv and install logitserve into it.
# torch is pinned before anything else: an unpinned torch pulls several GB of CUDA wheels
# where a CPU build would do (override with TORCH_SPEC, e.g. for another CUDA build).
# Re-runs are quick: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
: "${PYTHON:=python3}"
: "${TORCH_SPEC:=torch==2.13.0}"
venv=.venv
stamp="$venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)-${TORCH_SPEC//[^A-Za-z0-9.=]/_}"
if [ ! -f "$stamp" ]; then
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$TORCH_SPEC"
  "$venv/bin/python" -m pip install -q -e ".[dev]"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
