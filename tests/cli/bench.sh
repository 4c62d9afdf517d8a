# moe-dist bench: the report's figures are consistent with each other and with the
# config. The FLOPs per token are computed here from the config's numbers (an independent
# formula); the phases of the phase-timed steps add up to about a step (they are timed
# around the same work as the untimed steps); MFU = TFLOP/s over the GEMM rate is in
# (0, 1]; with 2 ranks (ep 2) the exchange is non-zero and the global tokens/s is about
# twice the per-rank figure.
source "$(dirname "$0")/../lib.sh"
"$MOE" bench --set train.steps=4 >"$WORK/b1.txt" 2>&1 || fail "bench, one rank"
mpi 2 "$MOE" bench --set train.steps=3 --set parallel.ep=2 >"$WORK/b2.txt" 2>&1 ||
  fail "bench, two ranks"
$PY - "$WORK/b1.txt" "$WORK/b2.txt" <<'PY' && pass "bench figures" || fail "bench figures"
import sys
def result(path):
    lines = [l for l in open(path) if l.startswith("bench-result ")]
    assert len(lines) == 1, open(path).read()
    return {k: float(v) for k, v in (kv.split("=") for kv in lines[0].split()[1:])}
# configs/tiny.ini: D 64, 3 layers (1 dense, hidden 256), 8 experts top-2 of 128, V 256, T 64
D, L, Ld, Fd, E, K, F, V, T = 64, 3, 1, 256, 8, 2, 128, 256, 64
params = L * 4 * D * D + Ld * 3 * D * Fd + (L - Ld) * (D * E + K * 3 * D * F) + V * D
want = 3 * (2 * params + L * 2 * T * D)
for path, world in ((sys.argv[1], 1), (sys.argv[2], 2)):
    r = result(path)
    assert abs(r["flops_per_token"] - want) <= 1e-5 * want, (r["flops_per_token"], want)
    assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
    assert abs(r["tokens_per_s"] - world * r["tokens_per_s_per_gpu"]) <= 1e-3 * r["tokens_per_s"] + 1
    # tokens per step / step time
    assert abs(r["tokens_per_s"] * r["step_ms"] / 1e3 - 8 * 64 * world) <= 0.01 * 8 * 64 * world, r
    assert 0 < r["mfu"] <= 1.0, r
    assert 0.5 * r["step_ms"] <= r["phase_sum_ms"] <= 2.0 * r["step_ms"], r
    if world == 1:
        assert r["exposed_comm_ms"] < 0.05 * r["step_ms"], r
    else:
        assert r["exposed_comm_ms"] > 0, r
print("flops/token", want)
PY
finish
