# At ep 1 the backward skips the exchange buffers where the dispatch's rows are the tokens
# (runtime/model.c, rows_are_tokens), and without capacity the forward too: the experts
# take the tokens, their plan and weights without packed rows (experts_take_tokens);
# MOE_EP1_EXCHANGE_ROWS=1 keeps the path through them both ways. Without shared experts
# both make the same additions: the same losses and gradient norms bit for bit, dropless
# (both shortcuts) and with capacity drops (top-3 at factor 1: some tokens keep no slot,
# so the backward's path changes from layer to layer; the forward packs rows). With a shared expert the direct path
# adds the routed rows onto the shared expert's gradient one by one (as ep > 1 does) where
# the other adds their sum: a different rounding, so the runs must differ, by little.
source "$(dirname "$0")/../lib.sh"
run() { # name extra-sets...
  local name=$1
  shift
  "$MOE" train --set train.steps=20 --set log.jsonl="$WORK/$name.jsonl" "$@" >"$WORK/$name.log" 2>&1 ||
    { fail "$name: exit $?"; tail -3 "$WORK/$name.log"; }
}
for mode in dropless capacity; do
  extra=()
  [ $mode = capacity ] && extra=(--set model.capacity_factor=1.0 --set model.top_k=3)
  run "$mode" "${extra[@]}"
  MOE_EP1_EXCHANGE_ROWS=1 run "$mode-rows" "${extra[@]}"
  cmp -s <(losses "$WORK/$mode.jsonl") <(losses "$WORK/$mode-rows.jsonl") &&
    pass "$mode: the direct backward repeats the exchange path's 20 steps bit for bit" ||
    fail "$mode: the direct backward and the exchange path differ"
done
grep -q '"dropped":[1-9]' "$WORK/capacity.jsonl" && pass "capacity mode drops assignments" ||
  fail "capacity mode dropped nothing"
run shared --set model.shared_experts=1
MOE_EP1_EXCHANGE_ROWS=1 run shared-rows --set model.shared_experts=1
$PY - "$WORK/shared.jsonl" "$WORK/shared-rows.jsonl" <<'PY' && pass "shared expert: other roundings, within 1e-5" || fail "shared expert: the two paths"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 20
worst = max(abs(x[k] - y[k]) / abs(x[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm"))
print(f"worst relative difference {worst:.2e}")
assert 0 < worst < 1e-5, worst
PY
finish
