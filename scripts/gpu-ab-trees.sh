#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh`): times this tree against another (BASE,
# default .device-kit/base, written here by scripts/ab-base.sh COMMIT) on one machine in
# one command: machines of one kind differ by a few percent (up to 2.6% on the bench step
# between H100s, thirty-ninth session), so two commits are compared only so. Builds
# moe-dist in both (ARCHS, default 90; BUILD=0 reuses build-gpu in each), then ROUNDS
# (default 2) rounds of `moe-dist bench CONFIG` (configs/bench-h200.ini), base then this
# tree in even rounds and the reverse in odd ones (ABBA: a drift over the command falls on
# both), then with PEER=1 the compiled peer. Logs under $OUT (bench_base_R.log,
# bench_new_R.log); a table last: each run's step ms, tokens/s and final loss, each tree's
# mean step, and the difference.
set -uo pipefail
OUT=${OUT:-gpu-out}
BASE=${BASE:-.device-kit/base}
ARCHS=${ARCHS:-90}
ROUNDS=${ROUNDS:-2}
CONFIG=${CONFIG:-configs/bench-h200.ini}
B=build-gpu
mkdir -p "$OUT"
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
bash scripts/ab-build.sh gpu-ab-trees.sh "$BASE" "$ARCHS" "$OUT/build_" moe-dist || exit
table="$OUT/ab-trees.txt"
echo "base: $(cat "$BASE/.commit" 2>/dev/null || echo "$BASE"); config: $CONFIG" >"$table"
for ((r = 0; r < ROUNDS; r++)); do
  order="base new"
  [ $((r % 2)) = 1 ] && order="new base"
  for t in $order; do
    bin=./$B/moe-dist
    [ "$t" = base ] && bin=$BASE/$B/moe-dist
    log="$OUT/bench_${t}_$r.log"
    timeout 200 "$bin" bench "$CONFIG" >"$log" 2>&1 || echo "bench ($t, round $r): exit $?"
    step=$(grep -oE 'step_ms=[0-9.]+' "$log" | cut -d= -f2)
    tps=$(grep -oE ' tokens_per_s=[0-9.]+' "$log" | cut -d= -f2)
    loss=$(grep -oE 'final loss [0-9.]+' "$log" | cut -d' ' -f3)
    echo "round $r | $t | step ${step:-?} ms | ${tps:-?} tokens/s | loss ${loss:-?}" >>"$table"
  done
done
awk -F' [|] ' '/^round/ { split($3, s, " "); if (s[2] != "?") { n[$2]++; sum[$2] += s[2] } }
  END { if (n["base"] && n["new"]) { b = sum["base"] / n["base"]; a = sum["new"] / n["new"];
    printf "mean step: base %.3f ms (%d runs), new %.3f ms (%d runs), new - base %+.3f ms (%+.2f%%)\n",
      b, n["base"], a, n["new"], a - b, 100 * (a - b) / b } }' "$table" >>"$table"
if [ "${PEER:-0}" = 1 ]; then
  timeout 300 python3 .device-kit/peers/hf_mixtral_bench.py 4 32 8 2048 compile \
    >"$OUT/peer_compile.log" 2>&1 || echo "peer compile: exit $?"
  echo "peer: $(tail -1 "$OUT/peer_compile.log")" >>"$table"
fi
cat "$table"
