# Helpers for the scripted tests: tests/<kind>/<name>.sh MOE_DIST SOURCE_DIR
set -uo pipefail
MOE=$1
SRC=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export OMPI_MCA_rmaps_base_oversubscribe=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FAILS=0
PY=/usr/bin/python3

pass() { echo "ok: $*"; }
fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }

# expect_exit CODE DESCRIPTION -- command...: runs the command, checks its exit status.
expect_exit() {
  local want=$1 what=$2
  shift 3
  "$@" >"$WORK/out" 2>"$WORK/err"
  local got=$?
  if [ "$got" -eq "$want" ]; then pass "$what (exit $got)"; else fail "$what: exit $got, want $want"; sed 's/^/    /' "$WORK/err" | head -5; fi
}

# expect_err PATTERN DESCRIPTION: the last command's stderr matches the extended regex.
expect_err() {
  if grep -Eq -- "$1" "$WORK/err"; then pass "$2"; else fail "$2: stderr lacks /$1/"; sed 's/^/    /' "$WORK/err" | head -5; fi
}

mpi() { mpirun --oversubscribe --bind-to none -np "$@"; }

# require_gpu: unless the CUDA backend trains a step here, says SKIP with the reason and
# exits 77 (ctest's skip: the GPU tests on a machine without one).
require_gpu() {
  if ! "$MOE" train --set parallel.backend=cuda --set train.steps=1 >"$WORK/probe" 2>&1; then
    echo "SKIP: no usable GPU ($(tail -1 "$WORK/probe"))"
    exit 77
  fi
}

# gpu_mode: prints bf16 where the GPU trains in it, else fp16 (refused below sm_80).
gpu_mode() {
  "$MOE" train --set parallel.backend=cuda --set precision.mode=bf16 --set train.steps=1 \
    >"$WORK/probe16" 2>&1 && echo bf16 || echo fp16
}

# losses FILE.jsonl: its records without the timings (step_s, tok_per_s, and the
# communication's *_ms of a run on several ranks), keys sorted,
# one line a step in step order (the last record of a step that appears twice, as after
# a resume): two runs' outputs compare with cmp, bit for bit.
losses() { $PY - "$1" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    for k in ("step_s", "tok_per_s"):
        r.pop(k)
    for k in [k for k in r if k.endswith("_ms")]:
        r.pop(k)
    rows[r["step"]] = json.dumps(r, sort_keys=True)
for s in sorted(rows):
    print(rows[s])
PY
}

finish() {
  if [ "$FAILS" -ne 0 ]; then echo "$FAILS check(s) failed"; exit 1; fi
  echo "all checks passed"
}
