# Sourced by scripts/test.sh and scripts/serve.sh: make .venv and install logitserve into it.
# torch is pinned before anything else: an unpinned torch pulls several GB of CUDA wheels
# where a CPU build would do (override with TORCH_SPEC, e.g. for another CUDA build).
# Every other package is pinned by constraints.txt (transitive ones included; scripts/
# update_constraints.sh moves the pins), so a fresh clone installs what was tested.
# Re-runs are quick: the install is skipped while pyproject.toml and constraints.txt are unchanged.
# VENV_EXTRAS: the optional dependencies installed with it (default server,dev: the server and
# kernels, and the tests' tools; scripts/serve.sh sets server alone; empty: the client alone,
# without torch). A stamp records torch and the extras, so a test run after a serve-only install
# adds the dev extra.
set -euo pipefail
: "${PYTHON:=python3}"
: "${TORCH_SPEC:=torch==2.13.0}"
: "${VENV_EXTRAS=server,dev}"
case ",$VENV_EXTRAS," in
  *,server,* | *,dev,*) torch="$TORCH_SPEC" ;;  # the extras that bring torch (dev includes server)
  *) torch="" ;;
esac
venv=.venv
stamp="$venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)-${torch//[^A-Za-z0-9.=]/_}-${VENV_EXTRAS:-none}"
if [ ! -f "$stamp" ]; then
  echo "venv.sh: installing into $venv: ${torch:+$torch, then }logitserve${VENV_EXTRAS:+ with [$VENV_EXTRAS]}" \
    "(first run: a few minutes with torch)" >&2
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  [ -z "$torch" ] || "$venv/bin/python" -m pip install -q "$torch"
  "$venv/bin/python" -m pip install -q -c constraints.txt -e ".${VENV_EXTRAS:+[$VENV_EXTRAS]}"
  rm -f "$venv"/.installed-*
  touch "$stamp"
  echo "venv.sh: installed" >&2
fi
