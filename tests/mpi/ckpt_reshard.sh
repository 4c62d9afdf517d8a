# Checkpoints across ranks: saved at world 4, ep 2 (rank 0 writes the dense tensors,
# ranks 0 and 1 their experts); resumed at the same world size the losses equal the
# uninterrupted run's bit for bit; resumed at world 2 / ep 2, world 4 / ep 4 and world 1
# (experts re-sharded by global name, grad_accum trading ranks for the same global
# batch) they agree within the fp32 tolerance of invariance.sh (2e-5 relative).
# SIGUSR1 to one rank stops every rank after a checkpoint with exit 75. A crash halfway
# through writing a checkpoint (MOE_FAULT=ckptcrash) leaves only a .tmp directory: the
# previous checkpoint is the one resumed.
source "$(dirname "$0")/../lib.sh"
C=$WORK/ckpt
TOL=2e-5
common=(--set train.steps=8 --set checkpoint.dir="$C" --set checkpoint.keep=4)

compare() { # reference other tolerance: steps 5..8 (the last line of a step wins)
  $PY - "$1" "$2" "$3" <<'PY'
import json, sys
def rows(p):
    out = {}
    for l in open(p):
        r = json.loads(l)
        out[r["step"]] = r
    return out
a, b, tol = rows(sys.argv[1]), rows(sys.argv[2]), float(sys.argv[3])
worst = 0.0
for s in range(5, 9):
    for k in ("loss", "ce", "aux", "z", "grad_norm", "lr"):
        x, y = a[s][k], b[s][k]
        rel = abs(x - y) / max(abs(x), 1e-12)
        worst = max(worst, rel)
        if rel > tol:
            sys.exit(f"step {s} {k}: {y!r} vs {x!r} (rel {rel:.2e})")
print(f"steps 5-8: worst relative difference {worst:.2e}")
PY
}

mpi 4 "$MOE" train "${common[@]}" --set parallel.ep=2 --set checkpoint.interval=4 \
  --set log.jsonl="$WORK/full.jsonl" >"$WORK/full.log" 2>&1 || fail "world 4 run: exit $?"
ls "$C/step-00000004" | grep -q "rank-00001.bin" && ! ls "$C/step-00000004" | grep -q "rank-00002.bin" &&
  pass "ranks 0 and 1 wrote tensor files, ranks 2 and 3 none" || fail "files: $(ls "$C/step-00000004")"
"$MOE" inspect "$C/step-00000004" >"$WORK/inspect.txt" 2>&1 &&
  grep -q "world 4, ep 2" "$WORK/inspect.txt" &&
  grep -q "tensor name=layers.1.moe.experts.w2 layer=1 expert=5 kind=param shape=64x128 dtype=f32 file=rank-00001.bin" "$WORK/inspect.txt" &&
  grep -q "placement layer 1: 0 0 0 0 1 1 1 1" "$WORK/inspect.txt" &&
  pass "inspect: world, ep, placement, expert 5 in rank-00001.bin" || { fail "inspect of a 4-rank checkpoint"; head -12 "$WORK/inspect.txt"; }

resume() { # name world ep accum tolerance
  rm -rf "$C/step-00000008"
  mpi "$2" "$MOE" train "${common[@]}" --set parallel.ep="$3" --set train.grad_accum="$4" \
    --set log.jsonl="$WORK/$1.jsonl" --resume auto >"$WORK/$1.log" 2>&1 ||
    { fail "$1: exit $?"; tail -5 "$WORK/$1.log"; return; }
  grep -q "resumed from $C/step-00000004: step 4" "$WORK/$1.log" || fail "$1: did not resume at step 4"
  compare "$WORK/full.jsonl" "$WORK/$1.jsonl" "$5" && pass "$1 matches the uninterrupted run (tolerance $5)" ||
    fail "$1 differs from the uninterrupted run"
}
resume w4ep2 4 2 1 0   # same world: bit for bit
resume w2ep2 2 2 2 $TOL
resume w4ep4 4 4 1 $TOL
resume w1 1 1 4 $TOL
grep -q "saved at world 4, ep 2: experts re-sharded" "$WORK/w4ep4.log" && pass "re-sharding announced" || fail "no re-shard message"

# SIGUSR1 to rank 1 alone: every rank stops at the same step boundary after a checkpoint
rm -rf "$C"
mkdir -p "$WORK/pids"
cat >"$WORK/wrap.sh" <<'SH'
#!/bin/sh
echo $$ >"$PIDS/pid.$OMPI_COMM_WORLD_RANK"
exec "$@"
SH
chmod +x "$WORK/wrap.sh"
PIDS=$WORK/pids mpirun --oversubscribe --bind-to none -np 4 -x PIDS "$WORK/wrap.sh" "$MOE" train \
  "${common[@]}" --set train.steps=200 --set parallel.ep=2 >"$WORK/sig.log" 2>&1 &
job=$!
for _ in $(seq 400); do [ -s "$WORK/pids/pid.1" ] && grep -q "^step 2/200" "$WORK/sig.log" && break; sleep 0.05; done
kill -USR1 "$(cat "$WORK/pids/pid.1")"
wait $job
rc=$?
[ $rc -eq 75 ] && pass "SIGUSR1 to rank 1: the job exits 75" || { fail "SIGUSR1: exit $rc, want 75"; tail -5 "$WORK/sig.log"; }
grep -q "stop requested (SIGUSR1/SIGTERM on 1 rank(s))" "$WORK/sig.log" && pass "the world agreed on the stop" || fail "no stop agreement"
stop=$(sed -n 's/^stopped at step \([0-9]*\) of 200.*/\1/p' "$WORK/sig.log")
[ -n "$stop" ] && "$MOE" inspect "$C/$(printf 'step-%08d' "$stop")" >/dev/null 2>&1 &&
  pass "checkpoint of step $stop verifies" || fail "no verified checkpoint after SIGUSR1"

# a crash halfway through writing the step-8 checkpoint (rank 1's file)
rm -rf "$C"
MOE_FAULT=ckptcrash@1:8 timeout 60 mpirun --oversubscribe --bind-to none -np 4 -x MOE_FAULT \
  "$MOE" train "${common[@]}" --set parallel.ep=2 --set checkpoint.interval=4 >"$WORK/crash.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && pass "crash mid-checkpoint ends the job (exit $rc)" || fail "crash: exit $rc"
[ -d "$C/.tmp-step-00000008" ] && [ ! -e "$C/step-00000008" ] && [ -f "$C/step-00000004/COMMITTED" ] &&
  pass "only a .tmp directory of step 8; step 4 intact" || fail "after the crash: $(ls -a "$C" | tr '\n' ' ')"
mpi 4 "$MOE" train "${common[@]}" --set parallel.ep=2 --set checkpoint.interval=4 \
  --resume auto >"$WORK/after.log" 2>&1 || fail "resume after the crash: exit $?"
grep -q "resumed from $C/step-00000004" "$WORK/after.log" && [ -f "$C/step-00000008/COMMITTED" ] &&
  [ ! -e "$C/.tmp-step-00000008" ] && pass "resumed from step 4; step 8 rewritten, the .tmp removed" ||
  fail "resume after the crash: $(ls -a "$C" | tr '\n' ' ')"
finish
