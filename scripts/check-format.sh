#!/usr/bin/env bash
# Fails if any C source differs from the committed .clang-format style.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "clang-format missing: apt-get install clang-format" >&2; exit 1; }
git ls-files '*.c' '*.h' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
echo "format: ok"
