#!/usr/bin/env bash
# One unattended GPU check of cpattn's CUDA backend, for a fresh one-GPU machine (H200: its own
# python3 with torch 2.11 (CUDA 13), nvcc, nvidia-nccl, compute-sanitizer, no package index).
# Every stage runs in its own process under `timeout`, so a crash or an illegal address in one
# cannot poison the next; each gives one PASS / FAIL / SKIP line with its key figure.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]   (default: $OUT, else ./gpu_check_results)
#   bash bench/gpu_check.sh --dry-run [DIR] the same stages on the installed CPU build (the
#                                           checks' CPU mode, a quick pass): CI runs it, so a
#                                           change that breaks this script fails CI
#
# Stages: preflight (versions), build (all head dims, arch 9.0), checks against float64 (kernels
# for every head dim, ragged lengths, deterministic dQ, emulated ring, NCCL W = 1, every strategy
# and the inference API, opcheck + torch.compile), the GPU hot path (bench/gpu_hot_path.py, one
# process each: sync_free (host syncs per call under torch.cuda.set_sync_debug_mode("error")),
# run_ahead (host time per call behind queued GPU work, host cost per ring post), capture (CUDA
# graph of a ring layer, shifts refused in a capture), streams (side stream, NaN-filled memory
# reuse), profile (idle fraction and copy/compute overlap of an emulated W = 4 ring, decode KV read
# rate)), hybrid_cp (a GDN and a Mamba-2 layer under CP in bf16, emulated ranks, against a
# float64 truth: bench/gpu_hybrid.py), compute-sanitizer (memcheck, racecheck, synccheck on
# cpattn's kernels only), TFLOP/s vs torch SDPA flash. Meant to finish in 8 minutes.
#
# Results (at most 8 files): summary.txt (one line per stage), gpu_bench.md, checks.log (every
# check and hot path stage's output) and gpu_check.tar.gz (everything else: preflight, build log,
# ptxas report, sanitizer logs, bench json, the hot path's json and gzipped profiler traces).
#
# Environment: PYTHON (default python3), CPATTN_CUDA_ARCH_LIST (default 9.0),
# CPATTN_CUDA_HEAD_DIMS (default ALL), GPU_CHECK_SKIP_BUILD=1 (use the installed cpattn).
set -uo pipefail

