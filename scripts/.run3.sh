#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-out3}; mkdir -p "$OUT"; B=build-gpu
{ cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="75;90" && cmake --build $B; } >"$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
for h in 128 512 1024 128 512; do
  MOE_HEAD_MIB=$h timeout 200 ./$B/moe-dist bench configs/bench-h200.ini >"$OUT/bench_h$h.log" 2>&1
  echo "head $h MiB: exit $? $(grep -o 'tokens_per_s_per_gpu=[0-9]*\|step_ms=[0-9.]*' "$OUT/bench_h$h.log" | tr '\n' ' ') $(grep -o 'memory .*' "$OUT/bench_h$h.log")"
done
sed -n '/^kernels of/,$p' "$OUT/bench_h512.log" | head -14
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
