#!/usr/bin/env bash
# On the GPU host: configures and builds moe-dist with CUDA, the form every gpu-*.sh script
# uses. Usage: gpu-build.sh BUILD_DIR ARCHS LOG [TARGET] (ARCHS: CMake's
# CMAKE_CUDA_ARCHITECTURES, e.g. '75;90'; TARGET: one target, default all). The output
# goes to LOG; on failure its last 40 lines are printed and the exit status is 1. Prints
# the build's seconds.
set -uo pipefail
[ $# -ge 3 ] || { echo "usage: $0 BUILD_DIR ARCHS LOG [TARGET]" >&2 && exit 2; }
b=$1 archs=$2 log=$3
target=()
[ -n "${4:-}" ] && target=(--target "$4")
t0=$(date +%s)
{ cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" && cmake --build "$b" "${target[@]}"; } >"$log" 2>&1 ||
  { tail -40 "$log" && exit 1; }
echo "build: $(($(date +%s) - t0)) s"
