# Routing statistics counted on the GPU (device-side counters, read back at the end of
# the run) equal the CPU's: 20 fp32 steps of the tiny config route identically on both
# (their losses agree to ~1e-8), so every count (tokens, load, co-activation, transitions)
# must be the same integer. Without a GPU: exit 77.
source "$(dirname "$0")/../lib.sh"
require_gpu
for be in cpu cuda; do
  "$MOE" train --set parallel.backend=$be --set train.steps=20 \
    --set log.routing_stats="$WORK/$be.stats" >"$WORK/$be.out" 2>&1 || fail "$be run: exit $?"
done
if cmp -s "$WORK/cpu.stats" "$WORK/cuda.stats"; then pass "GPU routing statistics equal the CPU's"
else fail "routing statistics differ"; diff "$WORK/cpu.stats" "$WORK/cuda.stats" | head -5; fi
grep -q "coact\|load" "$WORK/cuda.stats" && pass "the file has counts" || fail "empty statistics"
"$MOE" inspect "$WORK/cuda.stats" >"$WORK/inspect" 2>&1 && pass "inspect reads it" || fail "inspect"
finish
