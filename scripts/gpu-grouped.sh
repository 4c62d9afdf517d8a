#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh` and a build in $B): the experts' grouped
# GEMMs on cuBLASLt (the default) against the wgmma kernel (MOE_GROUPED_GEMM=wgmma, sm_90),
# with even rows and with the rows spread as the model's (--rows-ratio 19), fp32 and 16-bit
# forward outputs (--out16), then the bench both ways. Logs under $OUT; a table last, one
# line per op and condition: ms and TFLOP/s of each path and their ratio.
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
BENCH=${BENCH:-1}
mkdir -p "$OUT"
table="$OUT/grouped.tsv"
: >"$table"
for cond in "1 0" "1 1" "19 0" "19 1"; do
  set -- $cond
  for op in grouped_gemm grouped_gemm_bwd grouped_pair grouped_pair_bwd; do
    for path in cublas wgmma; do
      log="$OUT/mb_${op}_r$1_o$2_$path.log"
      MOE_GROUPED_GEMM=$path timeout 60 ./$B/bench/moe-bench --op $op --reps 10 \
        --rows-ratio "$1" --out16 "$2" >"$log" 2>&1 || echo "moe-bench $op $path: exit $?"
      # the op's first line (the pair op where there are two): ms, rate
      line=$(grep -E "^$op " "$log" | head -1)
      ms=$(echo "$line" | grep -oE " [0-9]+\.[0-9]{4} " | head -1 | tr -d ' ')
      rate=$(echo "$line" | grep -oE "[0-9.]+ TF/s" | head -1 | cut -d' ' -f1)
      printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$op" "$1" "$2" "$path" "${ms:-?}" "${rate:-?}" >>"$table"
    done
  done
done
if [ "$BENCH" = 1 ]; then
  for path in wgmma cublas; do
    MOE_GROUPED_GEMM=$path timeout 120 ./$B/moe-dist bench configs/bench-h200.ini \
      >"$OUT/bench_$path.log" 2>&1 || echo "bench $path: exit $?"
    echo "bench $path: $(grep -o 'step_ms=[0-9.]*' "$OUT/bench_$path.log")" \
      "$(grep -oE '(wgmma grouped GEMM|cuBLASLt GEMMs on several streams) +[0-9]+ +[0-9.]+' \
        "$OUT/bench_$path.log" | tr -s ' ')"
  done
fi
python3 - "$table" <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
by = {}
for op, ratio, out16, path, ms, rate in rows:
    by.setdefault((op, ratio, out16), {})[path] = (ms, rate)
print(f"{'op':18} {'spread':>6} {'out16':>5} {'cublas ms':>10} {'TF/s':>7} {'wgmma ms':>10} {'TF/s':>7} {'ratio':>6}")
for (op, ratio, out16), p in by.items():
    c, w = p.get("cublas", ("?", "?")), p.get("wgmma", ("?", "?"))
    try:
        r = f"{float(c[0]) / float(w[0]):.3f}"
    except ValueError:
        r = "?"
    print(f"{op:18} {ratio:>6} {out16:>5} {c[0]:>10} {c[1]:>7} {w[0]:>10} {w[1]:>7} {r:>6}")
PY
