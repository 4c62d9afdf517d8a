# bf16 master weights on a GPU ([precision] master_weights = bf16, mode bf16): AdamW
# keeps the experts' weights in the bf16 copy the GEMMs read. A run stopped at a
# checkpoint and resumed logs the same losses as the run that never stopped, bit for bit
# (the checkpoint widens the bf16 weights into the fp32 arena first; the resume rounds
# them back, exactly); `dump` writes the trained weights (bf16 values), not the stale
# fp32 copies of step 0; the run learns and stays near the fp32-master run (the
# tolerance below says why); with bf16 expert gradients too, it stays as near, and the
# gradient norm summed over the bf16 copy agrees. Without a GPU: exit 77.
source "$(dirname "$0")/../lib.sh"
require_gpu
C=$WORK/ckpt
gpu=(--set parallel.backend=cuda --set precision.mode=bf16)
m16=("${gpu[@]}" --set precision.master_weights=bf16 --set precision.optimizer_state=bf16)
expect_exit 0 "uninterrupted bf16-master run" -- "$MOE" train "${m16[@]}" --set train.steps=12 \
  --set log.jsonl="$WORK/full.jsonl"
grep -q "bf16 GEMMs and expert master weights" "$WORK/out" && pass "banner names the bf16 master weights" ||
  fail "banner: $(grep -m1 GEMM "$WORK/out")"
losses "$WORK/full.jsonl" >"$WORK/full.txt"
expect_exit 0 "run saving every 6 steps" -- "$MOE" train "${m16[@]}" --set train.steps=12 \
  --set checkpoint.dir="$C" --set checkpoint.interval=6 --set log.jsonl="$WORK/part.jsonl"
rm -rf "$C/step-00000012"
expect_exit 0 "resume from step 6" -- "$MOE" train "${m16[@]}" --set train.steps=12 \
  --set checkpoint.dir="$C" --set checkpoint.interval=6 --set log.jsonl="$WORK/part.jsonl" --resume auto
grep -q "resumed from $C/step-00000006: step 6" "$WORK/out" && pass "resumed at step 6" || fail "resume point"
losses "$WORK/part.jsonl" >"$WORK/part.txt"
cmp -s "$WORK/full.txt" "$WORK/part.txt" && pass "resumed losses equal the uninterrupted run bit for bit" ||
  { fail "resumed run differs"; diff "$WORK/full.txt" "$WORK/part.txt" | head -4; }

# the step-6 checkpoint holds the trained expert weights, bf16 values widened (not the
# fp32 values of the initialisation, whose low 16 bits are not all zero), and fp32 dense
# weights: dump writes the weights it resumed
expect_exit 0 "dump from the checkpoint" -- "$MOE" dump "$SRC/configs/tiny.ini" \
  "${m16[@]}" --resume "$C/step-00000006" --out "$WORK/dump"
$PY - "$WORK/dump" <<'PY' && pass "checkpointed expert weights are bf16 values, dense ones fp32" ||
import json, struct, sys
d = sys.argv[1]
raw = open(f"{d}/params.bin", "rb").read()
words = struct.unpack(f"<{len(raw) // 4}I", raw)
expert = dense = dense_low = 0
for t in json.load(open(f"{d}/tensors.json"))["tensors"]:
    n = 1
    for s in t["shape"]:
        n *= s
    low = sum(1 for w in words[t["offset"]:t["offset"] + n] if w & 0xFFFF)
    if ".experts." in t["name"]:
        expert += n
        assert low == 0, f"{t['name']}: {low} of {n} values are not bf16"
    else:
        dense += n
        dense_low += low
print(f"{expert} expert values, all bf16; {dense_low} of {dense} dense values beyond bf16")
assert expert > 0 and dense_low > dense // 2
PY
  fail "checkpointed weights"

