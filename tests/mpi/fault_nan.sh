# A NaN in a gradient (MOE_FAULT=nan@1:3 poisons rank 1's gradients of the last layer
# before the reduction) stops the fp32 run on every rank at once with a clear message
# naming the step and the layer; no rank takes the optimizer step. With grad_clip = 0 the
# norm comes from the optimizer's own pass, so the NaN is found after the update, with
# the same message and the same stop.
source "$(dirname "$0")/../lib.sh"
for clip in 1.0 0; do
  MOE_FAULT=nan@1:3 timeout 60 mpirun --oversubscribe --bind-to none -np 4 -x MOE_FAULT \
    "$MOE" train --set parallel.ep=2 --set train.steps=20 --set train.grad_clip=$clip \
    >"$WORK/out" 2>"$WORK/err"
  rc=$?
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && pass "clip $clip: the job ended with status $rc" || fail "clip $clip: status $rc"
  expect_err "step 4: gradient norm is nan: the gradient of layers\.2\.[a-z_.]+ \(layer 2\) is not finite" \
    "clip $clip: the message names the step and the layer"
  grep -q "^step 4/" "$WORK/out" && fail "clip $clip: step 4 was reported" || pass "clip $clip: step 4 was not reported"
  grep -m1 "gradient norm is nan" "$WORK/err" | sed 's/^/    /'
done
finish
