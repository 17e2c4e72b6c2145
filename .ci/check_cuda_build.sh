#!/usr/bin/env bash
# Checks that the CUDA flavour of cpattn configures, compiles, links and registers its CUDA
# kernels; needs nvcc but no GPU. Idempotent: the venv and the CMake build folder live under
# build/ci-cuda/ (git-ignored) and are reused, so a rerun is an incremental build.
#
# Environment (all optional):
#   CPATTN_CI_PYTHON        interpreter for the venv (default python3)
#   CPATTN_CI_TORCH         torch requirement (default torch==2.14.1, a CUDA 13 build)
#   CPATTN_CUDA_ARCH_LIST   architectures, TORCH_CUDA_ARCH_LIST syntax (default "8.0;9.0")
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$repo/build/ci-cuda
venv=$work/venv
archs=${CPATTN_CUDA_ARCH_LIST:-8.0;9.0}
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
step "build (CPATTN_CUDA=ON, archs $archs), log $work/build.log"
t0=$(date +%s)
if ! CPATTN_CUDA=ON CPATTN_CUDA_ARCH_LIST="$archs" "$py" -m pip install --no-build-isolation \
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
info = cpattn.build_info()
print("build_info:", info)
cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("cpattn::merge_state_", "CUDA")
print("CUDA kernel of cpattn::merge_state_ registered:", cuda_kernel)
assert info["with_cuda"] is True, "built without CUDA"
assert info["nccl_version"] > 0, "NCCL version not reported"
assert cuda_kernel, "no CUDA kernel registered"
EOF

so=$("$py" -c "import cpattn._C as m; print(m.__file__)")
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

# ptxas register / spill report: rerun the build's nvcc command for the .cu with -Xptxas=-v
"$py" - "$work/cmake" <<'EOF' || fail "ptxas -v compile"
import os, shlex, subprocess, sys
build = sys.argv[1]
ninja = os.path.join(os.path.dirname(sys.executable), "ninja")
for target in ["CMakeFiles/_C.dir/csrc/cuda/merge_state.cu.o"]:
    cmd = subprocess.run([ninja, "-C", build, "-t", "commands", target], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    args, out, it = [], None, iter(shlex.split(cmd))
    for a in it:
        if a in ("-MT", "-MF"):
            next(it)
        elif a == "-o":
            out = next(it)
            args += ["-o", os.path.join(build, "ptxas_check.o")]
        elif a != "-MD":
            args.append(a)
    r = subprocess.run(args + ["-Xptxas=-v"], cwd=build, capture_output=True, text=True)
    report = [l for l in (r.stdout + r.stderr).splitlines() if "ptxas" in l or "spill" in l]
    print("\n".join(report))
    sys.exit(r.returncode)
EOF
echo "check_cuda_build: OK"
