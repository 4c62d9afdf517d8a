#!/usr/bin/env bash
# On the GPU host, for the scripts that time two trees (gpu-ab-trees.sh, gpu-a2a-ab.sh):
# exits 2 unless BASE holds a tree (written by scripts/ab-base.sh COMMIT), then, unless
# BUILD=0 (each tree's build-gpu reused), builds TARGET in build-gpu of this tree and of
# BASE for ARCHS (scripts/gpu-build.sh; logs LOG_PREFIX{new,base}.log); exit 1 if
# either fails. Usage: ab-build.sh CALLER BASE ARCHS LOG_PREFIX TARGET
set -uo pipefail
[ $# = 5 ] || { echo "usage: $0 CALLER BASE ARCHS LOG_PREFIX TARGET" >&2 && exit 2; }
caller=$1 base=$2 archs=$3 logs=$4 target=$5
[ -f "$base/CMakeLists.txt" ] || { echo "$caller: no tree in $base (scripts/ab-base.sh COMMIT)" >&2 && exit 2; }
[ "${BUILD:-1}" = 0 ] && exit 0
bash scripts/gpu-build.sh build-gpu "$archs" "${logs}new.log" "$target" || exit 1
(cd "$base" && bash scripts/gpu-build.sh build-gpu "$archs" "${logs}base.log" "$target") || exit 1
