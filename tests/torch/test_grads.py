"""moe-dist's loss and every gradient against the independent PyTorch reference (moe_ref.py).

usage: /usr/bin/python3 tests/torch/test_grads.py PATH_TO_MOE_DIST

For each case: write a small config, run `moe-dist dump CONFIG --out DIR`, rebuild the
model in float64 from the dumped float32 weights and tokens, and require
  |v - ref| / |ref| <= 1e-5 for loss, ce, aux and z, and
  ||g - g_ref|| / ||g_ref|| <= 1e-5 for every parameter's gradient.
Capacity cases also require that the reference really dropped assignments. A last check
perturbs one gradient element of a dump and requires the comparison to flag it.
Prints one line per case; exits non-zero on any failure.
"""

import os
import subprocess
import sys
import tempfile
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_ref  # noqa: E402

BASE = {
    "model": {
        "vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 4, "seq_len": 16,
        "experts": 8, "top_k": 2, "expert_hidden": 24, "dense_layers": 1,
        "dense_hidden": 40, "shared_experts": 0, "renorm_topk": "true",
        "capacity_factor": 0, "aux_loss_coef": 0.1, "z_loss_coef": 0.01,
        "init_std": 0.1,
    },
    "train": {"steps": 1, "micro_batch": 3, "grad_accum": 2, "seed": 4321},
    "parallel": {"ep": 1},
    "data": {"source": "synthetic"},
    "precision": {"mode": "fp32"},
    "checkpoint": {"interval": 0},
}

# name, [model] overrides, whether assignments must be dropped
CASES = [
    ("k1_dropless",             {"top_k": 1}, False),
    ("k2_dropless",             {"top_k": 2}, False),
    ("k3_dropless",             {"top_k": 3, "dense_layers": 0}, False),
    ("k1_norenorm_shared",      {"top_k": 1, "renorm_topk": "false", "shared_experts": 1}, False),
    ("k2_norenorm_dense0",      {"top_k": 2, "renorm_topk": "false", "dense_layers": 0}, False),
    ("k2_shared2_dense0",       {"top_k": 2, "shared_experts": 2, "dense_layers": 0}, False),
    ("k3_shared_norenorm",      {"top_k": 3, "shared_experts": 1, "renorm_topk": "false"}, False),
    ("k2_capacity1.0",          {"top_k": 2, "capacity_factor": 1.0}, True),
    ("k2_capacity0.5_shared",   {"top_k": 2, "capacity_factor": 0.5, "shared_experts": 1,
                                 "dense_layers": 0}, True),
    ("k2_capacity0.75_norenorm", {"top_k": 2, "capacity_factor": 0.75,
                                  "renorm_topk": "false"}, True),
    ("k1_capacity1.0_ties",     {"top_k": 1, "capacity_factor": 1.0}, True),
    ("k2_big_aux_z",            {"top_k": 2, "aux_loss_coef": 1.0, "z_loss_coef": 0.5}, False),
]


def write_ini(path, model_over):
    with open(path, "w") as f:
        for sec, kv in BASE.items():
            f.write("[%s]\n" % sec)
            merged = dict(kv)
            if sec == "model":
                merged.update(model_over)
            for k, v in merged.items():
                f.write("%s = %s\n" % (k, v))
            f.write("\n")


def run_dump(moe_dist, ini, out):
    cmd = [moe_dist, "dump", ini, "--out", out]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300, env=env)
    if r.returncode != 0:
        raise RuntimeError("%s exited %d:\n%s" % (" ".join(cmd), r.returncode, r.stdout[-3000:]))


def check_config(cfg, over):
    """The dump's effective config must be the one asked for."""
    want = dict(BASE["model"])
    want.update(over)
    got = {"top_k": cfg.K, "dense_layers": cfg.dense_layers,
           "shared_experts": cfg.shared_experts, "renorm_topk": cfg.renorm,
           "capacity_factor": cfg.capacity_factor, "aux_loss_coef": cfg.aux_coef,
           "z_loss_coef": cfg.z_coef, "experts": cfg.E, "n_layers": cfg.L}
    for k, g in got.items():
        w = want[k]
        if k == "renorm_topk":
            w = moe_ref._parse_bool(str(w))
        if float(g) != float(w):
            raise RuntimeError("dump config.ini has %s = %s, asked for %s" % (k, g, w))


