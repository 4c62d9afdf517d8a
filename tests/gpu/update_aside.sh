# The update in pieces on a GPU (grad_clip = 0, not fp16: runtime/trainer.c update_piece)
# runs on the background queue, and each piece's sums of squares (adamw_square_final, the
# logged norm's parts) on the stream beside it (optim.cu, moe_cuda_aside_begin); the
# step's join must wait for them. 12 bf16 steps of the tiny config with the sums beside
# the queue and with them on it (MOE_ADAMW_ASIDE=0) must log the same losses and norms
# bit for bit, and the norm must be the whole-arena update's (grad_clip 1e30: the norm
# summed by its own pass before the update) within 1e-12, with the same losses: a sum
# read before it was written would show a stale or partial norm. On sm_75 (no bf16) fp16
# is used, which takes the whole-arena update in all three runs (the check still
# compares them). Without a GPU: exit 77.
source "$(dirname "$0")/../lib.sh"
require_gpu
mode=$(gpu_mode)
run() { # name clip [env...]
  local name=$1 clip=$2
  shift 2
  env "$@" "$MOE" train --set parallel.backend=cuda --set precision.mode=$mode \
    --set train.steps=12 --set train.grad_clip="$clip" --set log.jsonl="$WORK/$name.jsonl" \
    >"$WORK/$name.log" 2>&1 || fail "$name: exit $?"
}
run aside 0 MOE_ADAMW_ASIDE=1
run queue 0 MOE_ADAMW_ASIDE=0
run whole 1e30
# the first buckets' pieces beside the next step's forward: none (MOE_UPDATE_DEFER=0), 2 and
# all 5 of the tiny config's 5 buckets; the forward must wait for each piece where it
# reads its parameters, so all three log the same
run none 0 MOE_UPDATE_DEFER=0
run two 0 MOE_UPDATE_DEFER=2
run all 0 MOE_UPDATE_DEFER=5
for v in two:2 all:5; do
  name=${v%:*} n=${v#*:}
  [ "$(wc -l <"$WORK/$name.jsonl")" -eq 12 ] && cmp -s <(losses "$WORK/none.jsonl") <(losses "$WORK/$name.jsonl") &&
    pass "MOE_UPDATE_DEFER=$n and 0: the same 12 steps bit for bit ($mode)" ||
    { fail "MOE_UPDATE_DEFER=$n against 0"; diff <(losses "$WORK/none.jsonl") \
      <(losses "$WORK/$name.jsonl") | head -4; }
done
if [ "$mode" = bf16 ]; then
  grep -q "^optimizer: AdamW beside the backward, each stage" "$WORK/aside.log" &&
    pass "the pieces ran beside the backward" ||
    fail "no pieces: $(grep '^optimizer' "$WORK/aside.log")"
  grep -q "^optimizer: .*; the first 2 of its 5 buckets .* beside the next step's forward" "$WORK/two.log" &&
    pass "MOE_UPDATE_DEFER=2: 2 of 5 buckets beside the next step's forward" ||
    fail "MOE_UPDATE_DEFER=2 not deferred: $(grep '^optimizer' "$WORK/two.log")"
fi
[ "$(wc -l <"$WORK/aside.jsonl")" -eq 12 ] && [ "$(wc -l <"$WORK/queue.jsonl")" -eq 12 ] &&
  cmp -s <(losses "$WORK/aside.jsonl") <(losses "$WORK/queue.jsonl") &&
  pass "sums beside the queue and on it: the same 12 steps bit for bit ($mode)" ||
  { fail "the sums beside the queue change the log"; diff <(losses "$WORK/aside.jsonl") \
    <(losses "$WORK/queue.jsonl") | head -4; }
$PY - "$WORK/aside.jsonl" "$WORK/whole.jsonl" <<'PY' && pass "the pieces' norm is the whole-arena pass's within 1e-12, the same losses" || fail "pieces against the whole-arena update"
import json, math, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 12, (len(a), len(b))
assert all(x["loss"] == y["loss"] for x, y in zip(a, b)), [(x["loss"], y["loss"]) for x, y in zip(a, b)]
assert all(math.isfinite(y["grad_norm"]) and y["grad_norm"] > 0 for y in b)
worst = max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] for x, y in zip(a, b))
print(f"worst relative norm difference {worst:.2e}")
assert worst < 1e-12
PY
finish
