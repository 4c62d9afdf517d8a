#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh` and a build in $B): one binary under
# several environment settings, taken in turn, so that a knob's trial and the default are
# timed on the same machine in the same command. RUNS: the settings, separated by ';',
# each a list of VAR=VALUE words, '-' for none (default '-'). ROUNDS (default 2) times,
# every setting in turn: moe-bench's OPS (default none; --reps REPS, default 20) and,
# unless BENCH=0, `moe-dist bench CONFIG` (configs/bench-h200.ini); MB_ARGS: more
# moe-bench arguments (e.g. '--rows-ratio 19 --out16 1 --grads16 1'). Logs under $OUT
# (mb_OP_R_S.log, bench_R_S.log: round R, setting S counted from 0); a table last, a
# line per round and setting: each op's ms, the step's ms, its forward / backward /
# optimizer ms, the final loss and the kernel profile's lines that PROFILE (an extended
# regex, default none) matches at their start: name, calls and mean us. A run that fails
# prints its exit status and leaves '?' in the table.
# Example: RUNS='-;MOE_ATTENTION_DKV_STAGES=3' OPS='attention attention_bwd_qkv' \
#   PROFILE='fw_(forward|dq|dkv)' bash scripts/gpu-ab.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
B=${B:-build-gpu}
RUNS=${RUNS:--}
ROUNDS=${ROUNDS:-2}
OPS=${OPS:-}
REPS=${REPS:-20}
BENCH=${BENCH:-1}
read -ra mb_args <<<"${MB_ARGS:-}"
CONFIG=${CONFIG:-configs/bench-h200.ini}
PROFILE=${PROFILE:-}
mkdir -p "$OUT"
IFS=';' read -ra settings <<<"$RUNS"
for s in "${settings[@]}"; do # a malformed setting stops the script before any run
  for w in $s; do
    [ "$w" = - ] || [[ "$w" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
      { echo "gpu-ab.sh: '$w' in RUNS is not VAR=VALUE or -" >&2 && exit 2; }
  done
done
table="$OUT/ab.txt"
: >"$table"
for ((r = 0; r < ROUNDS; r++)); do
  for i in "${!settings[@]}"; do
    s=${settings[$i]}
    envs=()
    for w in $s; do [ "$w" = - ] || envs+=("$w"); done
    line="round $r | ${s}"
    for op in $OPS; do
      log="$OUT/mb_${op}_${r}_$i.log"
      env "${envs[@]}" timeout 120 ./$B/bench/moe-bench --op "$op" --reps "$REPS" "${mb_args[@]}" >"$log" 2>&1 ||
        echo "moe-bench $op ($s): exit $?"
      ms=$(grep -E "^$op " "$log" | head -1 | grep -oE " [0-9]+\.[0-9]{4} " | head -1 | tr -d ' ')
      line+=" | $op ${ms:-?}"
    done
    if [ "$BENCH" != 0 ]; then
      log="$OUT/bench_${r}_$i.log"
      env "${envs[@]}" timeout 150 ./$B/moe-dist bench "$CONFIG" >"$log" 2>&1 ||
        echo "bench ($s): exit $?"
      step=$(grep -oE 'step_ms=[0-9.]+' "$log" | cut -d= -f2)
      phases=$(grep -E '^    (forward|backward|optimizer) ' "$log" | tr -s ' ' | cut -d' ' -f3 |
        paste -sd/)
      loss=$(grep -oE 'final loss [0-9.]+' "$log" | cut -d' ' -f3)
      line+=" | step ${step:-?} (${phases:-?}) loss ${loss:-?}"
      if [ -n "$PROFILE" ]; then
        prof=$(grep -E "^ *($PROFILE)" "$log" |
          awk '{n = $1; for (k = 2; k <= NF - 5; k++) n = n " " $k; printf "%s%s %s x %s us", sep, n, $(NF - 4), $(NF - 2); sep = ", "}')
        line+=" | ${prof:-?}"
      fi
    fi
    echo "$line" >>"$table"
  done
done
cat "$table"
