// torch's oneDNN brgemm behind the plain interface of onednn_gemm.h. Compiled without per-ISA
// flags (CMakeLists.txt): this file alone includes ATen's BLAS header.
#include "cpu/onednn_gemm.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace cpattn::cpu::onednn {
namespace {

namespace blas = at::native::cpublas;

std::atomic<int64_t> amx_task_count{0};

// A small product against the exact result (small integers, exact in fp32), inside a try: the
// bf16 call throws where oneDNN has no kernel for this CPU (neither AMX nor AVX512-BF16).
template <typename T>
bool probe() {
  constexpr int64_t M = 16, N = 16, K = 32;
  std::vector<T> a(M * K), b(K * N);
  std::vector<float> c(M * N, -1.f);
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<T>(static_cast<float>(i % 7 - 3));
  for (int64_t i = 0; i < K * N; ++i) b[i] = static_cast<T>(static_cast<float>(i % 5 - 2));
  constexpr bool pairs = std::is_same_v<T, c10::BFloat16>;
  try {
    blas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), pairs);
    blas::brgemm_release(true);
  } catch (...) {
    return false;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float want = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t at = pairs ? (k / 2) * 2 * N + 2 * n + k % 2 : k * N + n;
        want += static_cast<float>(a[m * K + k]) * static_cast<float>(b[at]);
      }
      if (c[m * N + n] != want) return false;
    }
  return true;
}

// XINUSE bit 18: the AMX tile data is in use (not in its initial state) on this thread.
bool tiles_in_use() {
#if defined(__x86_64__)
  static const bool readable = [] {  // XGETBV with ECX = 1: CPUID.(0xD, 1):EAX[2]
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(0xD, 1, &a, &b, &c, &d) && (a & (1u << 2));
  }();
  if (!readable) return false;
  unsigned lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  return lo & (1u << 18);
#else
  return false;
#endif
}

}  // namespace

void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, float* C, int64_t ldc, bool add_c) {
  blas::brgemm(M, N, K, lda, ldb, ldc, add_c, A, B, C, /*is_vnni=*/false);
}

void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, float* C, int64_t ldc, bool add_c) {
  blas::brgemm(M, N, K, lda, ldb, ldc, add_c, reinterpret_cast<const c10::BFloat16*>(A),
               reinterpret_cast<const c10::BFloat16*>(B), C, /*is_vnni=*/true);
}

bool mkldnn_enabled() { return at::globalContext().userEnabledMkldnn(); }

bool runs_f32() {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  if (!mkldnn_enabled()) return false;  // torch would take MKL's sgemm per call instead
  static const bool ok = probe<float>();
  return ok;
#else
  return false;
#endif
}

bool runs_bf16() {
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  if (!mkldnn_enabled()) return false;  // torch's bf16 call throws then
  static const bool ok = probe<c10::BFloat16>();
  return ok;
#else
  return false;
#endif
}

bool amx_usable() { return runs_bf16() && blas::could_pack(at::kBFloat16); }

bool amx_on_cpu() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;  // CPUID.(7, 0):EDX[22] AMX-BF16, [24] AMX-TILE
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24));
#else
  return false;
#endif
}

int64_t amx_tasks() { return amx_task_count.load(); }

TaskGuard::TaskGuard() { blas::brgemm_release(true); }

TaskGuard::~TaskGuard() {
  if (tiles_in_use()) amx_task_count.fetch_add(1, std::memory_order_relaxed);
  blas::brgemm_release(true);
}

}  // namespace cpattn::cpu::onednn
