# Training on llm.c token shards, and shard errors from the command line: the message
# names the file, the exit status is non-zero, nothing trains.
source "$(dirname "$0")/../lib.sh"
$PY - "$WORK" <<'PY'
import struct, sys, random
d = sys.argv[1]
random.seed(3)
def shard(path, tokens, magic=20240520, version=1, count=None, extra=b""):
    hdr = [0] * 256
    hdr[0], hdr[1], hdr[2] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *hdr))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
        f.write(extra)
toks = [(i * 7 + random.randrange(3)) % 200 for i in range(20000)]
shard(f"{d}/a.bin", toks[:12000]); shard(f"{d}/b.bin", toks[12000:])
shard(f"{d}/magic.bin", toks[:1000], magic=1234)
shard(f"{d}/trunc.bin", toks[:1000], count=2000)
shard(f"{d}/big.bin", [300] * 2000)
PY
expect_exit 0 "train on two shards" -- "$MOE" train --set data.source=shards \
  --set data.path="$WORK/a.bin,$WORK/b.bin" --set train.steps=30 --set log.jsonl="$WORK/s.jsonl"
$PY -c "
import json,sys; r=[json.loads(l) for l in open('$WORK/s.jsonl')]
print(r[0]['ce'], r[-1]['ce']); sys.exit(0 if r[-1]['ce'] < r[0]['ce'] - 1.0 else 1)" &&
  pass "loss falls on shards" || fail "loss on shards"
expect_exit 1 "foreign file" -- "$MOE" train --set data.source=shards --set data.path="$WORK/magic.bin"
expect_err "magic.bin.*magic" "foreign file named with its magic"
expect_exit 1 "truncated shard" -- "$MOE" train --set data.source=shards --set data.path="$WORK/trunc.bin"
expect_err "trunc.bin" "truncated file named"
expect_exit 1 "token outside the vocabulary" -- "$MOE" train --set data.source=shards --set data.path="$WORK/big.bin"
expect_err "big.bin.*300" "file and bad token named"
expect_exit 1 "missing shard" -- "$MOE" train --set data.source=shards --set data.path="$WORK/none.bin"
expect_err "none.bin" "missing shard named"
finish
