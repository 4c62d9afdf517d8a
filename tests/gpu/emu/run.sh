#!/usr/bin/env bash
# tests/gpu/emu/run.sh BUILD_DIR: runs tests/gpu/test_cuda_ops and test_cuda_model on the
# CPU, with kernels/cuda/*.cu compiled as C++ against the emulation in this folder (see
# include/cuda_runtime.h) instead of the CUDA toolkit. BUILD_DIR is a build configured
# with -DMOE_CUDA=ON and built (its libmoe_core.a and link line are reused). Slow (about a
# minute per test); not part of CI. Exit status: that of the first failing test.
# Out of date (docs/cuda.md, Tests): the kernels now include cuda_bf16.h / cuda_fp16.h and
# PTX inline assembly this emulation lacks, so their compile here fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../.." && pwd)
build=$(cd "${1:?usage: run.sh BUILD_DIR}" && pwd)
out=$build/emu
flags=$build/tests/CMakeFiles/test_cuda_ops.dir/flags.make
rsp=$build/tests/CMakeFiles/test_cuda_ops.dir/linkLibs.rsp
if [ ! -f "$build/libmoe_core.a" ] || [ ! -f "$rsp" ]; then
  echo "run.sh: build $build first (cmake -DMOE_CUDA=ON, then cmake --build)" >&2
  exit 1
fi
rm -rf "$out"
mkdir -p "$out/src/kernels/cuda" "$out/obj"
cp "$src"/kernels/cuda/*.cu "$src"/kernels/cuda/*.cuh "$out/src/kernels/cuda/"
# launches become emulated launches; dynamic shared memory a per-block buffer
sed -i 's/kernel<<<(grid), (block), (smem), moe_cuda_stream()>>>(__VA_ARGS__);/emu_launch(dim3(grid), dim3(block), (smem), [=]() { kernel(__VA_ARGS__); });/' \
  "$out/src/kernels/cuda/cuda_common.cuh"
grep -q emu_launch "$out/src/kernels/cuda/cuda_common.cuh" || { echo "run.sh: cannot patch the launch macro" >&2; exit 1; }
sed -i 's/extern __shared__ float sm\[\];/float *sm = (float *)emu_dyn_smem;/' "$out"/src/kernels/cuda/*.cu
cxx="g++ -std=c++17 -O2 -g -Wall -Wno-unused-function -I$here/include -I$out/src -I$src"
objs=()
for f in "$out"/src/kernels/cuda/*.cu; do
  o=$out/obj/$(basename "$f" .cu).o
  $cxx -x c++ -c "$f" -o "$o"
  objs+=("$o")
done
$cxx -c "$here/emu.cpp" -o "$out/obj/emu.o"
ar rcs "$out/libemu_cuda.a" "${objs[@]}" "$out/obj/emu.o"
cflags=$(sed -n 's/^C_FLAGS = //p; s/^C_DEFINES = //p; s/^C_INCLUDES = //p' "$flags" | tr '\n' ' ')
libs=$(sed 's/"//g' "$rsp" | tr ' ' '\n' | grep -v -E 'moe_cuda|cudart|cublas|cudadevrt' | tr '\n' ' ')
status=0
for t in cuda_ops cuda_model; do
  eval gcc $cflags -c "$src/tests/gpu/test_$t.c" -o "$out/obj/test_$t.o"
  (cd "$build/tests" && g++ "$out/obj/test_$t.o" -o "$out/test_$t" "$out/libemu_cuda.a" $libs \
    "$out/libemu_cuda.a")
  echo "== test_$t (emulated)"
  "$out/test_$t" || { rc=$?; [ $status -eq 0 ] && status=$rc; }
done
exit $status
