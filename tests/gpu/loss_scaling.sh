# fp16 dynamic loss scaling on a GPU: a NaN injected into the gradients of step 6
# (MOE_FAULT=nan@0:5) must skip that step, halve the scale for the next, and be counted;
# clean steps double the scale every growth_interval (4 here). Without a GPU: exit 77.
source "$(dirname "$0")/../lib.sh"
require_gpu
MOE_FAULT=nan@0:5 "$MOE" train --set parallel.backend=cuda --set precision.mode=fp16 \
  --set train.steps=12 --set precision.loss_scale_growth_interval=4 \
  --set log.jsonl="$WORK/fp16.jsonl" >"$WORK/out" 2>"$WORK/err" || fail "fp16 run: exit $?"
grep -q "fp16 GEMMs with dynamic loss scaling" "$WORK/out" && pass "banner names fp16" || fail "banner"
$PY - "$WORK/fp16.jsonl" <<'PY' && pass "skip, backoff and growth" || fail "loss scaling"
import json, math, sys
r = [json.loads(l) for l in open(sys.argv[1])]
assert len(r) == 12, len(r)
skipped = [x["step"] for x in r if x["skipped"]]
print("scales", [x["loss_scale"] for x in r], "skipped", skipped)
assert skipped == [6], skipped
assert r[6]["loss_scale"] == r[5]["loss_scale"] / 2            # halved after the skip
assert any(b["loss_scale"] == 2 * a["loss_scale"] for a, b in zip(r, r[1:]))  # grew
assert r[0]["loss_scale"] == 65536
assert all(math.isfinite(x["loss"]) for x in r)
PY
grep -q "skipped 1" "$WORK/out" && pass "progress line counts the skip" || fail "skip not reported"
finish
