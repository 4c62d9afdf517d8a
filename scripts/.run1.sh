#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-out1}; mkdir -p "$OUT"; B=build-gpu
t0=$(date +%s)
{ cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="75;90" && cmake --build $B; } >"$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(($(date +%s) - t0)) s"; git log --oneline -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
bash scripts/run-tests.sh $B "gpu|mgpu" >"$OUT/tests.log" 2>&1; echo "GPU tests: exit $?"; tail -2 "$OUT/tests.log"
./$B/tests/test_cuda_precision >"$OUT/prec.log" 2>&1; echo "precision: exit $?"; grep -E "pair|FAIL" "$OUT/prec.log"
grep -E "FAIL" "$OUT/tests.log" | head -20
export CUDA_VISIBLE_DEVICES=0
for p in 1 0 1 0; do
  MOE_GEMM_PAIR=$p timeout 200 ./$B/moe-dist bench configs/bench-h200.ini >"$OUT/bench_p$p.log" 2>&1
  echo "bench pair=$p: exit $? $(grep -o 'tokens_per_s_per_gpu=[0-9]*\|step_ms=[0-9.]*' "$OUT/bench_p$p.log" | tr '\n' ' ')"
done
for p in 1 0; do
  for op in experts_ffn experts_ffn_bwd grouped_gemm grouped_gemm_bwd; do
    MOE_GEMM_PAIR=$p timeout 60 ./$B/bench/moe-bench --op $op --reps 20 --precision bf16 2>&1 | grep -E "^(experts|grouped)" | sed "s/^/pair=$p /"
  done
done
sed -n '/^bench:/,/^bench-result/p' "$OUT/bench_p1.log" | head -30
sed -n '/^kernels of/,$p' "$OUT/bench_p1.log" | head -24
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
