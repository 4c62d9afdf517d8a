#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh`): can the update run on SMs kept from
# the GEMMs? First bench/update_sms_probe.cu (PROBE=0 skips it): the bytes a second of
# an AdamW-like pass on k SMs, plain loads against bulk copies, and beside a cuBLASLt
# GEMM loop on the other SMs. Then moe-dist (built for ARCHS, default 90, in $B) and
# `moe-dist bench` over GRID, each entry DEFER:KEPT (MOE_UPDATE_DEFER, and SMs kept from
# the experts' grouped kernel: MOE_GROUPED_WGMMA_BLOCKS = the SMs - KEPT), one round
# through scripts/gpu-ab.sh, then the peers in PEERS (default compile). Logs under $OUT;
# the table last.
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
mkdir -p "$OUT"
if [ "${PROBE:-1}" = 1 ]; then
  if nvcc -O3 -std=c++17 -arch=sm_90a bench/update_sms_probe.cu -o "$OUT/probe.bin" -lcublasLt \
    >"$OUT/probe_build.log" 2>&1; then
    timeout 120 "$OUT/probe.bin" 2>&1 | tee "$OUT/probe.log"
  else
    tail -5 "$OUT/probe_build.log"
  fi
  rm -f "$OUT/probe.bin"
fi
bash scripts/gpu-build.sh "$B" "${ARCHS:-90}" "$OUT/build.log" moe-dist || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
n=$(nvidia-smi --query-gpu=multiprocessor_count --format=csv,noheader 2>/dev/null | head -1)
[[ "$n" =~ ^[0-9]+$ ]] || n=132 # H100 SXM and H200: 132 SMs
runs=""
for p in ${GRID:-0:0 3:0 0:8 3:8 3:16}; do
  d=${p%%:*} k=${p##*:}
  s="MOE_UPDATE_DEFER=$d"
  [ "$k" != 0 ] && s+=" MOE_GROUPED_WGMMA_BLOCKS=$((n - k))"
  runs+="${runs:+;}$s"
done
OUT=$OUT B=$B RUNS="$runs" ROUNDS=1 PROFILE="${PROFILE:-(adamw|wgmma)}" bash scripts/gpu-ab.sh \
  >"$OUT/ab.log" 2>&1
for p in ${PEERS:-compile}; do
  a=""
  [ "$p" = compile ] && a=compile
  timeout 300 python3 .device-kit/peers/hf_mixtral_bench.py 4 32 8 2048 $a >"$OUT/peer_$p.log" 2>&1
  echo "peer $p: exit $?, $(grep -oE '[0-9,]+ tok/s/gpu' "$OUT/peer_$p.log" | tail -1)"
done
cat "$OUT/ab.txt"
