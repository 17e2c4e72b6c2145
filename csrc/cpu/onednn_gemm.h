// The products of the "brgemm" kernel path (attention_kernel_brgemm.h) through torch's export of
// oneDNN's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm, ATen/native/CPUBlas.h):
// the same call runs on AMX tiles where the CPU has them, on AVX512-BF16 dot products otherwise
// (bf16), and on AVX-512 / AVX2 FMAs (fp32). Defined in onednn_gemm.cpp, the one file that sees
// ATen's BLAS header, compiled without per-ISA flags (so that no ATen inline function is built
// with instructions the CPU may lack); the kernels_<isa>.cpp files only call these.
#pragma once

#include <cstdint>

namespace cpattn::cpu::onednn {

// C[M x N] (+ C when add_c) = A[M x K] B[K x N], fp32 accumulation. A row-major, element (m, k)
// at A[m * lda + k]; C row-major by ldc. fp32: B row-major, (k, n) at B[k * ldb + n]. bf16: B in
// pairs along K (VNNI), (k, n) at B[(k / 2) * 2 ldb + 2 n + k % 2], K even. Leading dimensions
// in elements. Each distinct (M, N, K, lda, ldb, ldc, add_c) is one generated kernel per thread,
// cached for the process: callers keep the set of shapes small.
void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, float* C, int64_t ldc, bool add_c);
void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, float* C, int64_t ldc, bool add_c);

// Whether the products of this operand type run here (the build's torch exports them, mkldnn is
// enabled, and a small product on this CPU gave the exact result without throwing: bf16 throws
// on CPUs with neither AMX nor AVX512-BF16). The probe runs once per process and type; the
// torch.backends.mkldnn.enabled switch is read on every call.
bool runs_f32();
// torch.backends.mkldnn.enabled: without it torch's brgemm takes MKL per call (fp32) or throws
// (bf16).
bool mkldnn_enabled();
bool runs_bf16();
// Whether the bf16 products run on AMX tiles (torch's could_pack: oneDNN reaches AMX here).
bool amx_usable();
// Whether the CPU has AMX-BF16 tiles (cpuid). A CPU with them where amx_usable() is false lacks
// the kernel's XTILEDATA grant, or has mkldnn off.
bool amx_on_cpu();
// Parallel tasks of the path that used the AMX tiles (TaskGuard), since the process started.
int64_t amx_tasks();

// Held by every parallel task of the path: releases the tile state (AMX configuration) when the
// task starts and when it ends, so no thread keeps tiles configured beyond its task; on the way
// out it counts the task as an AMX task when the tiles were in use (XINUSE), for the tests.
class TaskGuard {
 public:
  TaskGuard();
  ~TaskGuard();
  TaskGuard(const TaskGuard&) = delete;
  TaskGuard& operator=(const TaskGuard&) = delete;
};

}  // namespace cpattn::cpu::onednn
