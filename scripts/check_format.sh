#!/usr/bin/env bash
# The C++ / CUDA sources (csrc, tests/cpp, tests/emulate, bench/cpp; not the generated
# csrc/cuda/inst) against .clang-format.
#   bash scripts/check_format.sh             check mode: changes nothing, fails if a file differs
#   bash scripts/check_format.sh --fix       reformats them in place
#   bash scripts/check_format.sh [--fix] FILE...   only these files
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || {
  echo "check_format: clang-format not found (apt-get install clang-format)" >&2
  exit 1
}
mode=(--dry-run -Werror)
if [ "${1:-}" = "--fix" ]; then
  mode=(-i)
  shift
fi
if [ $# -gt 0 ]; then
  files=("$@")
else
  mapfile -t files < <(git ls-files --cached --others --exclude-standard csrc tests/cpp \
    tests/emulate bench/cpp | grep -E '\.(h|cpp|cu|cuh)$' | grep -v '^csrc/cuda/inst/')
fi
clang-format "${mode[@]}" "${files[@]}"
echo "check_format: ${#files[@]} files ($(clang-format --version | grep -o 'version [0-9.]*'))"
