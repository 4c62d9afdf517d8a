#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh` and a build in $B): the experts' grouped
# GEMMs on cuBLASLt (cublas: MOE_GROUPED_GEMM=cublas) against the wgmma kernel with its
# 16-bit tiles stored from registers (wgmma: MOE_GROUPED_WGMMA_TMASTORE=0) and stored by
# TMA (ts: sm_90's default since the twenty-fourth session),
# under conditions "rows-ratio out16 grads16" (moe-bench's --rows-ratio, --out16,
# --grads16; "19 1 1" is the model's: spread rows, 16-bit forward outputs, bf16 weight
# gradients), then the bench for each of BENCH_RUNS (PATH or PATH:MASK, the mask
# MOE_GROUPED_WGMMA_CLASSES: 1 forwards, 2 input gradients, 4 weight gradients on the
# kernel, the rest on cuBLAS). Logs under $OUT; a table last, one line per op and
# condition: each path's ms and TFLOP/s and its ratio to cuBLAS (above 1: faster).
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
PATHS=${PATHS:-cublas wgmma ts}
CONDS=${CONDS:-1 0 0,1 1 1,19 1 1}
BENCH_RUNS=${BENCH_RUNS:-cublas ts ts:1 ts:5} # empty: no bench
mkdir -p "$OUT"
table="$OUT/grouped.tsv"
: >"$table"
# the environment of a path: MOE_GROUPED_GEMM and the TMA store
path_env() {
  case "$1" in
  cublas) echo "MOE_GROUPED_GEMM=cublas" ;;
  wgmma) echo "MOE_GROUPED_GEMM=wgmma MOE_GROUPED_WGMMA_TMASTORE=0" ;;
  ts) echo "MOE_GROUPED_GEMM=wgmma MOE_GROUPED_WGMMA_TMASTORE=1" ;;
  *) echo "gpu-grouped.sh: unknown path '$1' (cublas, wgmma, ts)" >&2 && return 2 ;;
  esac
}
for run in $PATHS $BENCH_RUNS; do # an unknown path stops the script before any run
  path_env "${run%%:*}" >/dev/null || exit 2
done
IFS=, read -ra conds <<<"$CONDS"
for cond in "${conds[@]}"; do
  set -- $cond
  for op in grouped_gemm grouped_gemm_bwd grouped_pair grouped_pair_bwd; do
    for path in $PATHS; do
      log="$OUT/mb_${op}_r$1_o$2_g$3_$path.log"
      env $(path_env "$path") timeout 60 ./$B/bench/moe-bench --op $op --reps 10 \
        --rows-ratio "$1" --out16 "$2" --grads16 "$3" >"$log" 2>&1 ||
        echo "moe-bench $op $path: exit $?"
      # the op's first line (the pair op where there are two): ms, rate
      line=$(grep -E "^$op " "$log" | head -1)
      ms=$(echo "$line" | grep -oE " [0-9]+\.[0-9]{4} " | head -1 | tr -d ' ')
      rate=$(echo "$line" | grep -oE "[0-9.]+ TF/s" | head -1 | cut -d' ' -f1)
      printf '%s\t%s\t%s\n' "$op r$1 o$2 g$3" "$path" "${ms:-?} ${rate:-?}" >>"$table"
    done
  done
done
for run in $BENCH_RUNS; do
  path=${run%%:*}
  mask=7
  [ "$run" != "$path" ] && mask=${run#*:}
  log="$OUT/bench_${path}_$mask.log"
  env $(path_env "$path") MOE_GROUPED_WGMMA_CLASSES=$mask timeout 120 ./$B/moe-dist bench \
    configs/bench-h200.ini >"$log" 2>&1 || echo "bench $run: exit $?"
  echo "bench $run: $(grep -o 'step_ms=[0-9.]*' "$log")" \
    "$(grep -o 'final loss [0-9.]*' "$log")" \
    "$(grep -E '^    (forward|backward|optimizer) ' "$log" | tr -s ' ' | cut -d' ' -f2,3 | paste -sd' ')" \
    "$(grep -oE '(wgmma grouped GEMM|cuBLASLt GEMMs on several streams) +[0-9]+ +[0-9.]+' "$log" |
      tr -s ' ' | paste -sd' ')"
done
python3 - "$table" "$PATHS" <<'PY'
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
paths = sys.argv[2].split()
by = {}
for key, path, val in rows:
    by.setdefault(key, {})[path] = val.split()
print(f"{'op and condition':32}" + "".join(f"{p + ' ms':>11}{'TF/s':>7}{'x':>6}" for p in paths))
for key, p in by.items():
    base = p.get("cublas", ["?", "?"])[0]
    line = f"{key:32}"
    for path in paths:
        ms, rate = p.get(path, ["?", "?"])
        try:
            r = f"{float(base) / float(ms):.3f}"
        except ValueError:
            r = "?"
        line += f"{ms:>11}{rate:>7}{r:>6}"
    print(line)
PY
