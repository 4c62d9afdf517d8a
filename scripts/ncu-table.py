#!/usr/bin/env python3
"""Summarises `ncu --metrics ...` output (its default details page): per kernel, the
launches, and the mean of each metric (times in microseconds). Usage: ncu-table.py LOG"""
import re
import sys

SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
HEAD = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
ROW = re.compile(r"^\s+([a-z_]+__\S+)\s+(?:(\S+)\s+)?([\d,.]+)\s*$")


def main(path):
    kernels, order, cur = {}, [], None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = HEAD.match(line)
            if m:
                name = re.sub(r"\(.*$", "", m.group(1)).strip() or m.group(1)
                if name not in kernels:
                    kernels[name] = {"launches": 0}
                    order.append(name)
                cur = kernels[name]
                cur["launches"] += 1
                continue
            m = ROW.match(line)
            if m and cur is not None:
                key, unit, val = m.group(1), m.group(2) or "", float(m.group(3).replace(",", ""))
                if key.startswith("gpu__time_duration"):
                    key, val = "us", val * SCALE.get(unit, 1.0)
                else:
                    key = key.split(".")[0].split("__", 1)[1]
                cur.setdefault(key, []).append(val)
    if not order:
        print(f"ncu-table.py: no kernels in {path}", file=sys.stderr)
        return 1
    cols = [c for c in ("us", "throughput", "warps_active", "grid_size", "registers_per_thread")
            if any(c in kernels[k] for k in order)]
    print(f"{'kernel':<48} {'launches':>8} " + " ".join(f"{c:>14}" for c in cols))
    for k in order:
        r = kernels[k]
        vals = [sum(r[c]) / len(r[c]) if r.get(c) else float("nan") for c in cols]
        print(f"{k[:48]:<48} {r['launches']:>8} " + " ".join(f"{v:>14.2f}" for v in vals))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: ncu-table.py LOG", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
