# A rank that stops answering (MOE_FAULT=hang@2:3) ends the job at [parallel]
# comm_timeout_s (5 s here) instead of hanging: the ranks waiting for it report what
# they waited for and name it ("timeout after 5 s in the token-count exchange of layer 1
# (forward): no message from rank 2"), then the job is aborted with a non-zero status.
source "$(dirname "$0")/../lib.sh"
start=$(date +%s)
MOE_FAULT=hang@2:3 timeout 60 mpirun --oversubscribe --bind-to none -np 4 -x MOE_FAULT \
  "$MOE" train --set parallel.ep=4 --set train.steps=100 --set parallel.comm_timeout_s=5 \
  >"$WORK/out" 2>"$WORK/err"
rc=$?
took=$(($(date +%s) - start))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 30 ]; then pass "the job ended with status $rc in ${took}s"
else fail "status $rc after ${took}s (124 = hung until the timeout)"; fi
expect_err "timeout after 5 s in the token-count exchange of layer 1 \(forward dispatch\): no message from rank 2" \
  "the silent rank, the operation and the layer are named"
grep -m1 "timeout after" "$WORK/err" | sed 's/^/    /'
# a collective cannot name one rank: with ep 2 the ranks of the other EP group time out
# in a reduction over the world and say so (group named)
MOE_FAULT=hang@3:2 timeout 60 mpirun --oversubscribe --bind-to none -np 4 -x MOE_FAULT \
  "$MOE" train --set parallel.ep=2 --set train.steps=100 --set parallel.comm_timeout_s=3 \
  >"$WORK/out" 2>"$WORK/err"
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && pass "ep 2: the job ended with status $rc" || fail "ep 2: status $rc"
expect_err "timeout after 3 s in the .*(no message from rank 3|group)" "ep 2: the timeout is reported"
finish
