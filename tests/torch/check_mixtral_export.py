"""An exported checkpoint loads in transformers' MixtralForCausalLM and gives moe-dist's logits.

usage: python3 tests/torch/check_mixtral_export.py PATH_TO_MOE_DIST [--device cuda|cpu]

Needs torch and transformers (not Debian packages: run it on a host that has them, such
as the GPU host); without transformers it prints SKIP with the reason and exits 0.

Steps: train a Mixtral-shaped model (no dense layers, no shared experts, renormalised
top-k) for 4 steps with a checkpoint at the end; `moe-dist export CKPT --format
safetensors OUT`; `moe-dist dump CONFIG --out DUMP --resume CKPT`, which runs the
checkpoint's weights on sequences [0, micro_batch) and writes tokens.bin and logits.bin
(float32, (micro_batch*seq_len, vocab)); then MixtralForCausalLM.from_pretrained(OUT) in
float32 (and bf16 when on a GPU) on the same tokens. Requires
  max |logits_hf - logits_moe| <= 2e-3 (fp32), and <= 0.1 + 2e-2 * |logits| (bf16),
and the same argmax for >= 99% of positions. Exits non-zero on a mismatch.
"""

import os
import subprocess
import sys
import tempfile

CONFIG = """
[model]
vocab_size = 256
d_model = 64
n_layers = 2
n_heads = 4
seq_len = 32
experts = 8
top_k = 2
expert_hidden = 96
dense_layers = 0
shared_experts = 0
renorm_topk = true
[train]
steps = 4
micro_batch = 4
grad_accum = 1
lr = 3e-3
warmup_steps = 1
[checkpoint]
interval = 4
"""


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    moe = sys.argv[1]
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else None
    try:
        import numpy as np
        import torch
        from transformers import MixtralForCausalLM
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
        print(f"SKIP: check_mixtral_export needs numpy, torch and transformers ({e})")
        return 0
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "mix.ini")
        ckdir = os.path.join(d, "ckpt")
        with open(cfg, "w") as f:
            f.write(CONFIG + f"dir = {ckdir}\n")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        run = lambda *a: subprocess.run([moe, *a], check=True, env=env, stdout=subprocess.PIPE)  # noqa: E731
        run("train", cfg, "--set", "parallel.backend=cpu")
        ckpt = os.path.join(ckdir, "step-00000004")
        out, dump = os.path.join(d, "hf"), os.path.join(d, "dump")
        run("export", ckpt, "--format", "safetensors", out)
        run("dump", cfg, "--out", dump, "--resume", ckpt, "--set", "parallel.backend=cpu")
        B, T, V = 4, 32, 256
        tokens = np.fromfile(os.path.join(dump, "tokens.bin"), np.int32).reshape(B, T + 1)
        ours = np.fromfile(os.path.join(dump, "logits.bin"), np.float32).reshape(B, T, V)
        failed = False
        dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
        for dtype in dtypes:
            model = MixtralForCausalLM.from_pretrained(out, torch_dtype=dtype,
                                                       attn_implementation="eager").to(device)
            model.eval()
            with torch.no_grad():
                ids = torch.from_numpy(tokens[:, :T].astype(np.int64)).to(device)
                theirs = model(input_ids=ids).logits.float().cpu().numpy()
            diff = np.abs(theirs - ours)
            tol = 2e-3 if dtype == torch.float32 else 0.1 + 2e-2 * np.abs(ours)
            agree = (theirs.argmax(-1) == ours.argmax(-1)).mean()
            ok = bool(np.all(diff <= tol)) and agree >= 0.99
            failed |= not ok
            print(f"{'ok' if ok else 'FAIL'}: MixtralForCausalLM {str(dtype).split('.')[-1]} on "
                  f"{device}: max |logit diff| {diff.max():.2e}, argmax agreement {agree:.4f}")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
