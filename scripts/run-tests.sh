#!/usr/bin/env bash
# Runs the ctest suite of build dir $1 (optionally only label $2) and ends with the
# line "N passed, N failed" (and skipped, when any). Exit status 1 if any test failed.
set -uo pipefail
build=$1
label=${2:-}
args=(--test-dir "$build" --output-on-failure -j "$(nproc)")
[ -n "$label" ] && args+=(-L "$label")
log=$(mktemp)
ctest "${args[@]}" 2>&1 | tee "$log"
total=$(sed -n 's/.*tests passed, \([0-9]*\) tests\? failed out of \([0-9]*\).*/\2/p' "$log")
failed=$(sed -n 's/.*tests passed, \([0-9]*\) tests\? failed out of \([0-9]*\).*/\1/p' "$log")
if [ -z "$total" ]; then # CMake 4's ctest: "100% tests passed out of N" when none failed
  total=$(sed -n 's/.*100% tests passed out of \([0-9]*\).*/\1/p' "$log")
  [ -n "$total" ] && failed=0
fi
skipped=$(grep -c '\*\*\*Skipped\|Not Run (Disabled)' "$log" || true)
rm -f "$log"
if [ -z "$total" ]; then
  echo "0 passed, 1 failed (ctest did not run)"
  exit 1
fi
passed=$((total - failed - skipped))
[ "$skipped" -gt 0 ] && echo "($skipped skipped: they need a GPU; see the SKIP lines above)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
