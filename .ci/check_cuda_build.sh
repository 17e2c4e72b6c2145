#!/usr/bin/env bash
# Checks that the CUDA flavour of cpattn configures, compiles, links and registers its CUDA
# kernels; needs nvcc but no GPU. Idempotent: the venv and the CMake build folder live under
# build/ci-cuda/ (git-ignored) and are reused, so a rerun is an incremental build.
#
# Environment (all optional):
#   CPATTN_CI_PYTHON        interpreter for the venv (default python3)
#   CPATTN_CI_TORCH         torch requirement (default torch==2.14.1, a CUDA 13 build)
#   CPATTN_CI_WORK          venv + build folder (default build/ci-cuda)
#   CPATTN_CUDA_ARCH_LIST   architectures, TORCH_CUDA_ARCH_LIST syntax (default "8.0;9.0")
#   CPATTN_CUDA_HEAD_DIMS   head dims of the attention kernels (default "64;128")
# CI runs it twice: as is (torch 2.14.1), and for the GPU machine's torch 2.11.0 at arch 9.0 and
# head dim 64 only (every torch-touching file compiles, links and registers against 2.11's API):
#   CPATTN_CI_TORCH=torch==2.11.0 CPATTN_CI_WORK=build/ci-cuda-2.11 CPATTN_CUDA_ARCH_LIST=9.0 \
#     CPATTN_CUDA_HEAD_DIMS=64 bash .ci/check_cuda_build.sh
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${CPATTN_CI_WORK:-$repo/build/ci-cuda}
[[ $work = /* ]] || work=$repo/$work
venv=$work/venv
archs=${CPATTN_CUDA_ARCH_LIST:-8.0;9.0}
head_dims=${CPATTN_CUDA_HEAD_DIMS:-64;128}
torch_req=${CPATTN_CI_TORCH:-torch==2.14.1}
mkdir -p "$work"

fail() { echo "check_cuda_build: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || fail "nvcc not found"

# 1. venv with a CUDA torch (brings the nvidia-* wheels: cuBLAS/cuSPARSE headers, NVRTC, NCCL)
step "venv $venv ($torch_req)"
[[ -x $venv/bin/python ]] || "${CPATTN_CI_PYTHON:-python3}" -m venv "$venv"
py=$venv/bin/python
"$py" -m pip install -q "$torch_req" numpy pytest scikit-build-core ninja cmake
"$py" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" \
  || fail "$torch_req is not a CUDA build of torch"

# 2. build and install, CUDA required
step "build (CPATTN_CUDA=ON, archs $archs, head dims $head_dims), log $work/build.log"
t0=$(date +%s)
# The ptxas report below reads the compiler's output: recompile every .cu (C++ stays incremental).
find "$work/cmake" -name '*.cu.o' -delete 2>/dev/null || true
if ! CPATTN_CUDA=ON CPATTN_CUDA_ARCH_LIST="$archs" CPATTN_CUDA_HEAD_DIMS="$head_dims" \
    CPATTN_CUDA_PTXAS_VERBOSE=ON "$py" -m pip install --no-build-isolation \
    --config-settings=build-dir="$work/cmake" -v "$repo" >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log" >&2
  fail "build failed (see $work/build.log)"
fi
echo "build time: $(( $(date +%s) - t0 )) s"

# 3. checks: import, registration, linkage, device code
cd "$work"  # import the installed package, not the source tree
step "import"
"$py" - <<'EOF' || fail "import / registration check"
import torch, cpattn
from cpattn.testing.emulation import load_ops
load_ops()  # the test-only library, built beside the shipped one
info = cpattn.build_info()
print("build_info:", info)
assert info["with_cuda"] is True, "built without CUDA"
assert info["nccl_version"] > 0, "NCCL version not reported"
for op in ("cpattn::merge_state_", "cpattn::attention_fwd", "cpattn::attention_bwd",
           "cpattn::ring_fwd", "cpattn::ring_bwd", "cpattn::gathered_fwd", "cpattn::gathered_bwd",
           "cpattn::merge_attention_states", "cpattn::merge_attention_states_bwd",
           "cpattn::cache_store_", "cpattn::cache_attention_fwd", "cpattn::prefill_fwd",
           "cpattn_testing::ring_fwd_emulated", "cpattn_testing::ring_bwd_emulated",
           "cpattn_testing::ring_shift", "cpattn_testing::ring_loopback_timing"):
    ok = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    print(f"CUDA kernel of {op} registered:", ok)
    assert ok, f"no CUDA kernel registered for {op}"
# No GPU here: the CPU path of the CUDA build still works, and nothing NCCL was created.
q = torch.randn(1, 8, 2, 64)
assert cpattn.attention(q, q, q).shape == q.shape
assert cpattn.destroy_communicators() == 0
EOF

# The ops and kernels live in libcpattn_ops.so, beside the module _C that loads it.
so=$("$py" -c "import os, cpattn._C as m; print(os.path.join(os.path.dirname(m.__file__), 'libcpattn_ops.so'))")
step "linkage of $so"
readelf -d "$so" | grep -E "RUNPATH|RPATH"
ldd "$so" | grep -E "not found" && fail "unresolved libraries"
for lib in libnccl.so.2 libtorch.so libc10_cuda.so libcudart.so; do
  ldd "$so" | grep -E "^\s*$lib" || fail "$lib is not linked"
done
ldd "$so" | grep -E "libnccl.so.2 => .*/nvidia/nccl/lib/" >/dev/null \
  || fail "libnccl does not resolve to the nvidia-nccl wheel"

step "device code"
cuobjdump=$(command -v cuobjdump || true)
if [[ -z $cuobjdump && -x /usr/local/cuda/bin/cuobjdump ]]; then
  cuobjdump=/usr/local/cuda/bin/cuobjdump
fi
if [[ -z $cuobjdump ]]; then  # not in every toolkit install; torch's triton ships one
  t=$("$py" -c 'import os, triton; print(os.path.dirname(triton.__file__))' 2>/dev/null || true)
  if [[ -x $t/backends/nvidia/bin/cuobjdump ]]; then cuobjdump=$t/backends/nvidia/bin/cuobjdump; fi
fi
if [[ -n $cuobjdump ]]; then
  elfs=$("$cuobjdump" --list-elf "$so" | awk '{print $NF}')
  echo "$elfs"
  "$cuobjdump" --list-ptx "$so" 2>&1 || true
  # exactly one SASS per .cu file and listed architecture, nothing else
  nfiles=$(sed -E 's/\.sm_[0-9a-z]+\.cubin$//' <<<"$elfs" | sort -u | wc -l)
  narchs=0
  for a in ${archs//;/ }; do
    sm=sm_${a%+PTX}; sm=${sm/./}; narchs=$((narchs + 1))
    [[ $(grep -c "\.$sm\.cubin$" <<<"$elfs") -eq $nfiles ]] || fail "missing or duplicate $sm SASS"
  done
  [[ $(wc -l <<<"$elfs") -eq $((nfiles * narchs)) ]] || fail "unexpected SASS architectures"
else
  echo "cuobjdump not found: SASS check skipped"
fi

# ptxas register / spill report of every kernel (the build ran with -Xptxas=-v). A spill in the
# forward kernels fails the check; the dK/dV kernel at head dim 128 spills a few loop counters
# outside its MMA sections (bench/RESULTS.md), which is reported.
step "ptxas registers and spills ($work/ptxas.txt)"
"$py" "$repo/.ci/ptxas_report.py" "$work/build.log" --out "$work/ptxas.txt" \
  --fail-on-spill attention_fwd_kernel attention_bwd_dq_kernel merge_state \
  || fail "ptxas report: missing, or spills in kernels that must not spill"
echo "check_cuda_build: OK"
