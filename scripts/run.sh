#!/usr/bin/env bash
# One entry point for a fresh clone: sets up .venv (torch from this machine's local disk), builds
# cpattn, then runs what was asked.
#   bash scripts/run.sh demo   the main job (python -m cpattn demo)
#   bash scripts/run.sh test   every test: C++ header tests and the emulated CUDA kernels (ctest),
#                              pytest (and its tests marked slow), benchmark smoke runs, the CUDA flavour's build check,
#                              the C++ format check (scripts/check_format.sh)
#   bash scripts/run.sh bench  the benchmark table vs torch SDPA (bench/bench_attention.py)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_SPEC=${CPATTN_TORCH_SPEC:-torch==2.13.0}

need_apt=()
for pkg in libgtest-dev libbenchmark-dev clang-format; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== apt-get install ${need_apt[*]}"
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q "$TORCH_SPEC" numpy pytest pytest-benchmark expecttest \
  "scikit-build-core>=0.10" ninja "cmake>=3.25"
# The transformers integration's tests and examples (cpattn itself does not need them); the
# Trainer / SFTTrainer integration's: accelerate and TRL (TRL brings datasets).
python -m pip install -q "transformers==5.24.0" "accelerate==1.16.0" "trl==1.16.0"
python -m pip install -q "matplotlib==3.11.2"  # plots: python -m cpattn plan --plot, bench/
python -m pip install -q "ruff==0.17.5"  # lint (pyproject.toml [tool.ruff]), in `test`
echo "== building cpattn"
python -m pip install -q --no-build-isolation --no-deps .
cd /tmp  # import the installed package, not the source tree

case "${1:-}" in
  demo)
    shift
    python -m cpattn demo "$@"
    ;;
  test)
    echo "== lint (ruff check, pyproject.toml [tool.ruff])"
    (cd "$ROOT" && ruff check python tests bench examples)
    echo "== C++ tests of the header core"
    cmake -S "$ROOT" -B "$ROOT/build/cpptests" -G Ninja -DCPATTN_BUILD_EXTENSION=OFF \
      -DCPATTN_BUILD_TESTS=ON >/dev/null
    cmake --build "$ROOT/build/cpptests"
    ctest --test-dir "$ROOT/build/cpptests" --output-on-failure
    echo "== C++ benchmark (build and smoke run)"
    cmake -S "$ROOT" -B "$ROOT/build/bench" -G Ninja -DCPATTN_BUILD_EXTENSION=OFF \
      -DCPATTN_BUILD_BENCHMARKS=ON -DPython_EXECUTABLE="$(command -v python)" >/dev/null
    cmake --build "$ROOT/build/bench"
    "$ROOT/build/bench/cpattn_bench_kernel" --benchmark_filter="seqlen:1024/head_dim:64/" \
      --benchmark_min_time=0.01
    echo "== benchmark suite (smoke run)"
    python -m pytest "$ROOT/bench" -q --benchmark-disable -p no:cacheprovider
    echo "== pytest"
    python -m pytest "$ROOT/tests" -q -p no:cacheprovider --durations=20
    echo "== pytest: the soak and sweep tests (marked slow)"
    python -m pytest "$ROOT/tests" -q -p no:cacheprovider -m slow
    echo "== the one-shot GPU check, dry run on the CPU build (bench/gpu_check.sh --dry-run)"
    PYTHON=python bash "$ROOT/bench/gpu_check.sh" --dry-run "$ROOT/build/gpu_check_dry"
    echo "== CUDA flavour: compile, link, import, ptxas report (no GPU needed)"
    if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
      # The default archs (8.0;9.0) and head dims (64;128): about a minute on 2 cores.
      bash "$ROOT/.ci/check_cuda_build.sh"
      # The GPU machine's torch 2.11: every torch-touching file against its headers and
      # libraries, at one arch and head dim (the kernels do not touch torch).
      CPATTN_CI_TORCH=torch==2.11.0 CPATTN_CI_WORK="$ROOT/build/ci-cuda-2.11" \
        CPATTN_CUDA_ARCH_LIST=9.0 CPATTN_CUDA_HEAD_DIMS=64 bash "$ROOT/.ci/check_cuda_build.sh"
    else
      echo "nvcc not found: CUDA build check skipped"
    fi
    echo "== C++ / CUDA formatting (.clang-format, check mode)"
    bash "$ROOT/scripts/check_format.sh"
    ;;
  bench)
    shift
    python "$ROOT/bench/bench_attention.py" "$@"
    ;;
  *)
    echo "usage: bash scripts/run.sh demo|test|bench [args]" >&2
    exit 2
    ;;
esac
