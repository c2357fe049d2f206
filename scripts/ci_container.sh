#!/usr/bin/env bash
# CI's container job: install podman (Debian/Ubuntu, as root), make the local base image, then
# build the Dockerfile, run it and call it (tests/test_container.py). Extra arguments go to
# pytest. Uses .venv (scripts/venv.sh) for the host side of the test: client and kernels.
#
#   scripts/ci_container.sh
#
# Measured on a 2-core machine (2026-11-22, other jobs running): from scratch 2.5 minutes
# (apt-get ~13 s, debootstrap + import ~37 s, image build ~89 s, container up and tested ~6 s);
# with the base image kept ~95 s; with podman's layer cache warm too (only the package layer
# rebuilt) ~40 s. Making .venv (scripts/venv.sh) on a fresh clone adds ~45 s here: the whole
# script from a fresh clone with the base image kept took 89 s.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q podman buildah debootstrap runc
fi

bash scripts/container_base.sh >/dev/null
source scripts/venv.sh
exec .venv/bin/python -m pytest tests/test_container.py -m container -v -s "$@"
