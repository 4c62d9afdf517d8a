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
  mpi "$np" -x MOE_UPDATE_IN_BACKWARD="${MOE_UPDATE_IN_BACKWARD:-1}" "$MOE" train --set train.steps=12 --set train.grad_clip=0 --set log.jsonl="$WORK/$name.jsonl" "$@" \
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
# the start-up line says which order ran (so the comparisons cannot pass with one twice)
said() { # name pattern
  grep -q "^optimizer: $2" "$WORK/$1.log" && pass "$1: says '$2'" ||
    { fail "$1: no line 'optimizer: $2'"; grep "^optimizer" "$WORK/$1.log"; }
}
said plain "AdamW beside the backward, each stage"
said accum "AdamW beside the backward, each stage"
said plain-after "AdamW after the backward (MOE_UPDATE_IN_BACKWARD=0)"
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