# 50 steps against the fp32-master bf16 run: the losses differ (the weights took another
# path) and stay within 1e-2 relative at every step. Both runs round every GEMM operand to
# bf16 (about 4e-3 relative each); the bf16 master weights add one such rounding of each
# expert weight per step, the size of the GEMM operands' own, so the losses may drift
# by a few times the bf16 run's 1.9e-3 against the CPU (measured on an H200: 8.8e-4).
expect_exit 0 "50 steps, bf16 master weights" -- "$MOE" train "${m16[@]}" --set train.steps=50 \
  --set log.jsonl="$WORK/m16.jsonl"
expect_exit 0 "50 steps, fp32 master weights" -- "$MOE" train "${gpu[@]}" \
  --set precision.optimizer_state=bf16 --set train.steps=50 --set log.jsonl="$WORK/m32.jsonl"
$PY - "$WORK/m16.jsonl" "$WORK/m32.jsonl" <<'PY' && pass "learns, near the fp32-master run" ||
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b) == 50, (len(a), len(b))
rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
print(f"worst relative loss difference {max(rel):.3g} (step {rel.index(max(rel))}); "
      f"first {a[0]:.4f}, last {a[-1]:.4f} (fp32 master {b[-1]:.4f})")
assert max(rel) > 0, "the bf16 master weights changed nothing"
assert max(rel) < 1e-2, max(rel)
assert a[-1] < 0.9 * a[0], "did not learn"
PY
  fail "bf16 master run against the fp32-master run"

# bf16 expert gradients ([precision] expert_grads = bf16): the GEMMs write the experts'
# weight gradients in bf16 and AdamW reads them so. 50 steps stay within the same 1e-2 of
# the fp32-master run (one more bf16 rounding per gradient, the size of the operands'
# own) and differ from the bf16-master run with fp32 gradients (so the setting took).
# With clipping (grad_clip > 0: the norm summed before the update, over the bf16 copy)
# the logged gradient norms stay within 1e-2 of the fp32-gradient run's.
g16=("${m16[@]}" --set precision.expert_grads=bf16)
expect_exit 0 "50 steps, bf16 expert gradients" -- "$MOE" train "${g16[@]}" --set train.steps=50 \
  --set log.jsonl="$WORK/g16.jsonl"
grep -q "bf16 GEMMs and expert master weights and gradients" "$WORK/out" &&
  pass "banner names the bf16 gradients" || fail "banner: $(grep -m1 GEMM "$WORK/out")"
$PY - "$WORK/g16.jsonl" "$WORK/m32.jsonl" "$WORK/m16.jsonl" <<'PY' && pass "bf16 gradients learn, near the fp32-master run" ||
import json, sys
a, b, c = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:4])
assert len(a) == len(b) == len(c) == 50, (len(a), len(b), len(c))
rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
print(f"worst relative loss difference {max(rel):.3g} (step {rel.index(max(rel))}); "
      f"last {a[-1]:.4f} (fp32 master {b[-1]:.4f}, bf16 master {c[-1]:.4f})")
assert a != c, "the bf16 gradients changed nothing"
assert max(rel) < 1e-2, max(rel)
assert a[-1] < 0.9 * a[0], "did not learn"
PY
  fail "bf16 gradients against the fp32-master run"
expect_exit 0 "clipped, bf16 expert gradients" -- "$MOE" train "${g16[@]}" --set train.steps=8 \
  --set train.grad_clip=0.5 --set log.jsonl="$WORK/g16c.jsonl"
expect_exit 0 "clipped, fp32 expert gradients" -- "$MOE" train "${m16[@]}" --set train.steps=8 \
  --set train.grad_clip=0.5 --set log.jsonl="$WORK/m16c.jsonl"
$PY - "$WORK/g16c.jsonl" "$WORK/m16c.jsonl" <<'PY' && pass "clipped norms over bf16 gradients" ||
import json, sys
a, b = ([json.loads(l)["grad_norm"] for l in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b) == 8, (len(a), len(b))
rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
print(f"gradient norms {a[0]:.4f} .. {a[-1]:.4f}; worst relative difference {max(rel):.3g}")
assert max(rel) < 1e-2 and min(a) > 0, (max(rel), min(a))
PY
  fail "clipped norms over bf16 gradients"
finish
