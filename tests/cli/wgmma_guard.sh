# scripts/wgmma-guard.sh, CMake's compiler launcher for the sm_90a kernels, on fake
# compilers: it passes a compile through (its output, its exit status, its object kept),
# and fails one whose output reports serialized wgmma instructions (C7520), removing the
# object it wrote, so that the next build compiles it again.
source "$(dirname "$0")/../lib.sh"
GUARD="$SRC/scripts/wgmma-guard.sh"
cat >"$WORK/cc_ok" <<'SH'
#!/usr/bin/env bash
prev=; for a in "$@"; do [ "$prev" = -o ] && echo obj >"$a"; prev=$a; done
echo "ptxas info    : Used 155 registers" >&2
SH
cat >"$WORK/cc_serial" <<'SH'
#!/usr/bin/env bash
prev=; for a in "$@"; do [ "$prev" = -o ] && echo obj >"$a"; prev=$a; done
echo "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized" >&2
SH
cat >"$WORK/cc_error" <<'SH'
#!/usr/bin/env bash
echo "error: something else" >&2; exit 3
SH
chmod +x "$WORK"/cc_*
bash "$GUARD" "$WORK/cc_ok" -c x.cu -o "$WORK/ok.o" 2>"$WORK/ok.err" && [ -f "$WORK/ok.o" ] &&
  grep -q "Used 155 registers" "$WORK/ok.err" && pass "a clean compile passes, its object and output kept" ||
  fail "a clean compile: $(cat "$WORK/ok.err")"
bash "$GUARD" "$WORK/cc_serial" -c x.cu -o "$WORK/serial.o" 2>"$WORK/serial.err"
rc=$?
[ "$rc" -ne 0 ] && [ ! -e "$WORK/serial.o" ] && grep -q "ptxas serialized wgmma" "$WORK/serial.err" &&
  pass "serialized wgmma fails the compile (exit $rc), its object removed" ||
  fail "serialized wgmma: exit $rc, object $(ls "$WORK/serial.o" 2>&1), $(cat "$WORK/serial.err")"
bash "$GUARD" "$WORK/cc_error" -c x.cu -o "$WORK/e.o" 2>"$WORK/e.err"
rc=$?
[ "$rc" -eq 3 ] && grep -q "something else" "$WORK/e.err" && pass "a failing compile keeps its exit status 3" ||
  fail "a failing compile: exit $rc"
finish
