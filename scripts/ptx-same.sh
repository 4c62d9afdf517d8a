#!/usr/bin/env bash
# Whether a change leaves a CUDA source's kernels as they were, checked without a GPU:
# compiles FILE (a .cu under kernels/cuda) as git revision REV has it and as the working
# tree has it, to PTX for ARCH (default sm_90a under kernels/cuda/sm90/, else sm_80), and
# compares each kernel of REV's with the working tree's of the same name once the text
# STRIP is taken out of the latter's (a template argument the change added: Li0E for
# `int X = 0`, Lb0E for `bool X = false`). Line records, label numbers (those of inline
# assembly's %= renumbered in order), comments naming a kernel and the hash of the file's
# path in internal names aside, equal PTX is equal machine code (ptxas is deterministic).
# Prints SAME, PARAMS (the same code, a parameter of another size: a struct passed by
# value grew), DIFF or MISSING a kernel of REV's, then a count; exit 0 when all are SAME,
# 1 otherwise, 2 on a usage or compile error. NVCC: the compiler
# (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc).
# Usage: scripts/ptx-same.sh REV FILE [STRIP]
# Example: scripts/ptx-same.sh HEAD~1 kernels/cuda/sm90/attention_wgmma.cu Li0E
set -uo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; }
[ $# -ge 2 ] && [ $# -le 3 ] || { usage && exit 2; }
rev=$1 file=$2 strip=${3:-}
root=$(git rev-parse --show-toplevel) || exit 2
cd "$root" || exit 2
[ -f "$file" ] || { echo "ptx-same.sh: no file $file in the working tree" >&2 && exit 2; }
git cat-file -e "$rev:$file" 2>/dev/null || { echo "ptx-same.sh: $rev has no $file" >&2 && exit 2; }
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$nvcc" ] || { echo "ptx-same.sh: no nvcc ($nvcc)" >&2 && exit 2; }
case "$file" in
kernels/cuda/sm90/*) arch=${ARCH:-sm_90a} ;;
*) arch=${ARCH:-sm_80} ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/old"
git archive "$rev" | tar -x -C "$tmp/old" || exit 2
flags=(-O3 -std=c++17 -arch="$arch" -ptx)
"$nvcc" "${flags[@]}" -I"$tmp/old" "$tmp/old/$file" -o "$tmp/old.ptx" 2>"$tmp/old.err" ||
  { cat "$tmp/old.err" >&2 && echo "ptx-same.sh: $file at $rev does not compile" >&2 && exit 2; }
"$nvcc" "${flags[@]}" -I"$root" "$root/$file" -o "$tmp/new.ptx" 2>"$tmp/new.err" ||
  { cat "$tmp/new.err" >&2 && echo "ptx-same.sh: $file does not compile" >&2 && exit 2; }
python3 - "$tmp/old.ptx" "$tmp/new.ptx" "$strip" <<'PY'
import re, sys

def kernels(path):
    # internal-linkage names carry a hash of the file's path: not the code's
    text = re.sub(r"_INTERNAL_[0-9a-f]+_", "_INTERNAL_", open(path).read())
    # a kernel runs from its .entry line to the next function's or the end (inline
    # assembly's braces stand at the start of lines too, so no brace ends one)
    start = re.compile(r"^(\.visible\s+|\.weak\s+|\.extern\s+)*\.(entry|func)\s+(\S+?)\(?$")
    out, name, lines = {}, None, []

    def close():
        if name is not None:
            body = "\n".join(lines).replace(name, "KERNEL")
            body = re.sub(r"[ \t]*\.loc\b.*\n", "", body)
            body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
            body = re.sub(r"\$L__tmp\d+", "$L__tmp", body)
            body = re.sub(r"^[ \t]*// \.globl.*(\n|$)", "", body, flags=re.M)  # names a kernel
            # the labels of inline assembly (%=) are numbered across the file: renumbered
            # in the order the kernel defines them
            labels = {}
            for m in re.finditer(r"^([A-Za-z_][A-Za-z0-9_]*?_)\d+:", body, flags=re.M):
                labels.setdefault(m.group(0)[:-1], f"{m.group(1)}#{len(labels)}")
            body = re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*_\d+\b",
                          lambda m: labels.get(m.group(0), m.group(0)), body)
            out[name] = body

    for line in text.splitlines():
        m = start.match(line)
        if m:
            close()
            name, lines = (m.group(3) if m.group(2) == "entry" else None), []
        lines.append(line)
    close()
    return out

old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
strip = sys.argv[3]
# the last occurrence of strip taken out: the argument a change adds comes last
by_name = {(n[::-1].replace(strip[::-1], "", 1)[::-1] if strip else n): b for n, b in new.items()}
def sizes_out(body): # the parameters' sizes taken out
    return re.sub(r"(\.param\b[^\n\[]*)\[\d+\]", r"\1[]", body)

same = params = 0
for name, body in old.items():
    got = by_name.get(name)
    verdict = ("MISSING" if got is None else "SAME" if got == body else
               "PARAMS" if sizes_out(got) == sizes_out(body) else "DIFF")
    same += verdict == "SAME"
    params += verdict == "PARAMS"
    print(f"{verdict:8} {name}")
more = f"; {params} more with the same code but a parameter of another size" if params else ""
print(f"{same} of {len(old)} kernels the same{more} ({len(new)} in the working tree)")
sys.exit(0 if old and same == len(old) else 1)
PY
