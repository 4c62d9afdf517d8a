#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-out2}; mkdir -p "$OUT"; B=build-gpu
{ cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="75;90" && cmake --build $B; } >"$OUT/build.log" 2>&1 ||
  { tail -40 "$OUT/build.log"; exit 1; }
bench() { local name=$1; shift
  timeout 200 mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE=0 ./$B/moe-dist bench \
    configs/bench-h200.ini --set parallel.ep=2 "$@" >"$OUT/$name.log" 2>&1
  echo "== $name ($*): exit $?"
  sed -n '/re-plan/p;/tokens\/s  /p;/communication  /,/allocations/p' "$OUT/$name.log" | grep -v allocations | cut -c1-330
}
bench c2 --set parallel.a2a_chunks=2
bench c2_auto --set parallel.a2a_chunks=2 --set parallel.placement=auto --set parallel.replan_interval=100
bench c4 --set parallel.a2a_chunks=4
cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log
