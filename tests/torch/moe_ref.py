"""An independent PyTorch reference of the moe-dist model, and a comparer for `moe-dist dump`.

Written from the model's specification alone (no code shared with moe-dist): given the
float32 weights and the tokens of a dump, it rebuilds the model in float64, computes the
loss (ce + aux_loss_coef * aux + z_loss_coef * z) and every gradient with autograd, and
compares them with the loss and gradients moe-dist wrote.

Dump directory (written by `moe-dist dump CONFIG --out DIR`):
  config.ini    the effective config (INI, every key)
  tokens.bin    int32 LE, (S, T+1): S = micro_batch * grad_accum sequences
  params.bin    float32 arena of the weights
  grads.bin     float32 arena of the gradients (same layout), accumulated over the
                micro-batches, before clipping and the optimizer
  tensors.json  {"tensors": [{"name", "offset" (elements), "shape"}], "loss", "ce", "aux", "z"}

Usable on its own: /usr/bin/python3 tests/torch/moe_ref.py DUMP_DIR
"""

import configparser
import json
import math
import os
import sys

import numpy as np
import torch

REL_TOL = 1e-5


# ---------------------------------------------------------------------------------------
# loading

def _parse_bool(s):
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean: %r" % s)


def _first_accum(s):
    """grad_accum is an int or a schedule 'N@step,N@step,...': micro-batches at step 0."""
    s = s.strip()
    if "@" not in s:
        return int(s)
    best = None
    for part in s.split(","):
        n, at = part.split("@")
        if int(at) == 0:
            best = int(n)
    if best is None:
        raise ValueError("grad_accum schedule %r has no entry for step 0" % s)
    return best


class ModelConfig:
    """The keys of the model the reference needs, read from an INI file."""

    def __init__(self, path):
        cp = configparser.ConfigParser(inline_comment_prefixes=(";", "#"),
                                       comment_prefixes=(";", "#"), interpolation=None)
        with open(path) as f:
            cp.read_file(f)
        self.ini = cp
        m = cp["model"]
        self.V = int(m["vocab_size"])
        self.D = int(m["d_model"])
        self.L = int(m["n_layers"])
        self.H = int(m["n_heads"])
        self.T = int(m["seq_len"])
        self.E = int(m["experts"])
        self.K = int(m["top_k"])
        self.F = int(m["expert_hidden"])
        self.dense_layers = int(m["dense_layers"])
        self.Fd = int(m["dense_hidden"])
        self.shared_experts = int(m["shared_experts"])
        self.renorm = _parse_bool(m["renorm_topk"])
        self.capacity_factor = float(m["capacity_factor"])
        self.aux_coef = float(m["aux_loss_coef"])
        self.z_coef = float(m["z_loss_coef"])
        self.rope_theta = float(m.get("rope_theta", "10000"))
        self.norm_eps = float(m.get("norm_eps", "1e-5"))
        t = cp["train"]
        self.micro_batch = int(t["micro_batch"])
        self.grad_accum = _first_accum(t["grad_accum"])
        if "rope_theta" not in m or "norm_eps" not in m:
            raise KeyError("%s: [model] must give rope_theta and norm_eps (the dump's "
                           "config.ini has every key)" % path)

    @property
    def Hd(self):
        return self.D // self.H

    def capacity(self):
        """Per micro-batch (micro_batch * T tokens) and expert; None when dropless."""
        if self.capacity_factor <= 0:
            return None
        return int(math.ceil(self.capacity_factor * self.micro_batch * self.T * self.K / self.E))

    def expected_shapes(self):
        """name -> shape of every parameter, in the spec's naming."""
        V, D, E, F = self.V, self.D, self.E, self.F
        s = {"embedding": (V, D), "final_norm": (D,), "lm_head": (V, D)}
        for l in range(self.L):
            p = "layers.%d." % l
            s[p + "attn_norm"] = (D,)
            for w in ("wq", "wk", "wv", "wo"):
                s[p + "attn." + w] = (D, D)
            s[p + "ffn_norm"] = (D,)
            if l < self.dense_layers:
                s[p + "ffn.w1"] = (self.Fd, D)
                s[p + "ffn.w3"] = (self.Fd, D)
                s[p + "ffn.w2"] = (D, self.Fd)
            else:
                s[p + "moe.router"] = (E, D)
                s[p + "moe.experts.w1"] = (E, F, D)
                s[p + "moe.experts.w3"] = (E, F, D)
                s[p + "moe.experts.w2"] = (E, D, F)
                if self.shared_experts > 0:
                    Fs = self.shared_experts * F
                    s[p + "moe.shared.w1"] = (Fs, D)
                    s[p + "moe.shared.w3"] = (Fs, D)
                    s[p + "moe.shared.w2"] = (D, Fs)
        return s


