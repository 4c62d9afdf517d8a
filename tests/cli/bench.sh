# moe-dist bench: the report's figures are consistent with each other and with the
# config. The FLOPs per token are computed here from the config's numbers (an independent
# formula); the printed phases add up to their printed sum; MFU is positive; one rank at ep 1 communicates nothing, two ranks at ep 2 do; the
# global tokens/s is the per-rank figure times the ranks. No timing is compared between
# runs (CI's machine may be loaded).
source "$(dirname "$0")/../lib.sh"
"$MOE" bench --set train.steps=4 >"$WORK/b1.txt" 2>&1 || fail "bench, one rank"
grep -q "^bench: 10 warm-up, 4 timed" "$WORK/b1.txt" && pass "10 warm-up steps unless told" ||
  fail "bench header: $(grep '^bench:' "$WORK/b1.txt")"
mpi 2 "$MOE" bench --warmup 2 --set train.steps=3 --set parallel.ep=2 >"$WORK/b2.txt" 2>&1 ||
  fail "bench, two ranks"
grep -q "^bench: 2 warm-up, 3 timed" "$WORK/b2.txt" && pass "--warmup 2" ||
  fail "bench header: $(grep '^bench:' "$WORK/b2.txt")"
expect_exit 2 "a negative --warmup" -- "$MOE" bench --warmup -1
expect_err "--warmup needs a non-negative integer" "its message names the option"
# chunks and the slower-network knob, as the header reports them
mpi 2 "$MOE" bench --warmup 1 --set train.steps=2 --set parallel.ep=2 --set parallel.a2a_chunks=4 \
  --set parallel.exchange_repeat=3 >"$WORK/b3.txt" 2>&1 || fail "bench, 4 chunks"
grep -q "world 2, ep 2, 4 chunks per micro-batch, exchange sent 3x" "$WORK/b3.txt" &&
  pass "bench names 4 chunks and 3 sends" || fail "bench header: $(grep '^bench:' "$WORK/b3.txt")"
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
    assert r["mfu"] > 0, r  # its bound would compare two timings (the GEMM rate is timed apart)
    assert r["phase_sum_ms"] > 0, r
    # the phase table adds up to the sum it prints (no timing compared across runs: the
    # machine may be loaded)
    text = open(path).read()
    rows = [l.split() for l in text.splitlines() if l.startswith("    ") and "%" in l]
    total = sum(float(x[-2]) for x in rows)
    assert len(rows) == 6 and abs(total - r["phase_sum_ms"]) <= 0.01 * 6 + 1e-6, (rows, r)
    if world == 1:  # ep 1, one rank: nothing to exchange or reduce
        assert r["comm_ms"] == 0 and r["comm_exposed_ms"] == 0, r
    else:
        assert r["exposed_comm_ms"] > 0 and r["comm_ms"] > 0, r
        # every assignment is an expert row on one rank: 8 sequences of 64 tokens per
        # rank, top-2, 2 MoE layers, no capacity: min + max over the 2 ranks is all of them
        rk = [l for l in text.splitlines() if l.startswith("  ranks ")]
        assert len(rk) == 1, text
        w = rk[0].split()
        lo, hi = float(w[w.index("min") + 1]), float(w[w.index("max") + 1])
        assert lo <= hi and lo + hi == 2 * 8 * 64 * K * (L - Ld), rk
        # the places: MoE layers 1 and 2 only (layer 0 is dense), each exposed <= total
        i = text.index("  exposed by place")
        places = [l for l in text[i:].splitlines()[1:] if l.startswith("    ")]
        assert places, text[i:]
        import re
        for l in places:
            m = re.match(r"    (.+?)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9]+)$", l)
            assert m, l
            name, tot, exp = m.group(1), float(m.group(2)), float(m.group(3))
            assert re.fullmatch(r"(forward|backward) (dispatch|combine) of layer [12]|gradient "
                                r"reduction|gradient norm|token-count exchanges \(every layer\)",
                                name), name
            assert 0 < exp <= tot + 0.011, l
    # a2a_chunks = auto: one chunk here (the EP group is on one host), exchanges sent once
    assert ", 1 chunk per micro-batch, exchange sent 1x," in text, text.splitlines()[0]
print("flops/token", want)
PY
# moe-bench (built with the CUDA toolkit) checks its options before it looks for a GPU
MB="$(dirname "$MOE")/bench/moe-bench"
if [ -x "$MB" ]; then
  expect_exit 2 "moe-bench --rows-ratio 0" -- "$MB" --rows-ratio 0
  expect_err "--rows-ratio wants an integer in \[1, 1000\], got '0'" "its message names the option"
  expect_exit 2 "moe-bench --out16 2" -- "$MB" --out16 2
  expect_err "--out16 wants an integer in \[0, 1\], got '2'" "its message names the option"
  expect_exit 2 "moe-bench --grads16 1 in fp16" -- "$MB" --grads16 1 --precision fp16
  expect_err "--grads16 1 needs --precision bf16" "its message names the option and the precision"
  expect_exit 2 "moe-bench --copy-equal 2" -- "$MB" --copy-equal 2
  expect_err "--copy-equal wants an integer in \[0, 1\], got '2'" "its message names the option"
  "$MB" --help | grep -q -- "--rows-ratio R" && "$MB" --help | grep -q -- "--out16 0|1" &&
    "$MB" --help | grep -q -- "--grads16 0|1" && "$MB" --help | grep -q -- "--copy-equal 0|1" &&
    pass "moe-bench --help lists --rows-ratio, --out16, --grads16 and --copy-equal" ||
    fail "moe-bench --help"
else
  echo "moe-bench not built here (no CUDA toolkit): its option checks skipped"
fi
finish
