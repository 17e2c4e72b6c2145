#!/usr/bin/env bash
# GPU check of cpattn's CUDA backend in one call, for a fresh one-GPU machine (H200: torch 2.11,
# CUDA 13, nvcc, no network): builds from source, runs the CUDA checks against float64 (kernels,
# masks, GQA, odd lengths, poisoned outputs, deterministic dQ, emulated ring W = 1..4, NCCL W = 1),
# compute-sanitizer (memcheck, racecheck) on a small case, and times forward / backward against
# torch SDPA (flash, cuDNN). Full logs go to the results folder; a short summary and the timing
# table print last. Meant to finish in under 8 minutes.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]     (default: $OUT, else ./gpu_check_results)
#
# Environment: PYTHON (default python3), CPATTN_CUDA_ARCH_LIST (default: the device's own, e.g.
# 9.0), CPATTN_CUDA_HEAD_DIMS (default 64;128), GPU_CHECK_SKIP_BUILD=1 (use the installed cpattn).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
res=${1:-${OUT:-$PWD/gpu_check_results}}
mkdir -p "$res"
res=$(cd "$res" && pwd)
py=${PYTHON:-python3}
t_start=$(date +%s)
deadline=$((t_start + 465))  # 7 min 45 s: stages shrink to fit
[[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1

elapsed() { echo $(( $(date +%s) - t_start )); }
left() { echo $(( deadline - $(date +%s) )); }
budget() {  # budget CAP: min(CAP, time left minus what the later stages need (arg 2))
  local cap=$1 reserve=${2:-0} l
  l=$(( $(left) - reserve ))
  (( l < cap )) && cap=$l
  (( cap < 5 )) && cap=5
  echo "$cap"
}
summary=()
note() { summary+=("$*"); echo "== $*"; }

# ---- 0. machine -------------------------------------------------------------------------------
{
  nvidia-smi 2>&1 || true
  "$py" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  command -v nvcc && nvcc --version | tail -2
  command -v compute-sanitizer || true
} >"$res/machine.txt" 2>&1
cat "$res/machine.txt" | grep -E "python|release|H200|H100|A100|NVIDIA-SMI" | head -5
archs=${CPATTN_CUDA_ARCH_LIST:-$("$py" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}')" 2>/dev/null || echo 9.0)}
heads=${CPATTN_CUDA_HEAD_DIMS:-64;128}

# ---- 1. build -----------------------------------------------------------------------------------
if [[ ${GPU_CHECK_SKIP_BUILD:-0} != 1 ]]; then
  t=$(date +%s)
  echo "== build (archs $archs, head dims $heads), log $res/build.log"
  if CPATTN_CUDA=ON CPATTN_CUDA_ARCH_LIST="$archs" CPATTN_CUDA_HEAD_DIMS="$heads" \
     CPATTN_CUDA_PTXAS_VERBOSE=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "$(budget 240 220)" \
     "$py" -m pip install --no-build-isolation --no-deps --force-reinstall \
       --config-settings=build-dir=/tmp/cpattn-gpu-build -v "$repo" >"$res/build.log" 2>&1; then
    note "build: OK in $(( $(date +%s) - t )) s"
  else
    tail -30 "$res/build.log"
    note "build: FAILED after $(( $(date +%s) - t )) s (see build.log)"
    printf '%s\n' "${summary[@]}" | tee "$res/summary.txt"
    exit 1
  fi
fi
cd /tmp || exit 1  # import the installed package, not the source tree
"$py" -c "import cpattn, json; print(json.dumps(cpattn.build_info()))" 2>&1 | tee "$res/build_info.json"
# ptxas figures of the build's kernels (registers, spills): the build ran with -Xptxas=-v
if [[ -f $res/build.log ]]; then
  "$py" "$repo/.ci/ptxas_report.py" "$res/build.log" --out "$res/ptxas.txt" >/dev/null 2>&1
  note "ptxas: $(awk 'NR > 1 && $(NF-1) != "0/0"' "$res/ptxas.txt" 2>/dev/null | wc -l) kernel builds with spills (ptxas.txt)"
fi

# ---- 2. CUDA checks vs float64 ------------------------------------------------------------------
t=$(date +%s)
timeout "$(budget 150 130)" "$py" "$repo/tests/cuda/checks.py" >"$res/checks.log" 2>&1
rc=$?
grep -E "^(FAIL|  failed)" "$res/checks.log" | head -20
note "checks: $(grep -E 'checks passed' "$res/checks.log" || echo "no summary (rc $rc)") [rc $rc, $(( $(date +%s) - t )) s]"

# ---- 3. compute-sanitizer on a small case -------------------------------------------------------
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    t=$(date +%s)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(budget 60 70)" compute-sanitizer --tool "$tool" \
      --error-exitcode 99 "$py" "$repo/tests/cuda/checks.py" --sanitizer-case \
      >"$res/sanitizer_$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$res/sanitizer_$tool.log" | tail -1) [rc $rc, $(( $(date +%s) - t )) s]"
  done
else
  note "compute-sanitizer: not found"
fi

# ---- 4. timing vs SDPA -------------------------------------------------------------------------
t=$(date +%s)
b=$(budget 150 30)
timeout "$((b + 20))" "$py" "$repo/bench/gpu_bench.py" --out "$res" --budget "$b" \
  >"$res/bench.log" 2>&1
note "bench: rc $?, $(( $(date +%s) - t )) s (full table: gpu_bench.md)"

note "total: $(elapsed) s"
echo
printf '%s\n' "${summary[@]}" | tee "$res/summary.txt"
echo
cat "$res/gpu_bench.md" 2>/dev/null || tail -20 "$res/bench.log"