class Dump:
    """A loaded dump: cfg, tokens (S,T+1) int64, params/grads name -> float32 ndarray,
    values {loss, ce, aux, z}."""

    def __init__(self, d):
        self.dir = d
        self.cfg = ModelConfig(os.path.join(d, "config.ini"))
        with open(os.path.join(d, "tensors.json")) as f:
            meta = json.load(f)
        self.values = {k: float(meta[k]) for k in ("loss", "ce", "aux", "z")}
        # optional: assignments moe-dist dropped by the capacity, over all MoE layers
        self.dropped = int(meta["dropped"]) if "dropped" in meta else None
        T1 = self.cfg.T + 1
        tok = np.fromfile(os.path.join(d, "tokens.bin"), dtype="<i4")
        if tok.size == 0 or tok.size % T1:
            raise ValueError("tokens.bin: %d int32 is not a whole number of rows of T+1 = %d"
                             % (tok.size, T1))
        self.tokens = tok.reshape(-1, T1).astype(np.int64)
        S = self.tokens.shape[0]
        want_S = self.cfg.micro_batch * self.cfg.grad_accum
        if S != want_S:
            raise ValueError("tokens.bin has %d sequences, expected micro_batch*grad_accum = %d"
                             % (S, want_S))
        if self.tokens.min() < 0 or self.tokens.max() >= self.cfg.V:
            raise ValueError("tokens.bin: token out of [0, vocab_size)")
        pa = np.fromfile(os.path.join(d, "params.bin"), dtype="<f4")
        ga = np.fromfile(os.path.join(d, "grads.bin"), dtype="<f4")
        self.params, self.grads = {}, {}
        expected = self.cfg.expected_shapes()
        seen = set()
        for t in meta["tensors"]:
            name, off, shape = t["name"], int(t["offset"]), tuple(int(x) for x in t["shape"])
            if name in seen:
                raise ValueError("tensors.json: %s listed twice" % name)
            seen.add(name)
            if name not in expected:
                raise ValueError("tensors.json: unexpected tensor %s %s" % (name, shape))
            if shape != expected[name]:
                raise ValueError("tensors.json: %s has shape %s, expected %s"
                                 % (name, shape, expected[name]))
            n = int(np.prod(shape))
            if off < 0 or off + n > pa.size or off + n > ga.size:
                raise ValueError("tensors.json: %s [%d, %d) outside the arenas (%d, %d)"
                                 % (name, off, off + n, pa.size, ga.size))
            self.params[name] = pa[off:off + n].reshape(shape).copy()
            self.grads[name] = ga[off:off + n].reshape(shape).copy()
        missing = sorted(set(expected) - seen)
        if missing:
            raise ValueError("tensors.json lacks: %s" % ", ".join(missing))
        for name, a in self.params.items():
            if not np.all(np.isfinite(a)):
                raise ValueError("params.bin: %s is not finite" % name)


# ---------------------------------------------------------------------------------------
# the model

def rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def swiglu(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def rope_tables(T, Hd, theta, dtype):
    half = Hd // 2
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / Hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]   # (T, Hd/2)
    ang = torch.cat([ang, ang], dim=-1)                                      # (T, Hd)
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def attention(h, P, p, cfg, cos, sin):
    S, T, D = h.shape
    H, Hd = cfg.H, cfg.Hd

    def heads(y):  # (S,T,D) -> (S,H,T,Hd), feature index = head*Hd + i
        return y.view(S, T, H, Hd).transpose(1, 2)

    q = heads(h @ P[p + "attn.wq"].T)
    k = heads(h @ P[p + "attn.wk"].T)
    v = heads(h @ P[p + "attn.wv"].T)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(Hd)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    a = torch.softmax(scores, dim=-1) @ v                     # (S,H,T,Hd)
    a = a.transpose(1, 2).reshape(S, T, D)
    return a @ P[p + "attn.wo"].T