def run_case(moe_dist, tmp, name, over, need_drops):
    d = os.path.join(tmp, name)
    os.makedirs(d)
    ini = os.path.join(d, "case.ini")
    out = os.path.join(d, "dump")
    write_ini(ini, over)
    run_dump(moe_dist, ini, out)
    dump = moe_ref.Dump(out)
    check_config(dump.cfg, over)
    cmp, ref_values, ref_grads, stats = moe_ref.compare_dump(dump)
    problems = []
    if need_drops and stats["dropped"] == 0:
        problems.append("no assignment was dropped: the capacity case is not meaningful")
    if not need_drops and dump.cfg.capacity() is None and stats["dropped"]:
        problems.append("reference dropped assignments in a dropless case")
    if dump.dropped is not None and dump.dropped != stats["dropped"]:
        problems.append("moe-dist dropped %d assignments, the reference %d"
                        % (dump.dropped, stats["dropped"]))
    if not cmp.ok:
        problems.append("over %.0e: %s" % (cmp.tol, ", ".join(
            "%s %.2e" % (n, e) for n, e in sorted(cmp.failures, key=lambda kv: -kv[1])[:8])))
        problems.append("moe-dist: %s; reference: %s" % (
            " ".join("%s %.9g" % kv for kv in dump.values.items()),
            " ".join("%s %.9g" % kv for kv in ref_values.items())))
        if stats["sel_margin"] < 1e-5 or 0 < stats["cap_margin"] < 1e-5:
            problems.append("note: routing near-tie (selection margin %.1e, capacity margin "
                            "%.1e): fp32 and fp64 may route differently"
                            % (stats["sel_margin"], stats["cap_margin"]))
    info = "%s; dropped %d/%d; sel margin %.1e" % (
        cmp.summary(), stats["dropped"], stats["assignments"], stats["sel_margin"])
    return dump, ref_grads, problems, info, cmp


def negative_check(dump, ref_grads, base):
    """Perturb one gradient element by 1e-3 of its tensor's norm: the comparison must flag
    that tensor, and only it, beyond what the unperturbed comparison `base` flagged."""
    passing = [n for n in sorted(ref_grads)
               if np.linalg.norm(ref_grads[n]) > 0 and base.grad_err[n] <= base.tol]
    if not passing:
        return False, "no gradient passed the unperturbed comparison: nothing to perturb"
    routers = [n for n in passing if n.endswith("moe.router")]
    name = routers[0] if routers else passing[0]
    grads = {n: g.copy() for n, g in dump.grads.items()}
    g = grads[name]
    i = int(np.argmax(np.abs(g).ravel()))
    g.ravel()[i] += np.float32(1e-3 * np.linalg.norm(g.astype(np.float64)))
    ref_values = dict(dump.values)  # values unchanged: only the gradient must be flagged
    cmp = moe_ref.Comparison(dump.values, ref_values, grads, ref_grads)
    before = set(n for n, _ in base.failures if n.startswith("grad "))
    new = sorted(set(n for n, _ in cmp.failures) - before)
    ok = new == ["grad " + name]
    return ok, "perturbed %s[%d] by 1e-3 of its norm: newly flagged %s (rel err %.2e)" % (
        name, i, new, cmp.grad_err[name])


def main(argv):
    if len(argv) != 2:
        print("usage: test_grads.py PATH_TO_MOE_DIST", file=sys.stderr)
        return 2
    moe_dist = os.path.abspath(argv[1])
    failed = 0
    first = None
    with tempfile.TemporaryDirectory(prefix="moe_torch_") as tmp:
        for name, over, need_drops in CASES:
            try:
                dump, ref_grads, problems, info, cmp = run_case(moe_dist, tmp, name, over,
                                                                need_drops)
                if first is None:
                    first = (dump, ref_grads, cmp)
            except Exception as e:  # a crash, a bad dump: this case fails, go on
                problems, info = ["%s: %s" % (type(e).__name__, e)], ""
                if not isinstance(e, (RuntimeError, ValueError, KeyError)):
                    problems.append(traceback.format_exc())
            status = "PASS" if not problems else "FAIL"
            failed += bool(problems)
            print("%s %-26s %s" % (status, name, info), flush=True)
            for p in problems:
                print("     " + p.replace("\n", "\n     "), flush=True)
        if first is not None:
            ok, info = negative_check(*first)
            failed += not ok
            print("%s %-26s %s" % ("PASS" if ok else "FAIL", "negative_check", info))
        else:
            failed += 1
            print("FAIL negative_check             no dump to perturb")
    print("%d of %d checks failed" % (failed, len(CASES) + 1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
