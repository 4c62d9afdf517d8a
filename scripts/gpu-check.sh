#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh`): build for T4 and Hopper, run the GPU
# tests against the CPU reference (and under compute-sanitizer), train the tiny config on
# the GPU in fp32 / bf16 / fp16 and on the CPU and compare, check the Mixtral export with
# transformers, and time the bench shape next to the peer. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
B=build-gpu
bash scripts/gpu-build.sh $B "75;90" "$OUT/build.log" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvcc --version | tail -2 | head -1 | tee -a "$OUT/gpu.txt"
for t in test_cuda_ops test_cuda_model test_cuda_precision; do
  ./$B/tests/$t >"$OUT/$t.log" 2>&1
  echo "$t: exit $?"
done
# AdamW's steps of 4 elements (the widest, 8, where the alignments allow, is the default)
MOE_ADAMW_WIDTH=4 ./$B/tests/test_cuda_ops >"$OUT/test_cuda_ops_w4.log" 2>&1
echo "test_cuda_ops, AdamW steps of 4: exit $?"
grep -E "FAIL|PASS|rel err" "$OUT/test_cuda_precision.log"
# the same training on the GPU (fp32, bf16, fp16) and on the CPU, 50 steps
for mode in fp32 bf16 fp16; do
  ./$B/moe-dist train --set parallel.backend=cuda --set precision.mode=$mode --set train.steps=50 \
    --set log.jsonl="$OUT/gpu_$mode.jsonl" >"$OUT/train_gpu_$mode.log" 2>&1
  echo "train gpu $mode: exit $?"
done
./$B/moe-dist train --set parallel.backend=cuda --set parallel.a2a_chunks=4 --set train.steps=50 \
  --set log.jsonl="$OUT/gpu_fp32c4.jsonl" >"$OUT/train_gpu_fp32c4.log" 2>&1
echo "train gpu fp32, 4 chunks: exit $?"
OMP_NUM_THREADS=8 ./$B/moe-dist train --set parallel.backend=cpu --set train.steps=50 \
  --set log.jsonl="$OUT/cpu.jsonl" >"$OUT/train_cpu.log" 2>&1; echo "train cpu: exit $?"
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
load = lambda n: [json.loads(l) for l in open(f"{d}/{n}.jsonl")]
c = load("cpu")
for mode in ("fp32", "fp32c4", "bf16", "fp16"):
    try:
        g = load("gpu_" + mode)
    except Exception as e:
        print(mode, "missing", e); continue
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(g, c))
    print(f"gpu {mode} vs cpu fp32, {len(g)} steps: worst relative loss difference {worst:.2e}; "
          f"final {g[-1]['loss']:.5f} vs {c[-1]['loss']:.5f}; skipped {sum(r['skipped'] for r in g)}; "
          f"tok/s {g[-1]['tok_per_s']:.0f}")
PY
python3 tests/torch/check_mixtral_export.py ./$B/moe-dist --device cuda >"$OUT/mixtral.log" 2>&1
echo "mixtral export check: exit $?"
bash tests/gpu/loss_scaling.sh ./$B/moe-dist . >"$OUT/loss_scaling.log" 2>&1
echo "fp16 loss scaling: exit $?"; grep -E "^ok|FAIL|scales" "$OUT/loss_scaling.log"
if [ "${SANITIZE:-1}" = 1 ]; then
  OUT=$OUT B=$B bash scripts/gpu-sanitize.sh
fi
if [ "${BENCH:-1}" = 1 ]; then
  OUT=$OUT B=$B bash scripts/gpu-bench.sh
fi