def topk_select(probs_np, K):
    """Experts by decreasing probability, ties to the lower index; (N,K) int64, and the
    smallest relative gap between the k-th and (k+1)-th probability (selection margin)."""
    order = np.argsort(-probs_np, axis=1, kind="stable")
    idx = order[:, :K]
    margin = float("inf")
    if K < probs_np.shape[1]:
        srt = np.take_along_axis(probs_np, order, axis=1)
        gaps = (srt[:, K - 1] - srt[:, K]) / srt[:, K - 1]
        margin = float(gaps.min())
    # also gaps inside the top-k only change the slot order, which is harmless
    return idx, margin


def capacity_keep(idx, w_np, S, T, E, K, C):
    """keep (N,K) bool. Per group (S groups of T tokens: the micro-batches) and expert,
    at most C assignments: the highest
    weight, ties to the lower token index, then the lower slot. Returns keep, the number
    dropped, and the smallest relative weight gap at a drop boundary (inf if none; 0 for
    exact ties, which are resolved by index exactly as in moe-dist)."""
    N = S * T
    keep = np.ones((N, K), dtype=bool)
    if C is None:
        return keep, 0, float("inf")
    dropped = 0
    margin = float("inf")
    for s in range(S):
        for e in range(E):
            tt, kk = np.nonzero(idx[s * T:(s + 1) * T] == e)
            if len(tt) <= C:
                continue
            rows = sorted(zip(tt.tolist(), kk.tolist()),
                          key=lambda r: (-w_np[s * T + r[0], r[1]], r[0], r[1]))
            for t, k in rows[C:]:
                keep[s * T + t, k] = False
                dropped += 1
            wc = w_np[s * T + rows[C - 1][0], rows[C - 1][1]] if C > 0 else float("inf")
            wn = w_np[s * T + rows[C][0], rows[C][1]]
            if C > 0:
                margin = min(margin, float((wc - wn) / wc))
    return keep, dropped, margin


def moe_layer(h2, P, p, cfg, stats):
    S, T, D = h2.shape
    N, E, K = S * T, cfg.E, cfg.K
    x = h2.reshape(N, D)
    logits = x @ P[p + "moe.router"].T                        # (N,E)
    probs = torch.softmax(logits, dim=-1)
    pn = probs.detach().numpy()
    idx_np, sel_margin = topk_select(pn, K)
    idx = torch.from_numpy(idx_np)
    w = probs.gather(1, idx)                                  # (N,K)
    if cfg.renorm:
        w = w / w.sum(dim=1, keepdim=True)
    # aux loss and capacity are per micro-batch: G groups of B sequences (B*T tokens)
    B = cfg.micro_batch
    G, GT = S // B, B * T
    keep, dropped, cap_margin = capacity_keep(idx_np, w.detach().numpy(), G, GT, E, K,
                                              cfg.capacity())
    stats["dropped"] += dropped
    stats["assignments"] += N * K
    stats["sel_margin"] = min(stats["sel_margin"], sel_margin)
    stats["cap_margin"] = min(stats["cap_margin"], cap_margin)

    out = torch.zeros_like(x)
    W1, W3, W2 = P[p + "moe.experts.w1"], P[p + "moe.experts.w3"], P[p + "moe.experts.w2"]
    for e in range(E):
        tok, slot = np.nonzero((idx_np == e) & keep)
        if len(tok) == 0:
            continue
        tok_t, slot_t = torch.from_numpy(tok), torch.from_numpy(slot)
        y = swiglu(x[tok_t], W1[e], W3[e], W2[e]) * w[tok_t, slot_t][:, None]
        out = out.index_add(0, tok_t, y)
    if cfg.shared_experts > 0:
        out = out + swiglu(x, P[p + "moe.shared.w1"], P[p + "moe.shared.w3"],
                           P[p + "moe.shared.w2"])

    # aux: per micro-batch, f_e from the top-k counts before drops (a constant)
    counts = np.zeros((G, E))
    for g in range(G):
        counts[g] = np.bincount(idx_np[g * GT:(g + 1) * GT].ravel(), minlength=E)
    f = torch.from_numpy(counts / (GT * K)).to(x.dtype)      # (G,E)
    Pm = probs.view(G, GT, E).mean(dim=1)                     # (G,E)
    aux = (E * (f * Pm).sum(dim=1)).mean()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return out.view(S, T, D), aux, z


