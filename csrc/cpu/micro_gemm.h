// A small fp32 GEMM built on one register-blocked micro-kernel:
//   C[M x N] (+)= A[M x K] * B[K x N]
// A is read by broadcasting single elements at A[m * a_row + k * a_col] (so A can be read
// transposed for free); B row k is the contiguous run B[k * ldb .. + N]; N is a multiple of 16.
// Every product of the attention kernels (S^T = K Q^T, O += P V, dV += P^T dO, dP^T = V dO^T,
// dK += dS^T Q, dQ += dS K) is one call.
#pragma once

#include <array>
#include <utility>

#include "cpu/vec.h"

#ifndef CPATTN_MR
#error "kernels_<isa>.cpp defines CPATTN_MR (rows per micro-tile) and CPATTN_NV (vectors per row)"
#endif

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

// MR rows x NV 16-lane vectors of C, held as MR x NW registers of this ISA's native width.
template <int MR, int NV>
inline void micro_kernel(int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                         int64_t ldb, float* C, int64_t ldc, bool accumulate,
                         const float* c_row_scale) {
  constexpr int NW = NV * (kLanes / kNativeLanes);
  vnative acc[MR][NW];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const vnative f = broadcast_native(c_row_scale ? c_row_scale[m] : 1.f);
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w)
      acc[m][w] = accumulate ? load_native(C + m * ldc + w * kNativeLanes) * f : vnative{};
  }
  for (int64_t k = 0; k < K; ++k) {
    vnative b[NW];
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w) b[w] = load_native(B + k * ldb + w * kNativeLanes);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vnative a = broadcast_native(A[m * a_row + k * a_col]);
#pragma GCC unroll 8
      for (int w = 0; w < NW; ++w) acc[m][w] += a * b[w];
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int w = 0; w < NW; ++w) store_native(C + m * ldc + w * kNativeLanes, acc[m][w]);
}

using MicroKernelFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t,
                               float*, int64_t, bool, const float*);

// Table of micro-kernels for every tail shape: [rows - 1][vectors - 1].
template <int... Ms>
struct MicroKernelTable {
  template <int M, int... Vs>
  static constexpr auto row(std::integer_sequence<int, Vs...>) {
    return std::array<MicroKernelFn, sizeof...(Vs)>{&micro_kernel<M, Vs + 1>...};
  }
  static constexpr std::array<std::array<MicroKernelFn, CPATTN_NV>, sizeof...(Ms)> table{
      row<Ms + 1>(std::make_integer_sequence<int, CPATTN_NV>{})...};
};
template <int... Ms>
constexpr auto make_table(std::integer_sequence<int, Ms...>) {
  return MicroKernelTable<Ms...>::table;
}
inline constexpr auto kMicroKernels = make_table(std::make_integer_sequence<int, CPATTN_MR>{});

// With c_row_scale, an accumulated C row m is first multiplied by c_row_scale[m] (the online
// softmax's rescale of O, fused into the load of C).
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t a_row, int64_t a_col,
                 const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate,
                 const float* c_row_scale = nullptr) {
  constexpr int64_t kTileN = CPATTN_NV * kLanes;
  for (int64_t n0 = 0; n0 < N; n0 += kTileN) {
    const int64_t nv = (N - n0 >= kTileN) ? CPATTN_NV : (N - n0) / kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += CPATTN_MR) {
      const int64_t mr = (M - m0 >= CPATTN_MR) ? CPATTN_MR : M - m0;
      kMicroKernels[mr - 1][nv - 1](K, A + m0 * a_row, a_row, a_col, B + n0, ldb, C + m0 * ldc + n0,
                                    ldc, accumulate, c_row_scale ? c_row_scale + m0 : nullptr);
    }
  }
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
