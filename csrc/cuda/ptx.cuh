// The few sm80+ instructions the attention kernels are built from, as inline PTX:
//   cp.async (16-byte global -> shared copies, zero fill past a sequence end),
//   ldmatrix (8x8 b16 matrices from shared memory into mma fragments, optionally transposed),
//   mma.sync.m16n8k16 (bf16 / fp16 inputs, fp32 accumulators), ex2.approx.
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A (16x16, row major), 4 registers of 2 elements: a0 (row g, cols 2t, 2t+1), a1 (row g+8,
//     cols 2t, 2t+1), a2 (row g, cols 2t+8, 2t+9), a3 (row g+8, cols 2t+8, 2t+9).
//   B (16x8), 2 registers: b0 (rows 2t, 2t+1 of column g), b1 (rows 2t+8, 2t+9 of column g).
//   C/D (16x8 fp32), 4 registers: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1).
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of matrix i; register i of lane l receives
// matrix i's elements (row l/4, cols 2(l%4), 2(l%4)+1); with .trans, (rows 2(l%4), 2(l%4)+1 of
// column l/4). The lower-indexed element sits in the low 16 bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef CPATTN_CUDA_EMULATE
// Host emulation for the tests (tests/emulate/cuda_emulation.h): the same kernels run on the CPU,
// one fiber per thread, with these instructions simulated from the PTX ISA's definitions.
#include "cuda_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace cpattn::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; when !valid the destination is zero-filled and src is
// not read (it must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem_dst)),
               "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// smem_row: this lane's row address in the shared window (see smem_u32).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row));
}

// d += a * b for one m16n8k16 tile of Elem (bf16 or fp16) inputs; the instruction differs only
// in the input type's name.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  static_assert(std::is_same_v<Elem, __nv_bfloat16> || std::is_same_v<Elem, __half>);
#define CPATTN_MMA_16816(T)                                                             \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T                         \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>)
    CPATTN_MMA_16816("bf16");
  else
    CPATTN_MMA_16816("f16");
#undef CPATTN_MMA_16816
}

// 2^x; 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace cpattn::cuda
#endif  // CPATTN_CUDA_EMULATE

namespace cpattn::cuda {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The element types the kernels read and write, one row each: conversion of one value to fp32,
// and of two fp32 values to the type's pair (round to nearest, the lower one first in memory
// and in the low half of a register).
template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<float> {
  using Pair = float2;
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ Pair pair(float a, float b) { return make_float2(a, b); }
};
template <>
struct ElemTraits<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ Pair pair(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};
template <>
struct ElemTraits<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ Pair pair(float a, float b) { return __floats2half2_rn(a, b); }
};

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return ElemTraits<T>::to_float(x);
}
// Two floats -> dst[0], dst[1] in T.
template <typename T>
__device__ __forceinline__ void store2(T* dst, float a, float b) {
  *reinterpret_cast<typename ElemTraits<T>::Pair*>(dst) = ElemTraits<T>::pair(a, b);
}
// Two floats -> one register of two 16-bit elements (lo in the low half).
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(sizeof(typename ElemTraits<Elem>::Pair) == 4, "a pair of 16-bit elements");
  const typename ElemTraits<Elem>::Pair v = ElemTraits<Elem>::pair(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);  // a register move after compilation
  return r;
}

}  // namespace cpattn::cuda
