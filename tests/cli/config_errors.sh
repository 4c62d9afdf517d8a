# Bad config or command line: one message naming file:line (or --set) and the key,
# exit status 2, and nothing started (no progress line, no log file written).
source "$(dirname "$0")/../lib.sh"
cfg() { printf '%s\n' "$@" >"$WORK/bad.ini"; }

cfg "[model]" "d_model = 64" "colour = blue"
expect_exit 2 "unknown key" -- "$MOE" train "$WORK/bad.ini" --set log.jsonl="$WORK/x.jsonl"
expect_err "bad.ini:3: .*colour" "unknown key names file:line and key"
[ ! -e "$WORK/x.jsonl" ] && [ ! -s "$WORK/out" ] && pass "nothing started" || fail "output written on a config error"

cfg "[modle]" "d_model = 64"
expect_exit 2 "unknown section" -- "$MOE" train "$WORK/bad.ini"
expect_err "bad.ini:1: .*modle" "unknown section named"

cfg "[model]" "d_model = sixty"
expect_exit 2 "wrong type" -- "$MOE" train "$WORK/bad.ini"
expect_err "bad.ini:2: .*d_model.*integer" "wrong type names key and expected type"

cfg "[model]" "experts = 4" "top_k = 5"
expect_exit 2 "top_k > experts" -- "$MOE" train "$WORK/bad.ini"
expect_err "bad.ini:3: .*top_k.*experts" "inconsistent values name both keys"

cfg "[model]" "d_model = 60" "n_heads = 8"
expect_exit 2 "d_model % n_heads" -- "$MOE" train "$WORK/bad.ini"
expect_err "bad.ini:[23]: .*(n_heads|d_model)" "head split names the key"

expect_exit 2 "bad --set value" -- "$MOE" train --set train.lr=-1
expect_err "--set train.lr" "--set errors name the override"
expect_exit 2 "bad --set syntax" -- "$MOE" train --set train.lr
expect_err "train.lr" "--set without = is named"
expect_exit 2 "missing config file" -- "$MOE" train "$WORK/nope.ini"
expect_err "nope.ini" "missing file named"
expect_exit 2 "unknown option" -- "$MOE" train --frobnicate
expect_err "frobnicate" "unknown option named"
expect_exit 2 "unknown command" -- "$MOE" fly
expect_err "fly" "unknown command named"
expect_exit 2 "ep not dividing the world" -- "$MOE" train --set parallel.ep=2 --set model.experts=8
expect_err "ep" "ep error names the key"
# bf16 master weights update the bf16 GEMM copy: fp32 or fp16 GEMMs have none
expect_exit 2 "bf16 master weights with fp32 GEMMs" -- "$MOE" train --set precision.master_weights=bf16
expect_err "--set precision.master_weights=bf16: .*needs bf16 in \[precision\] mode = fp32" \
  "bf16 master weights name the key and the mode"
expect_exit 1 "bf16 master weights, mode auto on the cpu" -- "$MOE" train --set parallel.backend=cpu \
  --set precision.mode=auto --set precision.master_weights=bf16 --set train.steps=2
expect_err "master_weights = bf16 needs bf16 GEMMs; \[precision\] mode = auto gives fp32" \
  "auto resolved to fp32 is refused at start"

# bf16 expert gradients are those of bf16 master weights
expect_exit 2 "bf16 expert gradients with fp32 master weights" -- "$MOE" train \
  --set precision.expert_grads=bf16
expect_err "--set precision.expert_grads=bf16: .*needs bf16 in \[precision\] master_weights = fp32" \
  "bf16 gradients name the key and the master weights"

expect_exit 0 "--help" -- "$MOE" --help
grep -q "usage: moe-dist" "$WORK/out" && pass "--help prints usage" || fail "--help output"
expect_exit 0 "--version" -- "$MOE" --version
grep -Eq "^moe-dist [0-9]+\.[0-9]+\.[0-9]+" "$WORK/out" && pass "--version prints it" || fail "--version output"
finish
