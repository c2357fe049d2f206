#!/usr/bin/env bash
# CI's container job: install podman (Debian/Ubuntu, as root), make the local base image, then
# build the Dockerfile, run it and call it (tests/test_container.py). Extra arguments go to
# pytest. Uses .venv (scripts/venv.sh) for the host side of the test: client and kernels.
#
#   scripts/ci_container.sh
#
# Takes about 3 minutes on a 2-core machine from scratch (apt ~15-25 s, debootstrap ~25-50 s,
# build ~70-100 s, test ~10 s); with the base image kept, about 2 minutes.
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
