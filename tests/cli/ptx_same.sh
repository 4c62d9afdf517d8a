# scripts/ptx-same.sh (a source's kernels before and after a change, compared as PTX):
# - on a fake compiler in a scratch repository, whose "PTX" is the source's lines that
#   start with //PTX: the same kernels despite other function numbers in the labels,
#   line records and internal-name hashes; DIFF where an instruction changed (after an
#   inline assembly block's braces, which stand at the start of lines too); a kernel
#   renamed by an added template argument SAME with STRIP and MISSING without; usage
#   errors exit 2;
#   a parameter of another size with the same code PARAMS;
# - with the CUDA compiler where there is one: optim.cu of a clone of this checkout the
#   same as its HEAD's, and a changed hash constant there DIFF in the kernels that use it
#   only.
source "$(dirname "$0")/../lib.sh"
TOOL="$SRC/scripts/ptx-same.sh"
cat >"$WORK/fakecc" <<'SH'
#!/usr/bin/env bash
out= in= prev=
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  case "$a" in *.cu) in=$a ;; esac
  prev=$a
done
sed -n 's|^//PTX ||p' "$in" >"$out"
SH
chmod +x "$WORK/fakecc"
repo=$WORK/repo
mkdir -p "$repo/kernels/cuda"
write() { # the two kernels: line and function number $1 (in the labels' names, and the
  # inline assembly's label), internal hash $2, instruction $3, the second's name $4, the
  # first's parameter size $5 (default 16)
  cat >"$repo/kernels/cuda/k.cu" <<EOF
//PTX 	// .globl	_Z3onev
//PTX .visible .entry _Z3onev(
//PTX 	.param .align 8 .b8 _Z3onev_param_0[${5:-16}]
//PTX ) {
//PTX 	.loc 1 $1 0
//PTX 	mov.u32 %r1, _ZZN38_INTERNAL_$2_4_k_cu_partE;
//PTX {
//PTX .reg .pred p;
//PTX WAIT_$1:
//PTX @!p bra WAIT_$1;
//PTX }
//PTX $3
//PTX \$L__BB$1_3:
//PTX 	ret;
//PTX }
//PTX 	// .globl	$4
//PTX .visible .entry $4(
//PTX ) {
//PTX 	add.s32 %r2, %r2, 1;
//PTX }
EOF
}
(cd "$repo" && git init -q && git config user.email t@t && git config user.name t) || fail "git init"
write 3 aaaa1111 "	add.s32 %r1, %r1, 1;" _Z3twoIiEvv
(cd "$repo" && git add -A && git commit -qm base) || fail "git commit"
run() { (cd "$repo" && NVCC="$WORK/fakecc" bash "$TOOL" "$@") >"$WORK/out" 2>"$WORK/err"; }
write 7 bbbb2222 "	add.s32 %r1, %r1, 1;" _Z3twoIiEvv
run HEAD kernels/cuda/k.cu
[ $? -eq 0 ] && grep -q "^SAME .*_Z3onev" "$WORK/out" && grep -q "2 of 2 kernels the same" "$WORK/out" &&
  pass "other label numbers (inline assembly's too), line records and internal hashes: the same (exit 0)" ||
  fail "unchanged code: $(cat "$WORK/out" "$WORK/err")"
write 3 aaaa1111 "	add.s32 %r1, %r1, 2;" _Z3twoIiEvv
run HEAD kernels/cuda/k.cu
[ $? -eq 1 ] && grep -q "^DIFF .*_Z3onev" "$WORK/out" && grep -q "^SAME .*_Z3twoIiEvv" "$WORK/out" &&
  pass "a changed instruction: DIFF in its kernel only (exit 1)" ||
  fail "a changed instruction: $(cat "$WORK/out" "$WORK/err")"
write 3 aaaa1111 "	add.s32 %r1, %r1, 1;" _Z3twoIiLi0EEvv
run HEAD kernels/cuda/k.cu Li0E
[ $? -eq 0 ] && grep -q "^SAME .*_Z3twoIiEvv" "$WORK/out" &&
  pass "a template argument added, STRIP Li0E: the same (exit 0)" ||
  fail "STRIP: $(cat "$WORK/out" "$WORK/err")"
write 3 aaaa1111 "	add.s32 %r1, %r1, 1;" _Z3twoIiEvv 24
run HEAD kernels/cuda/k.cu
[ $? -eq 1 ] && grep -q "^PARAMS .*_Z3onev" "$WORK/out" && grep -q "^SAME .*_Z3twoIiEvv" "$WORK/out" &&
  grep -q "1 of 2 kernels the same; 1 more with the same code but a parameter of another size" "$WORK/out" &&
  pass "a parameter of another size, the code the same: PARAMS (exit 1)" ||
  fail "a parameter's size: $(cat "$WORK/out" "$WORK/err")"
write 3 aaaa1111 "	add.s32 %r1, %r1, 1;" _Z3twoIiLi0EEvv
run HEAD kernels/cuda/k.cu
[ $? -eq 1 ] && grep -q "^MISSING .*_Z3twoIiEvv" "$WORK/out" &&
  pass "the same without STRIP: MISSING (exit 1)" || fail "no STRIP: $(cat "$WORK/out" "$WORK/err")"
run HEAD
[ $? -eq 2 ] && grep -q "Usage: scripts/ptx-same.sh REV FILE" "$WORK/err" &&
  pass "no FILE: the usage (exit 2)" || fail "usage: $(cat "$WORK/err")"
run HEAD kernels/cuda/none.cu
[ $? -eq 2 ] && grep -q "no file kernels/cuda/none.cu" "$WORK/err" &&
  pass "a file not in the working tree (exit 2)" || fail "missing file: $(cat "$WORK/err")"
cp "$repo/kernels/cuda/k.cu" "$repo/kernels/cuda/new.cu"
run HEAD kernels/cuda/new.cu
[ $? -eq 2 ] && grep -q "HEAD has no kernels/cuda/new.cu" "$WORK/err" &&
  pass "a file the revision lacks (exit 2)" || fail "file new since REV: $(cat "$WORK/err")"

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$nvcc" ]; then
  clone=$WORK/clone
  git clone -q "$SRC" "$clone" || fail "git clone"
  (cd "$clone" && bash "$TOOL" HEAD kernels/cuda/optim.cu) >"$WORK/real" 2>&1
  rc=$?
  n=$(grep -c "^SAME" "$WORK/real")
  [ "$rc" -eq 0 ] && [ "$n" -gt 10 ] && pass "nvcc: optim.cu as HEAD has it, $n kernels the same" ||
    fail "nvcc, unchanged optim.cu: exit $rc, $(tail -3 "$WORK/real")"
  sed -i 's/0x7feb352du/0x7feb352fu/' "$clone/kernels/cuda/optim.cu"
  (cd "$clone" && bash "$TOOL" HEAD kernels/cuda/optim.cu) >"$WORK/real" 2>&1
  rc=$?
  [ "$rc" -eq 1 ] && grep -q "^DIFF .*adamw_multi_kernel" "$WORK/real" &&
    grep -q "^SAME .*adamw_square_final" "$WORK/real" &&
    pass "nvcc: the stochastic rounding's hash changed: the AdamW kernels DIFF, the sums SAME" ||
    fail "nvcc, changed optim.cu: exit $rc, $(grep -c DIFF "$WORK/real") DIFF"
else
  echo "(no nvcc: the compiler's part skipped)"
fi
finish
