# A token whose top-k experts share a rank is sent there once: with top_k 3 on 2 EP
# ranks some token always has two experts on one rank, so bytes are saved; with top_k 1
# nothing can be saved. The saved bytes are counted and logged.
source "$(dirname "$0")/../lib.sh"
for k in 1 3; do
  mpi 2 "$MOE" train "$SRC/configs/tiny.ini" --set train.steps=3 --set parallel.ep=2 \
    --set model.top_k=$k --set log.jsonl="$WORK/k$k.jsonl" >"$WORK/k$k.log" 2>&1 ||
    fail "top_k $k: exit $?"
done
$PY - "$WORK" <<'PY' && pass "dedup bytes counted" || fail "dedup bytes"
import json, sys
d = sys.argv[1]
k1 = [json.loads(l) for l in open(f"{d}/k1.jsonl")]
k3 = [json.loads(l) for l in open(f"{d}/k3.jsonl")]
for r in k1:
    assert r["a2a_bytes"] > 0 and r["a2a_bytes_saved"] == 0, r
for r in k3:
    assert r["a2a_bytes"] > 0 and r["a2a_bytes_saved"] > 0, r
# each saved row is one token vector (64 floats) not sent in dispatch and in combine
for r in k1 + k3:
    assert r["a2a_bytes_saved"] % (2 * 64 * 4) == 0 and r["a2a_bytes"] % (2 * 64 * 4) == 0, r
print("top_k 3 saved", [r["a2a_bytes_saved"] for r in k3], "of", [r["a2a_bytes"] for r in k3])
PY
finish
