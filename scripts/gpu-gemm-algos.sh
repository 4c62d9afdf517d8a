#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh` and a build of moe-dist in $B): would
# timing cuBLASLt's candidate algorithms of the model's dense GEMMs beat the heuristic's
# first, which kernels/cuda/matmul.cu takes? Runs `moe-dist bench CONFIG`
# (configs/bench-h200.ini) with MOE_PROFILE_GEMM_SHAPES=1, takes each cuBLASLt GEMM shape
# from its kernel profile (the experts' rows, shown "~", are left out: they vary a step),
# then compiles bench/gemm_algos_probe.cu (nvcc, ARCH default sm_90a) and times every
# candidate of each shape alone. Logs under $OUT (bench.log, shapes.txt, probe.log); the
# probe's table last.
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
CONFIG=${CONFIG:-configs/bench-h200.ini}
mkdir -p "$OUT"
[ -x "$B/moe-dist" ] || { echo "gpu-gemm-algos.sh: no $B/moe-dist (scripts/gpu-build.sh $B)" >&2 && exit 2; }
MOE_PROFILE_GEMM_SHAPES=1 timeout 200 "$B/moe-dist" bench "$CONFIG" >"$OUT/bench.log" 2>&1 ||
  { echo "gpu-gemm-algos.sh: the bench failed (exit $?): $OUT/bench.log" >&2 && exit 1; }
# "    GEMM 1024 16384 1024 NT 32 += x3      8      0.671      83.8  0.6%      0.010" becomes
# "1024 16384 1024 0 1 0 1 3 8 83.8"
python3 - "$OUT/bench.log" >"$OUT/shapes.txt" <<'PY'
import re, sys
pat = re.compile(r"^\s*GEMM (\d+) (\d+) (\d+) ([NT])([NT]) (16|32)( \+=)?(?: x(\d+))?\s+(\d+)\s+[\d.]+\s+([\d.]+)\s")
for line in open(sys.argv[1]):
    g = pat.match(line)
    if g:
        m, n, k, ta, tb, o, acc, batch, calls, us = g.groups()
        print(m, n, k, int(ta == "T"), int(tb == "T"), int(o == "16"), int(bool(acc)),
              batch or 1, calls, us)
PY
[ -s "$OUT/shapes.txt" ] || { echo "gpu-gemm-algos.sh: no GEMM shapes in $OUT/bench.log" >&2 && exit 1; }
nvcc -O3 -std=c++17 -arch="${ARCH:-sm_90a}" bench/gemm_algos_probe.cu -o "$OUT/probe.bin" \
  -lcublasLt >"$OUT/probe_build.log" 2>&1 || { tail -5 "$OUT/probe_build.log" && exit 1; }
timeout 300 "$OUT/probe.bin" <"$OUT/shapes.txt" >"$OUT/probe.log" 2>&1
rc=$?
rm -f "$OUT/probe.bin"
grep -E "step_ms|tokens_per_s=" "$OUT/bench.log" | head -1
cat "$OUT/probe.log"
exit $rc
