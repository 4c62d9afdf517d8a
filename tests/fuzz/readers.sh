# Fuzzing (libFuzzer, clang from Debian, with ASan and UBSan): the config parser and the
# checkpoint readers (commit marker, manifest, tensor files, the safetensors export) for
# a bounded time each: FUZZ_SECONDS (default 15) in CI, longer by hand:
#   FUZZ_SECONDS=600 bash tests/fuzz/readers.sh build/moe-dist .
# Seeds: configs/tiny.ini and a real checkpoint of a very small model. Fails on any
# crash, leak, sanitizer report or timeout; the reproducer is copied to fuzz-crashes/.
source "$(dirname "$0")/../lib.sh"
SECS=${FUZZ_SECONDS:-15}
CLANG=$(command -v clang || true)
if [ -z "$CLANG" ]; then fail "clang not found: apt-get install clang (scripts/deps.sh --test)"; finish; fi
mkdir -p "$WORK/proto" "$WORK/seed_config" "$WORK/seed_ckpt" "$WORK/corpus_config" "$WORK/corpus_ckpt"
protoc-c --proto_path="$SRC/proto" --c_out="$WORK/proto" "$SRC/proto/checkpoint.proto" || fail "protoc-c"
flags=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -std=gnu17
       -DMOE_VERSION='"fuzz"' -I"$SRC" -I"$WORK/proto" $(pkg-config --cflags inih libprotobuf-c jansson))
libs=($(pkg-config --libs inih libprotobuf-c jansson) -lm)
build() { # name sources...
  local name=$1
  shift
  "$CLANG" "${flags[@]}" "$@" "${libs[@]}" -o "$WORK/$name" 2>"$WORK/$name.build" ||
    { fail "build $name"; head -20 "$WORK/$name.build"; }
}
build fuzz_config "$SRC/tests/fuzz/fuzz_config.c" "$SRC/runtime/config.c" "$SRC/util/status.c"
build fuzz_checkpoint "$SRC/tests/fuzz/fuzz_checkpoint.c" "$SRC/runtime/checkpoint.c" \
  "$SRC/runtime/optimizer.c" "$SRC/runtime/config.c" "$SRC/util/status.c" "$SRC/util/crc32c.c" "$SRC/util/fault.c" \
  "$WORK/proto/checkpoint.pb-c.c"

cp "$SRC/configs/tiny.ini" "$WORK/seed_config/"
printf '[model]\ntop_k = 9\n[train]\ngrad_accum = 8@0,4@1000\n' >"$WORK/seed_config/accum.ini"
# a real checkpoint of a very small model: manifest.pb + 0xFF 0xFE + rank-00000.bin
"$MOE" train --set model.vocab_size=8 --set model.d_model=4 --set model.n_layers=1 \
  --set model.n_heads=2 --set model.seq_len=2 --set model.experts=2 --set model.top_k=1 \
  --set model.expert_hidden=2 --set model.dense_layers=0 --set train.micro_batch=1 \
  --set train.steps=1 --set checkpoint.interval=1 --set checkpoint.dir="$WORK/ck" >/dev/null 2>&1 ||
  fail "seed checkpoint"
{ cat "$WORK/ck/step-00000001/manifest.pb"; printf '\xff\xfe'; cat "$WORK/ck/step-00000001/rank-00000.bin"; } \
  >"$WORK/seed_ckpt/small"

run() { # name corpus seeds
  (cd "$WORK" && ./"$1" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -close_fd_mask=2 \
     "$2" "$3" >"$WORK/$1.log" 2>&1)
  local rc=$?
  local runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$WORK/$1.log")
  if [ $rc -eq 0 ]; then pass "$1: ${runs:-?} inputs in ${SECS}s, no crash"
  else
    fail "$1: exit $rc"
    grep -E "ERROR|SUMMARY|Test unit written" "$WORK/$1.log" | head -5
    mkdir -p fuzz-crashes && cp "$WORK"/crash-* "$WORK"/leak-* "$WORK"/timeout-* fuzz-crashes/ 2>/dev/null
  fi
}
[ -x "$WORK/fuzz_config" ] && run fuzz_config "$WORK/corpus_config" "$WORK/seed_config"
[ -x "$WORK/fuzz_checkpoint" ] && run fuzz_checkpoint "$WORK/corpus_ckpt" "$WORK/seed_ckpt"
rm -rf /tmp/fuzz_ckpt.*
finish