def forward(cfg, P, tokens):
    """P: name -> tensor (any float dtype, requires_grad as wanted); tokens (S,T+1).
    Returns loss, ce, aux, z (tensors) and routing stats."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    T = tokens.shape[1] - 1
    assert T == cfg.T
    dtype = P["embedding"].dtype
    inp, tgt = tokens[:, :T], tokens[:, 1:]
    cos, sin = rope_tables(T, cfg.Hd, cfg.rope_theta, dtype)
    stats = {"dropped": 0, "assignments": 0, "sel_margin": float("inf"),
             "cap_margin": float("inf")}
    x = P["embedding"][inp]                                   # (S,T,D)
    aux = torch.zeros((), dtype=dtype)
    z = torch.zeros((), dtype=dtype)
    for l in range(cfg.L):
        p = "layers.%d." % l
        h = rmsnorm(x, P[p + "attn_norm"], cfg.norm_eps)
        x = x + attention(h, P, p, cfg, cos, sin)
        h2 = rmsnorm(x, P[p + "ffn_norm"], cfg.norm_eps)
        if l < cfg.dense_layers:
            ffn = swiglu(h2, P[p + "ffn.w1"], P[p + "ffn.w3"], P[p + "ffn.w2"])
        else:
            ffn, a, zz = moe_layer(h2, P, p, cfg, stats)
            aux = aux + a
            z = z + zz
        x = x + ffn
    logits = rmsnorm(x, P["final_norm"], cfg.norm_eps) @ P["lm_head"].T
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.V), tgt.reshape(-1))
    loss = ce + cfg.aux_coef * aux + cfg.z_coef * z
    return loss, ce, aux, z, stats


def reference(cfg, params, tokens, dtype=torch.float64):
    """params: name -> float32 ndarray. Returns values {loss, ce, aux, z} (floats),
    grads name -> ndarray (dtype), stats."""
    P = {n: torch.from_numpy(np.asarray(a)).to(dtype).requires_grad_(True)
         for n, a in params.items()}
    loss, ce, aux, z, stats = forward(cfg, P, tokens)
    loss.backward()
    values = {"loss": loss.item(), "ce": ce.item(), "aux": aux.item(), "z": z.item()}
    grads = {n: t.grad.detach().numpy() if t.grad is not None else np.zeros(t.shape)
             for n, t in P.items()}
    return values, grads, stats


# ---------------------------------------------------------------------------------------
# comparison

def rel_err(a, ref):
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    num = float(np.linalg.norm((a - ref).ravel()))
    den = float(np.linalg.norm(ref.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


class Comparison:
    def __init__(self, values, ref_values, grads, ref_grads, tol=REL_TOL):
        self.tol = tol
        self.value_err = {k: rel_err(values[k], ref_values[k]) for k in ref_values}
        self.grad_err = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
        self.failures = [("value " + k, e) for k, e in self.value_err.items() if not e <= tol]
        self.failures += [("grad " + n, e) for n, e in self.grad_err.items() if not e <= tol]

    @property
    def ok(self):
        return not self.failures

    def worst_grads(self, n=3):
        return sorted(self.grad_err.items(), key=lambda kv: -kv[1])[:n]

    def summary(self):
        vals = " ".join("%s %.1e" % (k, e) for k, e in self.value_err.items())
        worst = ", ".join("%s %.1e" % (n, e) for n, e in self.worst_grads())
        return "values rel err: %s; worst grads: %s" % (vals, worst)


def compare_dump(dump, dtype=torch.float64):
    ref_values, ref_grads, stats = reference(dump.cfg, dump.params, dump.tokens, dtype)
    cmp = Comparison(dump.values, ref_values, dump.grads, ref_grads)
    return cmp, ref_values, ref_grads, stats


def main(argv):
    if len(argv) != 2:
        print("usage: moe_ref.py DUMP_DIR", file=sys.stderr)
        return 2
    dump = Dump(argv[1])
    cmp, ref_values, _, stats = compare_dump(dump)
    for k in ("loss", "ce", "aux", "z"):
        print("%-4s moe-dist %.9g  reference %.9g  rel err %.2e"
              % (k, dump.values[k], ref_values[k], cmp.value_err[k]))
    for n, e in sorted(cmp.grad_err.items(), key=lambda kv: -kv[1]):
        print("grad %-28s rel err %.2e%s" % (n, e, "" if e <= cmp.tol else "  FAIL"))
    print("routing: reference dropped %d of %d assignments (moe-dist: %s); selection margin %.1e"
          % (stats["dropped"], stats["assignments"], dump.dropped, stats["sel_margin"]))
    print("PASS" if cmp.ok else "FAIL (%d over %.0e)" % (len(cmp.failures), cmp.tol))
    return 0 if cmp.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
