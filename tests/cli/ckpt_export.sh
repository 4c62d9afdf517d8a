# moe-dist export CKPT --format safetensors OUT: the safetensors header is well formed
# (8-byte little-endian length, JSON with __metadata__ format pt, F32 tensors whose
# data_offsets tile the byte buffer without holes, in name order), every tensor has its
# transformers Mixtral name and shape, and its values equal the checkpoint's parameter
# slice (read with numpy at the file/offset that inspect prints); config.json carries
# the MixtralConfig fields. Models Mixtral cannot express are refused (exit 2).
source "$(dirname "$0")/../lib.sh"
C=$WORK/ckpt
mix=(--set model.dense_layers=0 --set model.n_layers=2 --set train.steps=3
     --set checkpoint.interval=3 --set checkpoint.dir="$C")
expect_exit 0 "train a Mixtral-shaped model" -- "$MOE" train "${mix[@]}"
expect_exit 0 "export" -- "$MOE" export "$C/step-00000003" --format safetensors "$WORK/hf"
"$MOE" inspect "$C/step-00000003" >"$WORK/inspect.txt" 2>&1 || fail "inspect"
$PY - "$WORK/hf" "$C/step-00000003" "$WORK/inspect.txt" <<'PY' && pass "safetensors layout, names, values, config.json" || fail "safetensors check"
import json, struct, sys, numpy as np
hf, ck, listing = sys.argv[1:]
raw = open(f"{hf}/model.safetensors", "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
assert n % 8 == 0, n
header = json.loads(raw[8:8 + n])
data = raw[8 + n:]
assert header.pop("__metadata__") == {"format": "pt"}
# no holes, no overlaps, every byte indexed, name order
spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
at = 0
for b, e, k in spans:
    assert b == at, (k, b, at)
    at = e
assert at == len(data), (at, len(data))
assert [k for _, _, k in spans] == sorted(header), "tensors not in name order"
cfg = json.load(open(f"{hf}/config.json"))
L, E, D, F, V = cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
assert (L, E, D, F, V) == (2, 8, 64, 128, 256), (L, E, D, F, V)
assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == 4
assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float32"
assert cfg["num_experts_per_tok"] == 2 and cfg["max_position_embeddings"] == 64
want = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D], "lm_head.weight": [V, D]}
for l in range(L):
    p = f"model.layers.{l}."
    want[p + "input_layernorm.weight"] = [D]
    want[p + "post_attention_layernorm.weight"] = [D]
    for x in "qkvo":
        want[p + f"self_attn.{x}_proj.weight"] = [D, D]
    want[p + "block_sparse_moe.gate.weight"] = [E, D]
    for e in range(E):
        want[p + f"block_sparse_moe.experts.{e}.w1.weight"] = [F, D]
        want[p + f"block_sparse_moe.experts.{e}.w3.weight"] = [F, D]
        want[p + f"block_sparse_moe.experts.{e}.w2.weight"] = [D, F]
assert set(header) == set(want), set(header) ^ set(want)
for k, v in header.items():
    assert v["dtype"] == "F32" and v["shape"] == want[k], (k, v)
# values: each exported tensor equals its checkpoint parameter slice
names = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
layer_map = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
             "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
             "moe.router": "block_sparse_moe.gate"}
checked = 0
for line in open(listing):
    if not line.startswith("  tensor ") or "kind=param" not in line:
        continue
    f = dict(kv.split("=", 1) for kv in line.split()[1:-1])
    name, expert = f["name"], int(f["expert"])
    if name in names:
        hfname = names[name]
    else:
        _, l, rest = name.split(".", 2)
        if expert >= 0:
            hfname = f"model.layers.{l}.block_sparse_moe.experts.{expert}.{rest.split('.')[-1]}.weight"
        else:
            hfname = f"model.layers.{l}.{layer_map[rest]}.weight"
    blob = open(f"{ck}/{f['file']}", "rb").read()
    ours = np.frombuffer(blob, np.float32, int(f["nbytes"]) // 4, int(f["offset"]))
    b, e = header[hfname]["data_offsets"]
    theirs = np.frombuffer(data[b:e], np.float32)
    assert np.array_equal(ours, theirs), hfname
    checked += 1
assert checked == len(header), (checked, len(header))
print(f"{checked} tensors checked")
PY
# refusals: what Mixtral cannot express
for bad in "model.dense_layers=1:dense_layers" "model.shared_experts=1:shared_experts" "model.renorm_topk=false:renorm_topk"; do
  rm -rf "$C"
  "$MOE" train "${mix[@]}" --set "${bad%%:*}" --set train.steps=1 --set checkpoint.interval=1 >/dev/null 2>&1
  expect_exit 2 "export refuses ${bad%%:*}" -- "$MOE" export "$C/step-00000001" --format safetensors "$WORK/x"
  expect_err "Mixtral cannot express this model: \[model\] ${bad##*:}" "the reason names ${bad##*:}"
done
expect_exit 2 "export --format other" -- "$MOE" export "$C/step-00000001" --format gguf "$WORK/x"
expect_exit 2 "export without OUT" -- "$MOE" export "$C/step-00000001" --format safetensors
finish
