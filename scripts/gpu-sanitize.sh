#!/usr/bin/env bash
# On the GPU host, after a build in $B: compute-sanitizer memcheck over every op's test and
# racecheck over the model test (memcheck of the model test too unless QUICK=1). Logs
# under $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
mkdir -p "$OUT"
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 ./$B/tests/test_cuda_ops \
  >"$OUT/sanitizer_ops.log" 2>&1
echo "compute-sanitizer memcheck test_cuda_ops: exit $?"
tools="memcheck racecheck"
[ "${QUICK:-0}" = 1 ] && tools=racecheck
for tool in $tools; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 ./$B/tests/test_cuda_model \
    >"$OUT/sanitizer_${tool}.log" 2>&1
  echo "compute-sanitizer $tool test_cuda_model: exit $? ($(grep -cE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$OUT/sanitizer_${tool}.log") clean summaries)"
done
