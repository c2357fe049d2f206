#!/usr/bin/env bash
# Lay out commit REV's package as DIR/src/logitserve, for the benches that run an older tree beside
# this one (bench.lone_call compare --before DIR/src, bench.sequence_host --trees DIR): commits from
# 4b879d4 on hold src/logitserve/ already; older ones kept kernels/, server/, client/ and protos/ at
# the root, mapped to logitserve.* by pyproject.toml's package-dir, which this repeats.
#   run: bash scripts/tree_at.sh REV DIR      (e.g. bash scripts/tree_at.sh 3ba2b80 .gpu/b45)
set -euo pipefail
cd "$(dirname "$0")/.."
rev="$1" dir="$2"
rm -rf "$dir" && mkdir -p "$dir/src"
if git cat-file -e "$rev:src/logitserve" 2>/dev/null; then
  git archive "$rev" src | tar -x -C "$dir"
else
  tmp="$(mktemp -d)" && trap 'rm -rf "$tmp"' EXIT
  git archive "$rev" kernels server client protos | tar -x -C "$tmp"
  mkdir -p "$dir/src/logitserve"
  cp -r "$tmp/kernels" "$tmp/server" "$tmp/client" "$dir/src/logitserve/"
  cp -r "$tmp/protos/logitserve/." "$dir/src/logitserve/"  # v1, kserve, reflection_v1 (and __init__.py)
  touch "$dir/src/logitserve/__init__.py"
fi
echo "$dir/src"
