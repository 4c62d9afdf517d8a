#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh` and a build in $B, default build-gpu):
# where one moe-bench op's time goes, by Nsight Compute. Usage: gpu-ncu.sh OP [REGEX]
# (OP: an op of `moe-bench a2a`, one rank; A2A=0: of the single-GPU list; PRECISION,
# default bf16). One warm-up and two timed calls are profiled. Prints each kernel with
# its calls, mean time, DRAM throughput, active warps, grid and registers; then, where
# REGEX names a kernel, that kernel's speed-of-light, memory, occupancy, launch and warp
# state sections (its second launch). Logs under $OUT (ncu_OP.log, ncu_OP_detail.log).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OP [KERNEL_REGEX]" >&2 && exit 2; }
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
op=$1 regex=${2:-}
mkdir -p "$OUT"
mode=()
[ "${A2A:-1}" = 1 ] && mode=(a2a)
bench=("./$B/bench/moe-bench" "${mode[@]}" --op "$op" --precision "${PRECISION:-bf16}" --reps 2 --warmup 1)
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size
metrics+=,launch__registers_per_thread
log="$OUT/ncu_$op.log"
timeout 300 mpirun -np 1 --bind-to none ncu --metrics "$metrics" "${bench[@]}" >"$log" 2>&1 ||
  { echo "gpu-ncu.sh: ncu exit $? (see $log)" && tail -5 "$log" && exit 1; }
python3 scripts/ncu-table.py "$log" || exit 1
[ -n "$regex" ] || exit 0
detail="$OUT/ncu_${op}_detail.log"
timeout 300 mpirun -np 1 --bind-to none ncu -k "regex:$regex" --launch-skip 1 -c 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section WarpStateStats "${bench[@]}" >"$detail" 2>&1 ||
  { echo "gpu-ncu.sh: ncu ($regex) exit $? (see $detail)" && exit 1; }
grep -E "Duration|Throughput|Busy|Occupancy|Warp Cycles|Issued|Registers|Waves|Hit Rate|Eligible|Active Warps" \
  "$detail" | cut -c1-140
