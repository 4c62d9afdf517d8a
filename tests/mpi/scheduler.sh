# The expert scheduler at run time, 4 ranks, 16 experts: placement = auto collects routing
# statistics and re-plans at step 10, moving expert weights and Adam state between ranks.
# Placement changes no math: the losses match a contiguous run (fp32, summation order only),
# also with AdamW's moments in bf16 (moved as they are).
# A plan file from plan-experts gives the same losses too, and fewer predicted rows.
source "$(dirname "$0")/../lib.sh"
TOL=2e-5
common=(--set parallel.ep=4 --set model.experts=16 --set train.steps=20)
mpi 4 "$MOE" train "$SRC/configs/tiny.ini" "${common[@]}" --set log.jsonl="$WORK/base.jsonl" \
  --set log.routing_stats="$WORK/stats.txt" >"$WORK/base.log" 2>&1 || fail "contiguous run: exit $?"
mpi 4 "$MOE" train "$SRC/configs/tiny.ini" "${common[@]}" --set log.jsonl="$WORK/auto.jsonl" \
  --set parallel.placement=auto --set parallel.replan_interval=10 >"$WORK/auto.log" 2>&1 ||
  fail "auto run: exit $?"
grep -q "re-plan at step 10" "$WORK/auto.log" && pass "re-planned at step 10" || fail "no re-plan"
grep -q "^moe-dist routing_stats v1 layers 2 experts 16 top_k 2 steps 20" "$WORK/stats.txt" &&
  pass "routing statistics written" || fail "statistics file header"
expect_exit 0 "inspect the statistics" -- "$MOE" inspect "$WORK/stats.txt"
grep -qi "layer" "$WORK/out" && pass "inspect prints the statistics" || fail "inspect output"
expect_exit 0 "plan-experts" -- "$MOE" plan-experts "$WORK/stats.txt" --ranks 4 --out "$WORK/plan.txt"
grep -Eq "predicted cross-rank token rows: [0-9]+ -> [0-9]+ \([0-9.]+% fewer\)" "$WORK/out" &&
  pass "plan-experts predicts the saving" || fail "plan-experts output"
# the cost model against the bytes the runtime counted over the same 20 contiguous steps:
# a row is one token vector (64 fp32) sent in dispatch and again in combine
predicted=$(sed -n 's/^predicted cross-rank token rows: \([0-9]*\) -> .*/\1/p' "$WORK/out")
$PY - "$WORK/base.jsonl" "$predicted" <<'PY' && pass "cost model matches counted bytes" || fail "cost model"
import json, sys
rows = sum(json.loads(l)["a2a_bytes"] for l in open(sys.argv[1])) / (2 * 64 * 4)
pred = float(sys.argv[2])
print(f"cross-rank rows: counted {rows:.0f}, predicted {pred:.0f} ({100*(pred/rows-1):+.2f}%)")
assert abs(pred / rows - 1) < 0.02
PY
mpi 4 "$MOE" train "$SRC/configs/tiny.ini" "${common[@]}" --set log.jsonl="$WORK/file.jsonl" \
  --set parallel.placement="$WORK/plan.txt" >"$WORK/file.log" 2>&1 || fail "plan-file run: exit $?"
$PY - "$WORK" "$TOL" <<'PY' && pass "placement changes no math" || fail "losses differ"
import json, sys
d, tol = sys.argv[1], float(sys.argv[2])
load = lambda n: [json.loads(l) for l in open(f"{d}/{n}.jsonl")]
base, auto, plan = load("base"), load("auto"), load("file")
assert len(base) == len(auto) == len(plan) == 20
for name, run in (("auto", auto), ("file", plan)):
    worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(base, run))
    print(f"{name}: worst relative loss difference {worst:.2e}")
    assert worst <= tol, name
# the plan file keeps co-activated experts together: fewer bytes than contiguous overall
b = sum(r["a2a_bytes"] for r in base); p = sum(r["a2a_bytes"] for r in plan)
print(f"token bytes over 20 steps: contiguous {b}, planned {p} ({100*(1-p/b):.1f}% fewer)")
assert p < b
PY
# with AdamW's moments in bf16 the re-plan moves them (2 bytes each) as exactly as fp32 ones
bf16=(--set precision.optimizer_state=bf16)
mpi 4 "$MOE" train "$SRC/configs/tiny.ini" "${common[@]}" "${bf16[@]}" \
  --set log.jsonl="$WORK/base16.jsonl" >"$WORK/base16.log" 2>&1 || fail "bf16 moments: exit $?"
mpi 4 "$MOE" train "$SRC/configs/tiny.ini" "${common[@]}" "${bf16[@]}" \
  --set log.jsonl="$WORK/auto16.jsonl" --set parallel.placement=auto \
  --set parallel.replan_interval=10 >"$WORK/auto16.log" 2>&1 || fail "bf16 moments, auto: exit $?"
grep -q "re-plan at step 10" "$WORK/auto16.log" && pass "re-planned with bf16 moments" ||
  fail "no re-plan with bf16 moments"
$PY - "$WORK" "$TOL" <<'PY' && pass "bf16 moments: placement changes no math" || fail "losses differ"
import json, sys
d, tol = sys.argv[1], float(sys.argv[2])
load = lambda n: [json.loads(l) for l in open(f"{d}/{n}.jsonl")]
base, auto, fp32 = load("base16"), load("auto16"), load("base")
assert len(base) == len(auto) == 20
worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(base, auto))
print(f"bf16 moments, auto against contiguous: worst relative loss difference {worst:.2e}")
assert worst <= tol
assert [r["loss"] for r in base] != [r["loss"] for r in fp32], "the bf16 moments were used"
PY
# a plan for another shape is refused, naming the file
expect_exit 1 "plan for another ep" -- "$MOE" train "$SRC/configs/tiny.ini" --set model.experts=16 \
  --set parallel.placement="$WORK/plan.txt"
expect_err "plan.txt" "the plan file is named"
finish
