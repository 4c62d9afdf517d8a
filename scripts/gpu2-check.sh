#!/usr/bin/env bash
# On a 2-GPU host (after `. .device-kit/setup.sh`): the NCCL path. Trains the tiny config on
# 2 GPUs (ep 2 and ep 1) and on 2 CPU ranks, compares the losses, and times the bench shape
# on 2 GPUs with ep 2 (`moe-dist bench`: tokens/s, phases, communication total and
# exposed) next to the peer's DDP, and `moe-bench a2a` (dispatch and combine against raw
# NCCL of the same bytes; A2A=0 skips it). Logs under $OUT. DEFER_TRY=n: the bench once
# more with MOE_UPDATE_DEFER=n (docs/design.md: at ep 2 the dense pieces run after their
# reduction).
set -uo pipefail
OUT=${OUT:-gpu2-out}
mkdir -p "$OUT"
B=build-gpu
bash scripts/gpu-build.sh $B "75;90" "$OUT/build.log" || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${TESTS:-1}" = 1 ]; then # every GPU test (labels gpu and mgpu) against the CPU
  bash scripts/run-tests.sh $B "gpu|mgpu" >"$OUT/tests.log" 2>&1
  echo "GPU tests: exit $?"; tail -3 "$OUT/tests.log"
fi
run() { # name np backend ep accum extra...
  local name=$1 np=$2 be=$3 ep=$4 acc=$5; shift 5
  timeout 300 mpirun -np "$np" --bind-to none -x NCCL_NVLS_ENABLE=0 ./$B/moe-dist train \
    --set parallel.backend=$be --set parallel.ep=$ep --set train.grad_accum=$acc \
    --set train.steps=50 --set log.jsonl="$OUT/$name.jsonl" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $?"
}
if [ "${TINY:-1}" = 1 ]; then # the tiny config on 2 GPUs against 2 CPU ranks
run cpu_w2ep2 2 cpu 2 1 --set parallel.a2a_chunks=1
run gpu_w2ep2 2 cuda 2 1
run gpu_w2ep2_c1 2 cuda 2 1 --set parallel.a2a_chunks=1
run gpu_w2ep2_c4 2 cuda 2 1 --set parallel.a2a_chunks=4
run gpu_w2ep1 2 cuda 1 1
run gpu_w1 1 cuda 1 2
run gpu_w2ep2_bf16 2 cuda 2 1 --set precision.mode=bf16
run gpu_w2ep2_fp16 2 cuda 2 1 --set precision.mode=fp16
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
def load(n):
    try: return [json.loads(l) for l in open(f"{d}/{n}.jsonl")]
    except Exception as e: print(n, "missing:", e); return None
def worst(a, b):
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
ref = load("cpu_w2ep2")
for n in ("gpu_w2ep2", "gpu_w2ep2_c1", "gpu_w2ep2_c4", "gpu_w2ep1", "gpu_w1", "gpu_w2ep2_bf16",
          "gpu_w2ep2_fp16"):
    g = load(n)
    if not g or not ref: continue
    print(f"{n} vs cpu world 2 ep 2 (1 chunk): {len(g)} steps, worst relative loss difference "
          f"{worst(g, ref):.2e}, final {g[-1]['loss']:.5f} vs {ref[-1]['loss']:.5f}")
c1, c2, c4 = load("gpu_w2ep2_c1"), load("gpu_w2ep2"), load("gpu_w2ep2_c4")
if c1 and c2 and c4:
    print(f"chunks on/off on 2 GPUs: 2 vs 1 {worst(c2, c1):.2e}, 4 vs 1 {worst(c4, c1):.2e}")
PY
tail -2 "$OUT/gpu_w2ep2.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  bench() { # name extra-sets... (NCCL_* settings in $NCCL_SET are passed to both ranks)
    local name=$1; shift
    local envs=(-x NCCL_NVLS_ENABLE=0)
    for kv in ${NCCL_SET:-}; do envs+=(-x "$kv"); done
    timeout 240 mpirun -np 2 --bind-to none "${envs[@]}" ./$B/moe-dist bench \
      configs/bench-h200.ini --set parallel.ep=2 "$@" >"$OUT/$name.log" 2>&1
    echo "moe-dist bench $name ($* ${NCCL_SET:-}): exit $?"
    grep -E "^bench:|tokens/s|step time|communication  |exposed communication|ranks  " \
      "$OUT/$name.log" | cut -c1-260
    sed -n '/exposed by place/,/allocations/p' "$OUT/$name.log" | grep -v allocations
  }
  for c in ${CHUNKS:-1 2 4}; do bench "bench2_c$c" --set parallel.a2a_chunks=$c; done
  for k in ${REPEATS:-}; do
    for c in ${CHUNKS:-1 2 4}; do
      bench "bench2_c${c}_r$k" --set parallel.a2a_chunks=$c --set parallel.exchange_repeat=$k
    done
  done
  if [ -n "${NCCL_TRY:-}" ]; then # the chunked run again with NCCL limited to fewer SMs
    NCCL_SET="$NCCL_TRY" bench bench2_c2_nccl --set parallel.a2a_chunks=2
    for k in ${REPEATS:-}; do
      NCCL_SET="$NCCL_TRY" bench "bench2_c2_r${k}_nccl" --set parallel.a2a_chunks=2 \
        --set parallel.exchange_repeat=$k
    done
  fi
  if [ -n "${DEFER_TRY:-}" ]; then # the first DEFER_TRY buckets' update beside the next forward
    NCCL_SET="MOE_UPDATE_DEFER=$DEFER_TRY ${NCCL_SET:-}" bench bench2_c2_defer \
      --set parallel.a2a_chunks=2
  fi
  if [ "${A2A:-1}" = 1 ]; then # dispatch / combine against raw NCCL of the same bytes
    timeout 180 mpirun -np 2 --bind-to none -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE=0 \
      ./$B/bench/moe-bench a2a >"$OUT/a2a.log" 2>&1
    echo "moe-bench a2a: exit $?"; grep -E "dispatch|combine" "$OUT/a2a.log" | cut -c1-200
  fi
  if [ "${PEER:-1}" = 1 ]; then
    timeout 150 torchrun --nproc_per_node=2 .device-kit/peers/hf_mixtral_bench.py 4 32 8 2048 \
      >"$OUT/peer_ddp.log" 2>&1; echo "peer DDP: exit $?"; grep hf-mixtral "$OUT/peer_ddp.log"
  fi
fi
