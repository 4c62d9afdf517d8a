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
# prints its exit status and leaves '?' in the table. Unless SMI=0, nvidia-smi samples
# the SM clock, power, temperature and the clock's event reasons every 200 ms while each
# bench runs (smi_R_S.csv), and the table gives the lowest and mean SM clock, the mean
# power and how many samples had a reason other than idle holding the clock back (a
# power or thermal cap slowing the timed steps).
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
SMI=${SMI:-1}
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
      smi="$OUT/smi_${r}_$i.csv"
      smi_pid=""
      if [ "$SMI" != 0 ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
          --format=csv,noheader,nounits -lms 200 >"$smi" 2>&1 &
        smi_pid=$!
      fi
      env "${envs[@]}" timeout 150 ./$B/moe-dist bench "$CONFIG" >"$log" 2>&1 ||
        echo "bench ($s): exit $?"
      [ -z "$smi_pid" ] || { kill "$smi_pid" 2>/dev/null; wait "$smi_pid" 2>/dev/null; }
      step=$(grep -oE 'step_ms=[0-9.]+' "$log" | cut -d= -f2)
      phases=$(grep -E '^    (forward|backward|optimizer) ' "$log" | tr -s ' ' | cut -d' ' -f3 |
        paste -sd/)
      loss=$(grep -oE 'final loss [0-9.]+' "$log" | cut -d' ' -f3)
      line+=" | step ${step:-?} (${phases:-?}) loss ${loss:-?}"
      if [ -n "$smi_pid" ]; then # the samples taken while the SMs ran above 1000 MHz
        clk=$(awk -F', *' '$1 + 0 > 1000 {n++; c += $1; w += $2; if (!lo || $1 < lo) lo = $1;
          if ($4 != "0x0000000000000000" && $4 != "0x0000000000000001") t++}
          END {if (n) printf "SM %d-%.0f MHz, %.0f W, %d of %d samples held back", lo, c / n, w / n, t, n}' "$smi")
        line+=" | ${clk:-no clock samples}"
      fi
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
