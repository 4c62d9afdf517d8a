#!/usr/bin/env bash
# CMake's compiler launcher for Hopper's wgmma kernels (kernels/cuda/sm90/): runs the
# compile it is given and fails it, removing its object, where ptxas reports that it
# serialized the wgmma instructions (C7520: a branch around a wgmma, for instance, makes
# it insert a warpgroup barrier that serializes every wgmma of the kernel), which cost
# the grouped GEMM kernel its speed without a word in the twenty-third session.
# Usage: wgmma-guard.sh COMPILER ARGS... (as CMake calls it).
out=$("$@" 2>&1)
rc=$?
[ -n "$out" ] && printf '%s\n' "$out" >&2
if [ "$rc" -eq 0 ] && grep -q 'C7520' <<<"$out"; then
  prev=
  for a in "$@"; do
    [ "$prev" = -o ] && rm -f -- "$a"
    prev=$a
  done
  echo "error: ptxas serialized wgmma instructions (C7520, above); keep every wgmma out of" \
    "divergent code (scripts/wgmma-guard.sh)" >&2
  exit 1
fi
exit "$rc"
