# Checkpoints in one process: a run stopped and resumed logs the same losses as the run
# that never stopped, bit for bit; retention keeps the newest K; a flipped byte in a
# tensor file and a truncated manifest are detected and named by inspect (exit 1) and by
# --resume (auto falls back with a warning; an explicit path is an error); a config whose
# model shape differs is refused naming the key; interval_minutes saves by the clock;
# SIGUSR1 checkpoints and exits 75, and resuming from there is exact too.
source "$(dirname "$0")/../lib.sh"
C=$WORK/ckpt
base=(--set train.steps=12 --set checkpoint.dir="$C")
expect_exit 0 "uninterrupted run" -- "$MOE" train "${base[@]}" --set log.jsonl="$WORK/full.jsonl"
losses "$WORK/full.jsonl" >"$WORK/full.txt"
rm -rf "$C"
expect_exit 0 "run saving every 4 steps" -- "$MOE" train "${base[@]}" --set checkpoint.interval=4 \
  --set checkpoint.keep=3 --set log.jsonl="$WORK/part.jsonl"
[ "$(ls "$C")" = "$(printf 'step-00000004\nstep-00000008\nstep-00000012')" ] &&
  pass "keep 3: steps 4, 8, 12 on disk" || fail "checkpoints on disk: $(ls "$C" | tr '\n' ' ')"
[ -f "$C/step-00000008/COMMITTED" ] && [ -f "$C/step-00000008/manifest.pb" ] &&
  [ -f "$C/step-00000008/rank-00000.bin" ] && pass "layout: COMMITTED, manifest.pb, rank-00000.bin" ||
  fail "checkpoint layout: $(ls "$C/step-00000008")"
expect_exit 0 "inspect verifies a good checkpoint" -- "$MOE" inspect "$C/step-00000008"
grep -q "^step 8, data position 64 sequences, optimizer t 8" "$WORK/out" &&
  grep -q "tensor name=layers.2.moe.experts.w1 layer=2 expert=7 kind=adam_v shape=128x64 dtype=f32 file=rank-00000.bin" "$WORK/out" &&
  grep -q "every CRC32C matches" "$WORK/out" && pass "inspect prints step, position, slices" ||
  { fail "inspect output"; head -12 "$WORK/out"; }

# resume from step 8 after losing step 12: bit-identical losses for steps 9..12
rm -rf "$C/step-00000012"
expect_exit 0 "resume auto" -- "$MOE" train "${base[@]}" --set checkpoint.interval=4 \
  --set log.jsonl="$WORK/part.jsonl" --resume auto
grep -q "resumed from $C/step-00000008: step 8" "$WORK/out" && pass "resumed at step 8" || fail "resume point"
losses "$WORK/part.jsonl" >"$WORK/part.txt"
cmp -s "$WORK/full.txt" "$WORK/part.txt" && pass "resumed losses equal the uninterrupted run bit for bit" ||
  { fail "resumed run differs"; diff "$WORK/full.txt" "$WORK/part.txt" | head -4; }

# a flipped byte in the newest tensor file: inspect names it; auto falls back to step 8
printf '\x55' | dd of="$C/step-00000012/rank-00000.bin" bs=1 seek=300000 conv=notrunc 2>/dev/null
expect_exit 1 "inspect: flipped byte" -- "$MOE" inspect "$C/step-00000012"
expect_err "step-00000012/rank-00000.bin: CRC32C mismatch" "inspect names the bad file"
expect_exit 1 "explicit --resume PATH with a bad checksum" -- "$MOE" train "${base[@]}" --resume "$C/step-00000012"
expect_err "step-00000012/rank-00000.bin: CRC32C mismatch" "the error names the file"
expect_exit 0 "--resume auto falls back" -- "$MOE" train "${base[@]}" --resume auto
expect_err "rank-00000.bin: CRC32C mismatch" "the warning names the bad file"
expect_err "warning: checkpoint .*step-00000012 is unusable.*falling back" "fallback announced"
grep -q "resumed from $C/step-00000008" "$WORK/out" && pass "fell back to step 8" || fail "did not fall back"

