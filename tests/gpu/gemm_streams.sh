# The experts' GEMMs that run one by one in bf16 / fp16 are spread over several streams
# (MOE_GEMM_STREAMS, default 4; matmul.cu), on cuBLAS (MOE_GROUPED_GEMM=cublas) and on
# the GPU's default path (sm_90: the wgmma grouped kernel, each layout's launch on a lane
# of its own). Each problem writes its own output, so the result must not depend on the
# spread: 20 bf16 steps of the tiny config (8 experts) on 4 and on 8 streams and on 1 give
# the same losses and gradient norms to the last printed digit. On sm_75 (no bf16) fp16 is
# used. Without a GPU: exit 77.
source "$(dirname "$0")/../lib.sh"
require_gpu
mode=$(gpu_mode)
strip() { sed -E 's/"(tok_per_s|seconds|elapsed_s|[a-z_]*_ms|[a-z_]*_s)": *[0-9.eE+-]+,? *//g' "$1"; }
for path in cublas default; do
  for s in 1 4 8; do
    MOE_GROUPED_GEMM=$path MOE_GEMM_STREAMS=$s "$MOE" train --set parallel.backend=cuda \
      --set precision.mode=$mode --set train.steps=20 --set log.jsonl="$WORK/$path$s.jsonl" \
      >"$WORK/$path$s.out" 2>&1 || fail "$path, $s stream(s): exit $?"
  done
  [ "$(wc -l <"$WORK/${path}4.jsonl")" -eq 20 ] && pass "$path: 20 steps logged" ||
    fail "$path: steps missing"
  for s in 4 8; do
    if diff <(strip "$WORK/${path}1.jsonl") <(strip "$WORK/$path$s.jsonl") >"$WORK/diff"; then
      pass "$path: $s streams give the losses of 1 ($mode)"
    else
      fail "$path: $s streams differ from 1"
      head -4 "$WORK/diff"
    fi
  done
done
finish
