#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh` and a build in $B): the bench shape with
# `moe-dist bench` (tokens/s, MFU, phases, kernel profile), the peer on the same GPU in
# the same command (eager; PEER_COMPILE=1 adds torch.compile), and the micro-benchmarks.
# Logs under $OUT; a short table last.
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
mkdir -p "$OUT"
timeout 240 ./$B/moe-dist bench configs/bench-h200.ini >"$OUT/bench.log" 2>&1
echo "moe-dist bench: exit $?"
timeout 150 python3 .device-kit/peers/hf_mixtral_bench.py 4 32 8 2048 >"$OUT/peer_eager.log" 2>&1
echo "peer eager: exit $?"
if [ "${PEER_COMPILE:-0}" = 1 ]; then
  timeout 300 python3 .device-kit/peers/hf_mixtral_bench.py 4 32 8 2048 compile \
    >"$OUT/peer_compile.log" 2>&1
  echo "peer compile: exit $?"
fi
if [ "${MICRO:-1}" = 1 ]; then
  timeout 120 ./$B/bench/moe-bench --reps 10 >"$OUT/moe_bench.log" 2>&1
  echo "moe-bench: exit $?"
fi
sed -n '/^bench:/,/^bench-result/p' "$OUT/bench.log"
sed -n '/^kernels of/,$p' "$OUT/bench.log" | head -16
# the micro-benchmarks: op, ms, rate and % of its ceiling (the columns past the shape)
[ -f "$OUT/moe_bench.log" ] && awk 'NR > 3 { for (i = 2; i <= NF - 4; i++) if ($i ~ /^[0-9]+\.[0-9][0-9][0-9][0-9]$/) {
  printf "  %-22s %s %s %s %s %s\n", $1, $i, $(i + 1), $(i + 2), $(i + 3), $(i + 4); break } }' \
  "$OUT/moe_bench.log"
tail -2 "$OUT/peer_eager.log"
[ -f "$OUT/peer_compile.log" ] && tail -2 "$OUT/peer_compile.log"
python3 - "$OUT" <<'PY'
import re, sys
d = sys.argv[1]
ours = dict(kv.split("=") for kv in open(f"{d}/bench.log").read().split("bench-result ")[1].split()[:6])
print(f"moe-dist: {float(ours['tokens_per_s_per_gpu']):.0f} tokens/s per GPU, step {float(ours['step_ms']):.1f} ms, MFU {100*float(ours['mfu']):.1f}%")
for name in ("eager", "compile"):
    try:
        text = open(f"{d}/peer_{name}.log").read()
    except OSError:
        continue
    m = re.findall(r"([0-9,]+) tok/s/gpu", text)
    if m:
        peer = float(m[-1].replace(",", ""))
        print(f"peer {name}: {peer:.0f} tokens/s; ratio moe-dist/peer {float(ours['tokens_per_s_per_gpu'])/peer:.3f}")
    else:
        print(f"peer {name}: no tokens/s line found (see peer_{name}.log)")
PY