# a truncated manifest: named; auto falls back past it
rm -rf "$C"
"$MOE" train "${base[@]}" --set train.steps=4 --set checkpoint.interval=2 >/dev/null 2>&1
truncate -s 1000 "$C/step-00000004/manifest.pb"
expect_exit 1 "inspect: truncated manifest" -- "$MOE" inspect "$C/step-00000004"
expect_err "step-00000004/manifest.pb: truncated" "inspect names manifest.pb"
expect_exit 0 "--resume auto past a truncated manifest" -- "$MOE" train "${base[@]}" --set train.steps=4 --resume auto
expect_err "manifest.pb: truncated" "the warning names manifest.pb"
grep -q "resumed from $C/step-00000002" "$WORK/out" && pass "fell back to step 2" || fail "no fallback to step 2"

# an interrupted save (a .tmp directory) is never picked
rm -rf "$C"
"$MOE" train "${base[@]}" --set train.steps=4 --set checkpoint.interval=2 >/dev/null 2>&1
mkdir -p "$C/.tmp-step-00000099"
expect_exit 0 "a .tmp directory is ignored" -- "$MOE" train "${base[@]}" --set train.steps=5 --resume auto
grep -q "resumed from $C/step-00000004" "$WORK/out" && pass "resumed from the newest committed" || fail "picked the wrong one"

# another model shape is refused, naming the key; exit 2
expect_exit 2 "model shape differs" -- "$MOE" train "${base[@]}" --set model.expert_hidden=64 --resume auto
expect_err "expert_hidden = 64, but checkpoint .* was saved with expert_hidden = 128" "the key is named"
expect_exit 1 "resume from a missing path" -- "$MOE" train "${base[@]}" --resume "$WORK/nowhere"
expect_err "nowhere: no such checkpoint directory" "missing path named"

# interval_minutes: a tiny interval saves at every step boundary (rank 0's clock)
rm -rf "$C"
expect_exit 0 "interval_minutes" -- "$MOE" train "${base[@]}" --set train.steps=3 \
  --set checkpoint.interval_minutes=1e-6 --set checkpoint.keep=5
[ "$(ls "$C" | wc -l)" -eq 3 ] && pass "a checkpoint at each of 3 steps" || fail "interval_minutes: $(ls "$C")"

# SIGUSR1: checkpoint at the next step boundary, exit 75; resuming continues exactly
rm -rf "$C"
"$MOE" train "${base[@]}" --set train.steps=40 --set log.jsonl="$WORK/sig.jsonl" >"$WORK/out" 2>"$WORK/err" &
pid=$!
for _ in $(seq 300); do grep -q "^step 3/40" "$WORK/out" && break; sleep 0.05; done
kill -USR1 $pid
wait $pid
rc=$?
[ $rc -eq 75 ] && pass "SIGUSR1: exit 75" || fail "SIGUSR1: exit $rc, want 75"
stop=$(sed -n 's/^stopped at step \([0-9]*\) of 40.*/\1/p' "$WORK/out")
[ -n "$stop" ] && [ -f "$C/$(printf 'step-%08d' "$stop")/COMMITTED" ] &&
  pass "stopped at step $stop with a committed checkpoint" || fail "no checkpoint after SIGUSR1"
expect_exit 0 "resume after SIGUSR1" -- "$MOE" train "${base[@]}" --set train.steps=40 \
  --set log.jsonl="$WORK/sig.jsonl" --resume auto
"$MOE" train "${base[@]}" --set train.steps=40 --set checkpoint.dir="$WORK/none" \
  --set log.jsonl="$WORK/full40.jsonl" >/dev/null 2>&1
cmp -s <(losses "$WORK/full40.jsonl") <(losses "$WORK/sig.jsonl") &&
  pass "stopped + resumed run equals the uninterrupted one bit for bit" || fail "SIGUSR1 resume differs"
finish
