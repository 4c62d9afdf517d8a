# The optimizer's update in pieces during the backward (runtime/trainer.c update_piece):
# when nothing clips and no loss scale can skip a step, AdamW updates each layer's
# parameters as soon as their gradients are final (dense ones in a world of one, expert
# ones held by one rank), beside the rest of the backward; MOE_UPDATE_IN_BACKWARD=0
# queues every piece after it. The pieces give each element the whole step's bits, so
# the two orders must give the same losses and gradient norms bit for bit: in one
# process (plain and with two micro-batches a step, whose first must not update) and
# on two ranks with ep 2 (the experts beside the backward, the dense parameters after
# their reduction).
# (The default config clips at 1.0, which takes the whole-arena update after the norm:
# these runs set grad_clip = 0.) The whole-arena update (grad_clip huge: the same factor
# 1, its norm summed apart) must
# give the same losses, and the norm within 1e-12.
source "$(dirname "$0")/../lib.sh"
run() { # name ranks extra-sets...
  local name=$1 np=$2
  shift 2
  mpi "$np" -x MOE_UPDATE_IN_BACKWARD="${MOE_UPDATE_IN_BACKWARD:-1}" \
    -x MOE_UPDATE_DEFER="${MOE_UPDATE_DEFER:-0}" "$MOE" train --set train.steps=12 --set train.grad_clip=0 --set log.jsonl="$WORK/$name.jsonl" "$@" \
    >"$WORK/$name.log" 2>&1 || { fail "$name: exit $?"; tail -3 "$WORK/$name.log"; }
}
same() { # a b what (a missing or empty log is no match: losses of neither would be empty)
  [ -s "$WORK/$1.jsonl" ] && [ -s "$WORK/$2.jsonl" ] &&
    cmp -s <(losses "$WORK/$1.jsonl") <(losses "$WORK/$2.jsonl") &&
    pass "$3: the same 12 steps bit for bit" || fail "$3: the runs differ"
}
run plain 1
MOE_UPDATE_IN_BACKWARD=0 run plain-after 1
same plain plain-after "one process"
run accum 1 --set train.grad_accum=2
MOE_UPDATE_IN_BACKWARD=0 run accum-after 1 --set train.grad_accum=2
same accum accum-after "two micro-batches a step"
run ep2 2 --set parallel.ep=2
MOE_UPDATE_IN_BACKWARD=0 run ep2-after 2 --set parallel.ep=2
same ep2 ep2-after "two ranks, ep 2"
# The first buckets' pieces queued after the step's losses are fetched, beside the next
# step's forward (MOE_UPDATE_DEFER=n, the default on a GPU): the next forward waits for
# each where it reads its parameters, and the step's norm comes back with the next step's
# losses. On the cpu the pieces run at once, so these check the bookkeeping: the held
# step's sums filled in and reported, the dense gradients of those buckets zeroed where
# the forward waits, the held step settled before a checkpoint and at the end.
MOE_UPDATE_DEFER=2 run plain-defer2 1
same plain plain-defer2 "one process, 2 of 5 buckets a step later"
MOE_UPDATE_DEFER=5 run plain-defer5 1
same plain plain-defer5 "one process, every bucket a step later"
MOE_UPDATE_DEFER=3 run accum-defer 1 --set train.grad_accum=2
same accum accum-defer "two micro-batches a step, 3 buckets a step later"
MOE_UPDATE_DEFER=3 run ep2-defer 2 --set parallel.ep=2
same ep2 ep2-defer "two ranks, ep 2, 3 buckets a step later"
# a checkpoint at step 4 and 8, then a resume from step 4: the same 12 steps
MOE_UPDATE_DEFER=3 run ckpt-defer 1 --set checkpoint.dir="$WORK/ck" --set checkpoint.interval=4
same plain ckpt-defer "3 buckets a step later, checkpoints every 4 steps"
rm -rf "$WORK/ck/step-00000008" "$WORK/ck/step-00000012"
MOE_UPDATE_DEFER=3 run resume-defer 1 --set checkpoint.dir="$WORK/ck" --set checkpoint.interval=4 --resume auto
cmp -s <(losses "$WORK/plain.jsonl" | tail -8) <(losses "$WORK/resume-defer.jsonl" | tail -8) &&
  pass "resumed at step 4 with 3 buckets a step later: steps 5-12 bit for bit" ||
  fail "the resumed run's steps 5-12 differ"
# a NaN in layer 2's gradients at step 4 (MOE_FAULT=nan@0:3): with every bucket a step
# later it is found by the next step, named by its bucket, and the run fails
MOE_FAULT=nan@0:3 MOE_UPDATE_DEFER=5 timeout 60 "$MOE" train --set train.steps=8 \
  --set train.grad_clip=0 --set log.jsonl="$WORK/nan.jsonl" >"$WORK/nan.log" 2>&1
rc=$?
[ $rc -ne 0 ] && grep -q "step 4: gradient norm is nan: the gradient of layer 2's dense parameters is not finite on this rank (found after step 5" "$WORK/nan.log" &&
  [ "$(wc -l <"$WORK/nan.jsonl")" -eq 3 ] &&
  pass "a NaN in a bucket updated a step later: exit $rc, named, steps 1-3 logged" ||
  { fail "a NaN a step later: exit $rc"; tail -3 "$WORK/nan.log"; }
# the start-up line says which order ran (so the comparisons cannot pass with one twice)
said() { # name pattern
  grep -q "^optimizer: $2" "$WORK/$1.log" && pass "$1: says '$2'" ||
    { fail "$1: no line 'optimizer: $2'"; grep "^optimizer" "$WORK/$1.log"; }
}
said plain "AdamW beside the backward, each stage"
said accum "AdamW beside the backward, each stage"
said plain-after "AdamW after the backward (MOE_UPDATE_IN_BACKWARD=0)"
said plain-defer2 "AdamW beside the backward, each stage.*; the first 2 of its 5 buckets (embedding, layers, head) beside the next step's forward"
said ep2-defer "AdamW beside the backward for the expert parameters.*; the first 3 of its 5 buckets"
said ep2 "AdamW beside the backward for the expert parameters"
run whole 1 --set train.grad_clip=1e30
said whole "AdamW after the backward (the global norm first"
$PY - "$WORK/plain.jsonl" "$WORK/whole.jsonl" <<'PY' && pass "the whole-arena update: the same losses, the norm within 1e-12" || fail "pieces against the whole-arena update"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 12
assert all(x["loss"] == y["loss"] for x, y in zip(a, b)), [(x["loss"], y["loss"]) for x, y in zip(a, b)]
worst = max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] for x, y in zip(a, b))
print(f"worst relative norm difference {worst:.2e}")
assert worst < 1e-12
PY
finish
