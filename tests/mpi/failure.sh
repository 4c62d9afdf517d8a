# One failing rank ends the whole job with a non-zero status and a message naming it,
# never a hang: an error returned on rank 1, and rank 2 dying outright (as kill -9).
source "$(dirname "$0")/../lib.sh"
for fault in fail@1:3 exit@2:3; do
  start=$(date +%s)
  MOE_FAULT=$fault timeout 60 mpirun --oversubscribe --bind-to none -np 4 -x MOE_FAULT \
    "$MOE" train "$SRC/configs/tiny.ini" --set parallel.ep=2 --set train.steps=50 \
    >"$WORK/out" 2>"$WORK/err"
  rc=$?
  took=$(($(date +%s) - start))
  if [ $rc -ne 0 ] && [ $rc -ne 124 ]; then pass "$fault: job ended with status $rc in ${took}s"
  else fail "$fault: status $rc after ${took}s (124 = hung until the timeout)"; fi
done
# the error path names the rank (host:rank prefix) and the injected cause
MOE_FAULT=fail@1:3 timeout 60 mpirun --oversubscribe --bind-to none -np 4 -x MOE_FAULT \
  "$MOE" train "$SRC/configs/tiny.ini" --set parallel.ep=2 >"$WORK/out" 2>"$WORK/err"
expect_err ":1: .*injected failure at step 3" "the failing rank is named"
# a malformed MOE_FAULT is refused with a message naming it
MOE_FAULT=boom "$MOE" train --set train.steps=1 >"$WORK/out" 2>"$WORK/err"
[ $? -ne 0 ] && pass "malformed MOE_FAULT refused" || fail "malformed MOE_FAULT accepted"
expect_err "MOE_FAULT='boom'" "the message names MOE_FAULT"
finish
