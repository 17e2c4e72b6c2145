// Tile movement shared by the attention kernels: global (strided rows) -> shared (padded rows)
// with cp.async, and the ldmatrix addressing of the four operand roles.
#pragma once

#include <cstdint>

#include "cuda/fragments.h"
#include "cuda/ptx.cuh"

namespace cpattn::cuda {

// Issues the cp.async copies of rows [0, kRows) x cols [0, kCols) of a global tile whose rows are
// row_stride elements apart into a shared tile with rows kStride apart. Rows >= valid_rows are
// zero-filled (valid_rows >= 1: row 0 is a readable dummy source). Offsets inside the tile are
// 32-bit: the op layer guarantees kRows * row_stride < 2^31 (fewer registers than 64-bit ones).
template <int kRows, int kCols, int kStride, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(Elem* smem, const Elem* gmem, int64_t row_stride64,
                                                int valid_rows, int tid) {
  const int row_stride = static_cast<int>(row_stride64);
  constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = tid + i * kThreads;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = r < valid_rows;
      cp_async_16(smem + r * kStride + col, valid ? gmem + r * row_stride + col : gmem, valid);
    }
  }
}

// Copies n fp32 values (n a multiple of 4, 16-byte aligned) global -> shared.
template <int kN, int kThreads>
__device__ __forceinline__ void load_floats_async(float* smem, const float* gmem, int tid) {
  constexpr int kChunks = kN / 4;
  for (int c = tid; c < kChunks; c += kThreads) cp_async_16(smem + 4 * c, gmem + 4 * c, true);
}

// ldmatrix addressing (fragments.h) as 32-bit shared addresses: a tile is passed as the shared
// address of its element (0, 0) (smem_u32).
template <int kStride>
__device__ __forceinline__ uint32_t a_addr(uint32_t tile, int r0, int c0, int lane) {
  return tile + 2 * a_offset<kStride>(r0, c0, lane);
}
template <int kStride>
__device__ __forceinline__ uint32_t bt_addr(uint32_t tile, int n0, int k0, int lane) {
  return tile + 2 * bt_offset<kStride>(n0, k0, lane);
}
template <int kStride>
__device__ __forceinline__ uint32_t b_addr_trans(uint32_t tile, int k0, int n0, int lane) {
  return tile + 2 * b_trans_offset<kStride>(k0, n0, lane);
}
template <int kStride>
__device__ __forceinline__ uint32_t a_addr_trans(uint32_t tile_t, int r0, int c0, int lane) {
  return tile_t + 2 * a_trans_offset<kStride>(r0, c0, lane);
}

// Accumulator (C layout, rows g / g + 8, cols 2t, 2t + 1 of each n8 tile) -> A operand of the
// next product, for the k16 step made of n8 tiles 2s (c0) and 2s + 1 (c1); see kCToATile.
template <typename Elem>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  static_assert(kCToATile[0] == 0 && kCToATile[1] == 0 && kCToATile[2] == 1 && kCToATile[3] == 1 &&
                    kCToAElem[0] == 0 && kCToAElem[1] == 2 && kCToAElem[2] == 0 &&
                    kCToAElem[3] == 2,
                "c_to_a follows fragments.h");
  a[0] = pack2<Elem>(c0[0], c0[1]);
  a[1] = pack2<Elem>(c0[2], c0[3]);
  a[2] = pack2<Elem>(c1[0], c1[1]);
  a[3] = pack2<Elem>(c1[2], c1[3]);
}

// acc = A B^T for one warp: A is the 16 rows from a_row0 of a shared tile, B^T the first
// 8 * kNTiles rows of another (both row-major, kKSteps * 16 columns, row stride kStride); acc is
// kNTiles n8 accumulator tiles (C layout), overwritten. The backward's S^T = K Q^T and
// dP^T = V dO^T.
template <typename Elem, int kKSteps, int kNTiles, int kStride>
__device__ __forceinline__ void mma_a_bt(float (&acc)[kNTiles][4], uint32_t a_tile, int a_row0,
                                         uint32_t b_tile, int lane) {
  static_assert(kNTiles % 2 == 0, "n8 tiles come in pairs (one ldmatrix_x4)");
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, a_addr<kStride>(a_tile, a_row0, ks * 16, lane));
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, bt_addr<kStride>(b_tile, np * 16, ks * 16, lane));
      mma_16816<Elem>(acc[2 * np], a, b[0], b[1]);
      mma_16816<Elem>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

}  // namespace cpattn::cuda
