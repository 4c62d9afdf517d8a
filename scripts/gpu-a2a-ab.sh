#!/usr/bin/env bash
# On the GPU host (after `. .device-kit/setup.sh`): the exchange's kernels of this tree
# against another's (BASE, default .device-kit/base, written here by scripts/ab-base.sh
# COMMIT) on one GPU in one command, as gpu-ab-trees.sh does for the step. Builds
# moe-bench in both (ARCHS, default 90; BUILD=0 reuses build-gpu in each), then for each
# of PRECISIONS (default "bf16 fp16") runs `mpirun -np 1 moe-bench a2a --precision P
# --reps REPS` (default 50) base, new, new, base (ABBA: a drift over the command falls on
# both). ENV_NEW, when set (e.g. MOE_EXCHANGE_ROWS_V8=0, or several assignments separated
# by spaces), adds one more run of this tree at bf16 under that environment. Logs under
# $OUT (a2a_TAG.log); a table last: each op's ms in each run, and each tree's mean.
set -uo pipefail
OUT=${OUT:-gpu-out}
BASE=${BASE:-.device-kit/base}
ARCHS=${ARCHS:-90}
PRECISIONS=${PRECISIONS:-bf16 fp16}
REPS=${REPS:-50}
B=build-gpu
mkdir -p "$OUT"
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac
bash scripts/ab-build.sh gpu-a2a-ab.sh "$BASE" "$ARCHS" "$OUT/build_a2a_" moe-bench || exit
tags=()
run() { # tag binary precision [VAR=value]
  local log="$OUT/a2a_$1.log"
  # shellcheck disable=SC2086 # ENV_NEW: assignments separated by spaces
  env ${4:+$4} timeout 120 mpirun -np 1 "$2" a2a --precision "$3" --reps "$REPS" >"$log" 2>&1
  local rc=$?
  [ $rc = 0 ] || echo "moe-bench a2a ($1): exit $rc (see $log)"
  tags+=("$1")
}
for p in $PRECISIONS; do
  run "${p}_base1" "$BASE/$B/bench/moe-bench" "$p"
  run "${p}_new1" "./$B/bench/moe-bench" "$p"
  run "${p}_new2" "./$B/bench/moe-bench" "$p"
  run "${p}_base2" "$BASE/$B/bench/moe-bench" "$p"
done
[ -n "${ENV_NEW:-}" ] && run "bf16_new_env" "./$B/bench/moe-bench" bf16 "$ENV_NEW"
table="$OUT/a2a-ab.txt"
echo "base: $(cat "$BASE/.commit" 2>/dev/null || echo "$BASE"); ms per op (moe-bench a2a, one rank)${ENV_NEW:+; env run: $ENV_NEW}" >"$table"
python3 - "$OUT" "${tags[@]}" >>"$table" <<'PY'
import re, sys
out, tags = sys.argv[1], sys.argv[2:]
ms = {}  # op -> tag -> ms
ops = []
for t in tags:
    try:
        lines = open(f"{out}/a2a_{t}.log").read().splitlines()
    except OSError:
        continue
    for line in lines:
        f = line.split()
        # the op's name, then its shape, then the first number with four decimals: its ms
        num = next((x for x in f[1:] if re.fullmatch(r"[0-9]+\.[0-9]{4}", x)), None)
        if not f or num is None or not re.fullmatch(r"[a-z_0-9]+", f[0]):
            continue
        if f[0] not in ops:
            ops.append(f[0])
        ms.setdefault(f[0], {})[t] = float(num)
precs = sorted({t.split("_")[0] for t in tags})
print("%-16s" % "op" + "".join("%14s" % t for t in tags) + "".join("%16s" % f"{p} base/new" for p in precs))
for op in ops:
    row = "%-16s" % op + "".join("%14s" % (f"{ms[op][t]:.4f}" if t in ms[op] else "-") for t in tags)
    for p in precs:
        b = [ms[op][t] for t in tags if t.startswith(p + "_base") and t in ms[op]]
        n = [ms[op][t] for t in tags if t.startswith(p + "_new") and not t.endswith("_env") and t in ms[op]]
        row += "%16s" % (f"{(sum(b) / len(b)) / (sum(n) / len(n)):.3f}" if b and n else "-")
    print(row)
PY
cat "$table"