dry=0
if [[ ${1:-} == --dry-run ]]; then
  dry=1
  shift
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
res=${1:-${OUT:-$PWD/gpu_check_results}}
mkdir -p "$res"
res=$(cd "$res" && pwd)
rm -f "$res/summary.txt" "$res/checks.log" "$res/gpu_bench.md" "$res/gpu_check.tar.gz"
work=$(mktemp -d)  # everything but the three text files; packed into the .tar.gz at the end
py=${PYTHON:-python3}
archs=${CPATTN_CUDA_ARCH_LIST:-9.0}
heads=${CPATTN_CUDA_HEAD_DIMS:-ALL}
t_start=$(date +%s)
deadline=$((t_start + 480))  # 8 min: stages shrink towards their floors to fit
[[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 CPATTN_POISON=1
checks=(env)
if ((dry)); then
  checks=(env CPATTN_CHECKS_DEVICE=cpu)
  export GPU_CHECK_SKIP_BUILD=1
fi

left() { echo $((deadline - $(date +%s))); }
# Seconds for a stage: its CAP, less when the time left minus RESERVE (the floors of the later
# stages) is shorter, but never below its FLOOR (a slow build cannot starve every check).
# The dry run's CPU speed is unknown (a shared CI machine): only a hang guard there.
budget() {  # budget CAP FLOOR RESERVE
  ((dry)) && { echo 600; return; }
  local cap=$1 floor=$2 l=$(($(left) - $3))
  ((l < cap)) && cap=$l
  ((cap < floor)) && cap=$floor
  echo "$cap"
}
line() { echo "$*" | tee -a "$res/summary.txt"; }

# ---- preflight: what the machine has -----------------------------------------------------------
{
  echo "date: $(date -u)   dry run: $dry"
  "$py" - <<'EOF'
import importlib, shutil, subprocess, sys, sysconfig, os
print("python", sys.version.split()[0], sys.executable)
inc = sysconfig.get_paths()["include"]
print("Python.h:", os.path.exists(os.path.join(inc, "Python.h")), inc)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    if torch.cuda.is_available():
        print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as e:  # noqa: BLE001
    print("torch: not importable:", e)
for mod in ("scikit_build_core", "pybind11", "ninja", "cmake", "pytest"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception:  # noqa: BLE001
        print(mod, "missing")
for tool in ("cmake", "ninja", "nvcc", "compute-sanitizer", "nvidia-smi"):
    print(tool, shutil.which(tool))
EOF
  command -v nvcc >/dev/null && nvcc --version | tail -2
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader
} >"$work/preflight.txt" 2>&1
torch_line=$(grep -E "^torch " "$work/preflight.txt" | head -1)
line "preflight: PASS ($torch_line; $(grep -E '^Python.h' "$work/preflight.txt" | cut -d' ' -f1-2))"

# ---- build ------------------------------------------------------------------------------------
if [[ ${GPU_CHECK_SKIP_BUILD:-0} != 1 ]]; then
  t=$(date +%s)
  if CPATTN_CUDA=ON CPATTN_CUDA_ARCH_LIST="$archs" CPATTN_CUDA_HEAD_DIMS="$heads" \
     CPATTN_CUDA_PTXAS_VERBOSE=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "$(budget 270 120 325)" \
     "$py" -m pip install --no-build-isolation --no-deps --no-index --force-reinstall \
       --config-settings=build-dir=/tmp/cpattn-gpu-build -v "$repo" >"$work/build.log" 2>&1; then
    line "build: PASS (archs $archs, head dims $heads, $(($(date +%s) - t)) s)"
  else
    line "build: FAIL after $(($(date +%s) - t)) s (build.log in gpu_check.tar.gz)"
    tail -30 "$work/build.log" >"$res/checks.log"
  fi
else
  line "build: SKIP (installed cpattn used)"
fi
cd /tmp || exit 1  # import the installed package, not the source tree
"$py" -c "import cpattn, json; print(json.dumps(cpattn.build_info()))" >"$work/build_info.json" 2>&1
if [[ -f $work/build.log ]]; then
  if "$py" "$repo/.ci/ptxas_report.py" "$work/build.log" --out "$work/ptxas.txt" \
       --fail-on-spill attention_fwd_kernel attention_bwd_dq_kernel merge_state >/dev/null 2>&1; then
    line "ptxas: PASS (no spills in the forward / dQ / merge kernels; ptxas.txt)"
  else
    line "ptxas: FAIL (spills in a kernel that must not spill, or no report; ptxas.txt)"
  fi
fi

# ---- checks against float64, one process per stage ---------------------------------------------
quick=()
((dry)) && quick=(--first)
stage() {  # stage NAME CAP FLOOR RESERVE FILTERS
  local name=$1 cap=$2 floor=$3 reserve=$4 filters=$5 t rc summary log=$work/stage_$1.log
  t=$(date +%s)
  timeout "$(budget "$cap" "$floor" "$reserve")" "${checks[@]}" "$py" "$repo/tests/cuda/checks.py" \
    -k "$filters" "${quick[@]}" >"$log" 2>&1
  rc=$?
  { echo "===== stage $name: checks.py -k $filters (rc $rc)"; cat "$log"; } >>"$res/checks.log"
  summary=$(grep -E "checks passed" "$log" | tail -1)
  if grep -q "^SKIP: no CUDA" "$log"; then
    line "$name: SKIP (no CUDA device, or cpattn built without CUDA)"
  elif ((rc == 0)) && [[ $summary == 0/0* ]]; then
    line "$name: SKIP (CUDA-only checks: none in the checks' CPU mode)"
  elif ((rc == 124 || rc == 137)); then
    line "$name: FAIL (timed out after $(($(date +%s) - t)) s; checks.log)"
  elif ((rc == 0)) && [[ -n $summary ]]; then
    line "$name: PASS ($summary)"
  else
    line "$name: FAIL (rc $rc; ${summary:-no summary}; checks.log)"
  fi
}
stage kernels 150 45 280 "fwd_bwd/,head_dim/,fwd/,errors/,merge_state/,score_options/"
stage deterministic_dq 30 10 270 "bwd/deterministic,bwd/dlse"
stage ring_emulated 60 20 250 "ring_emulated/"
stage nccl_w1 40 20 230 "ring_nccl/"
stage strategies_inference 60 25 205 "strategies/,inference/"
stage opcheck_compile 60 25 180 "opcheck/,compile/"

# ---- the GPU hot path (issue 29): bench/gpu_hot_path.py, one process per stage -----------------
# Their floors (60 s in all) are in the reserves above; each prints its own summary line.
hot=()
((dry)) && hot=(--dry-run)
hot_path() {  # hot_path NAME CAP FLOOR RESERVE
  local name=$1 t rc summary log=$work/hot_path_$1.log
  t=$(date +%s)
  timeout "$(budget "$2" "$3" "$4")" "$py" "$repo/bench/gpu_hot_path.py" "$name" --out "$work" \
    "${hot[@]}" >"$log" 2>&1
  rc=$?
  { echo "===== hot path $name (rc $rc)"; cat "$log"; } >>"$res/checks.log"
  summary=$(grep -E "^$name: (PASS|FAIL|SKIP)" "$log" | tail -1)
  if ((rc == 124 || rc == 137)); then
    line "$name: FAIL (timed out after $(($(date +%s) - t)) s; checks.log)"
  elif [[ -n $summary ]]; then
    line "$summary"
  else
    line "$name: FAIL (rc $rc, no summary line; checks.log)"
  fi
}
hot_path sync_free 40 15 165
hot_path run_ahead 25 10 155
hot_path capture 25 10 145
hot_path streams 25 10 135
hot_path profile 45 15 120

# ---- hybrid layers under CP (issue 54): bench/gpu_hybrid.py -----------------------------------
# One GDN and one Mamba-2 layer, W emulated ranks, bf16, against a float64 truth and the module's
# own bf16 run; fast kernels (fla, mamba_ssm) for the local piece when importable. Wheels in
# $GPU_CHECK_WHEELS (default .whl in the repository: transformers 5.24, flash-linear-attention;
# bench/README.md) are installed for this stage only.
t=$(date +%s)
hybrid=(--world 4 --seqlen 8192)
((dry)) && hybrid=(--dry-run)
wheels=${GPU_CHECK_WHEELS:-$repo/.whl}
site=${PYTHONPATH:-}
if ((!dry)) && compgen -G "$wheels/*.whl" >/dev/null; then
  target=$(mktemp -d)  # (outside $work: not packed into gpu_check.tar.gz)
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$target" "$wheels"/*.whl \
    >"$work/hybrid_wheels.log" 2>&1 && site=$target${site:+:$site}
fi
PYTHONPATH=$site timeout "$(budget 90 45 75)" "$py" "$repo/bench/gpu_hybrid.py" --out "$work" \
  "${hybrid[@]}" >"$work/hybrid_cp.log" 2>&1
rc=$?
{ echo "===== hybrid_cp (rc $rc)"; cat "$work/hybrid_cp.log"; } >>"$res/checks.log"
summary=$(grep -E "^hybrid_cp: (PASS|FAIL|SKIP)" "$work/hybrid_cp.log" | tail -1)
if ((rc == 124 || rc == 137)); then
  line "hybrid_cp: FAIL (timed out after $(($(date +%s) - t)) s; checks.log)"
elif [[ -n $summary ]]; then
  line "$summary"
else
  line "hybrid_cp: FAIL (rc $rc, no summary line; checks.log)"
fi

# ---- compute-sanitizer: cpattn's kernels only, a small case -------------------------------------
if ((dry)); then
  t=$(date +%s)
  if timeout "$(budget 60 60 0)" "${checks[@]}" "$py" "$repo/tests/cuda/checks.py" --sanitizer-case \
       >"$work/sanitizer_dry.log" 2>&1; then
    line "sanitizer: SKIP (dry run: the sanitizer case ran on the CPU, $(($(date +%s) - t)) s)"
  else
    line "sanitizer: FAIL (the sanitizer case failed on the CPU; sanitizer_dry.log)"
  fi
elif command -v compute-sanitizer >/dev/null; then
  filter=()
  compute-sanitizer --help 2>&1 | grep -q -- "--kernel-name" && filter=(--kernel-name kns=cpattn)
  reserve=75
  for tool in memcheck racecheck synccheck; do
    t=$(date +%s)
    reserve=$((reserve - 15))
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(budget 30 15 "$reserve")" compute-sanitizer --tool "$tool" \
      "${filter[@]}" --error-exitcode 99 "$py" "$repo/tests/cuda/checks.py" --sanitizer-case \
      >"$work/sanitizer_$tool.log" 2>&1
    rc=$?
    verdict=FAIL
    ((rc == 0)) && verdict=PASS
    line "sanitizer $tool: $verdict ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
      "$work/sanitizer_$tool.log" | tail -1 | sed 's/^=* *//'); rc $rc, $(($(date +%s) - t)) s)"
  done
else
  line "sanitizer: SKIP (compute-sanitizer not found)"
fi

# ---- TFLOP/s vs torch SDPA ---------------------------------------------------------------------
t=$(date +%s)
b=$(budget 120 30 0)
bench=(--budget "$b")
((dry)) && bench=(--dry-run)
timeout "$((b + 30))" "$py" "$repo/bench/gpu_bench.py" --out "$work" "${bench[@]}" \
  >"$work/bench.log" 2>&1
rc=$?
cp "$work/gpu_bench.md" "$res/gpu_bench.md" 2>/dev/null
if ((rc == 0)) && [[ -f $res/gpu_bench.md ]]; then
  line "bench: PASS ($(grep -cE '^\| [0-9]' "$res/gpu_bench.md") rows in gpu_bench.md, $(($(date +%s) - t)) s)"
else
  line "bench: FAIL (rc $rc; bench.log in gpu_check.tar.gz)"
fi

line "total: $(($(date +%s) - t_start)) s"
tar -czf "$res/gpu_check.tar.gz" -C "$work" . && rm -rf "$work"
echo
cat "$res/gpu_bench.md" 2>/dev/null
# Exit status: 1 when any stage failed (the summary says which).
! grep -q ": FAIL" "$res/summary.txt"
