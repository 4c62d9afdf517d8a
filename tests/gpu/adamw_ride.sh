# The update's rides (MOE_ADAMW_RIDE=1, a trial: kernels/cuda/adamw_ride.cuh): each
# expert piece of the update (bf16 master weights, moments and gradients; grad_clip 0, so
# the pieces run beside the backward) is cut into chunks, which the idle warps of the
# grouped GEMMs on the queue and the update's own kernel on the background take from one
# counter. 12 bf16 steps of the tiny config with bf16 expert state, with the knob and
# without, must log the same losses bit for bit (every weight and moment gets the
# whole-arena pass's bits; a chunk stepped twice, or not at all, or a sum read before the
# join would show) and the same gradient norms within 1e-12 (the rides add their squares
# in another order). `moe-dist bench` with the knob prints the chunks queued and who took
# them: the two takers' counts must add up to the chunks queued (each chunk taken once),
# some must have been queued, and with form 2 the GEMMs' warps took some on sm_90 (none
# on other GPUs, whose experts' GEMMs are cuBLAS's). With the knob the trainer also gives
# the down projections a piece of their own (docs/design.md), which rides too. bf16 only
# (sm_80 on): on sm_75 it skips. Without a GPU: exit 77.
source "$(dirname "$0")/../lib.sh"
require_gpu
if [ "$(gpu_mode)" != bf16 ]; then
  echo "SKIP: the rides need bf16 master weights, which this GPU does not train in"
  exit 77
fi
set16=(--set parallel.backend=cuda --set precision.mode=bf16 --set precision.master_weights=bf16
  --set precision.optimizer_state=bf16 --set precision.expert_grads=bf16 --set train.grad_clip=0)
run() { # name [env...]
  local name=$1
  shift
  env "$@" "$MOE" train "${set16[@]}" --set train.steps=12 --set log.jsonl="$WORK/$name.jsonl" \
    >"$WORK/$name.log" 2>&1 || fail "$name: exit $?"
}
run plain MOE_ADAMW_RIDE=0
run ride MOE_ADAMW_RIDE=1
run join MOE_ADAMW_RIDE=2
grep -q "^optimizer: AdamW beside the backward, each stage" "$WORK/ride.log" &&
  pass "the pieces ran beside the backward" ||
  fail "no pieces: $(grep '^optimizer' "$WORK/ride.log")"
for form in ride join; do
  $PY - "$WORK/$form.jsonl" "$WORK/plain.jsonl" <<'PY' && pass "$form: the same losses bit for bit, the norms within 1e-12" || fail "$form against the update's own pass"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 12, (len(a), len(b))
assert all(x["loss"] == y["loss"] for x, y in zip(a, b)), [(x["loss"], y["loss"]) for x, y in zip(a, b)]
worst = max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] for x, y in zip(a, b))
print(f"worst relative norm difference {worst:.2e}")
assert worst < 1e-12
PY
done
# the counts: each chunk taken once, in both forms; with the update's own kernel only at
# the join (2), the GEMMs' warps took some on sm_90 (the wgmma grouped kernel's), none
# elsewhere (cuBLAS runs the experts' GEMMs there)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
for mode in 1 2; do
  MOE_ADAMW_RIDE=$mode "$MOE" bench "${set16[@]}" >"$WORK/bench$mode.log" 2>&1 ||
    fail "bench, MOE_ADAMW_RIDE=$mode: exit $?"
  line=$(grep "AdamW rides" "$WORK/bench$mode.log")
  echo "    MOE_ADAMW_RIDE=$mode: $line"
  set -- $(echo "$line" | sed -n 's/.*: \([0-9]*\) chunks queued, \([0-9]*\) taken inside.*, \([0-9]*\) by.*/\1 \2 \3/p')
  [ $# -eq 3 ] && [ "$1" -gt 0 ] && [ $(($2 + $3)) -eq "$1" ] &&
    { [ "$mode" = 1 ] || { [ "$cc" = 90 ] && [ "$2" -gt 0 ]; } || { [ "$cc" != 90 ] && [ "$2" -eq 0 ]; }; } &&
    pass "MOE_ADAMW_RIDE=$mode: each of the $1 chunks taken once ($2 inside the GEMMs, $3 by the update's kernel)" ||
    fail "MOE_ADAMW_RIDE=$mode: ride counts '$line'"
done
finish
