#!/usr/bin/env bash
# Here, before a device command: writes commit COMMIT's tracked files into DIR (default
# .device-kit/base, which travels with the device kit) for scripts/gpu-ab-trees.sh, and
# its hash into DIR/.commit. Usage: ab-base.sh COMMIT [DIR]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 COMMIT [DIR]" >&2 && exit 2; }
commit=$(git rev-parse --verify --quiet "$1^{commit}") ||
  { echo "ab-base.sh: '$1' is not a commit here" >&2 && exit 2; }
dir=${2:-.device-kit/base}
rm -rf "$dir"
mkdir -p "$dir"
git archive "$commit" | tar x -C "$dir"
echo "$commit" >"$dir/.commit"
echo "ab-base.sh: $(git rev-parse --short "$commit") in $dir ($(du -sh "$dir" | cut -f1))"
