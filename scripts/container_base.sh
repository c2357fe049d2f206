#!/usr/bin/env bash
# Make the local base image the container test builds on, on a machine with podman but no
# registry (see CONTAINERS.md in the project's shared notes):
#
#   scripts/container_base.sh [IMAGE]        # IMAGE defaults to localhost/bookworm-base
#
# - writes $CACHE/containers.conf (runtime runc, ulimits root may set here); podman reads it
#   when CONTAINERS_CONF names it, nothing under /etc changes;
# - if IMAGE is missing: imports $CACHE/bookworm-rootfs.tar, first making that tarball with
#   `debootstrap --variant=minbase bookworm` if it is missing too (the slow step, ~50 s).
#
# CACHE is $LOGITSERVE_CONTAINER_CACHE, default /var/tmp/logitserve-container: it survives
# reboots' /tmp clean-up, so the tarball is made once per machine. Needs root (debootstrap).
# Prints the path of containers.conf as its last line of output.
set -euo pipefail

image="${1:-localhost/bookworm-base}"
cache="${LOGITSERVE_CONTAINER_CACHE:-/var/tmp/logitserve-container}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mkdir -p "$cache"

conf="$cache/containers.conf"
cat >"$conf.tmp" <<'EOF'
# Written by scripts/container_base.sh. crun cannot handle this machine's hybrid cgroups, and
# root here may not raise RLIMIT_NOFILE to podman's default: use runc and limits within reach.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
mv "$conf.tmp" "$conf"
export CONTAINERS_CONF="$conf"

if podman image exists "$image"; then
  echo "container_base: $image already present" >&2
  echo "$conf"
  exit 0
fi

tarball="$cache/bookworm-rootfs.tar"
if [[ ! -s "$tarball" ]]; then
  command -v debootstrap >/dev/null || { echo "container_base: debootstrap not installed" >&2; exit 1; }
  rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  echo "container_base: debootstrap bookworm into $rootfs (about a minute)" >&2
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
    tail -20 "$cache/debootstrap.log" >&2
    exit 1
  }
  # The image runs apt-get, which wants a clean package cache and no leftover apt lists.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
  trap - EXIT
fi

echo "container_base: importing $tarball as $image" >&2
podman import --quiet "$tarball" "$image" >/dev/null
echo "$conf"
