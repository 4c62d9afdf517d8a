# kill -9 of one of 4 ranks mid-run: every rank exits within 30 s, the job's status is
# non-zero, a message names the lost rank (mpirun's "process rank 2 ... exited on
# signal 9"), and no process of the job is left.
source "$(dirname "$0")/../lib.sh"
mkdir -p "$WORK/pids"
cat >"$WORK/wrap.sh" <<'SH'
#!/bin/sh
echo $$ >"$PIDS/pid.$OMPI_COMM_WORLD_RANK"
exec "$@"
SH
chmod +x "$WORK/wrap.sh"
PIDS=$WORK/pids timeout 120 mpirun --oversubscribe --bind-to none -np 4 -x PIDS "$WORK/wrap.sh" \
  "$MOE" train --set parallel.ep=2 --set train.steps=100000 >"$WORK/out" 2>"$WORK/err" &
job=$!
for _ in $(seq 600); do
  [ "$(ls "$WORK/pids" | wc -l)" -eq 4 ] && grep -q "^step 3/" "$WORK/out" && break
  sleep 0.05
done
grep -q "^step 3/" "$WORK/out" && pass "the job is training" || fail "the job did not start"
start=$(date +%s.%N)
kill -9 "$(cat "$WORK/pids/pid.2")"
wait $job
rc=$?
# every rank must be gone too (Open MPI sends the survivors SIGTERM, then SIGKILL)
alive=4
while [ $alive -gt 0 ] && [ "$(echo "$(date +%s.%N) - $start < 30" | bc)" = 1 ]; do
  alive=0
  for f in "$WORK"/pids/pid.*; do kill -0 "$(cat "$f")" 2>/dev/null && alive=$((alive + 1)); done
  [ $alive -gt 0 ] && sleep 0.2
done
took=$(echo "$(date +%s.%N) - $start" | bc)
if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then pass "the job ended with status $rc"
else fail "status $rc (124 = hung until the timeout)"; fi
[ $alive -eq 0 ] && pass "every rank exited within ${took%.*}s of the kill (< 30 s)" ||
  fail "$alive rank(s) still running ${took%.*}s after the kill"
expect_err "process rank 2 .*exited on signal 9" "the message names the lost rank"
grep -E "rank 2" "$WORK/err" | head -2 | sed 's/^/    /'
finish
