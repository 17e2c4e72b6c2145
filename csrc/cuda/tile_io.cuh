// Tile movement shared by the attention kernels: global (strided rows) -> shared (padded rows)
// with cp.async, and the ldmatrix addressing of the four operand roles.
#pragma once

#include <cstdint>

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

// ldmatrix addressing. A tile is passed as the 32-bit shared address of its element (0, 0)
// (smem_u32); each helper returns the address this lane gives ldmatrix_x4 (or _trans) so that the
// four registers come out as named (g = lane / 4, t = lane % 4). Only two lane patterns occur:
// lane bit 3 selects the row half and bit 4 the column half of the 16x16 block, or the reverse.
template <int kStride>
__device__ __forceinline__ int lane_rows_bit3(int lane) {
  return ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
}
template <int kStride>
__device__ __forceinline__ int lane_rows_bit4(int lane) {
  return ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
}
// A operand, row-major tile X[row][col]: the 16x16 block at (r0, c0) -> a0..a3.
template <int kStride>
__device__ __forceinline__ uint32_t a_addr(uint32_t tile, int r0, int c0, int lane) {
  return tile + 2 * (lane_rows_bit3<kStride>(lane) + r0 * kStride + c0);
}
// B operand for X^T where X[n][k] is row-major (B[k][n] = X[n][k], e.g. K in Q K^T):
// rows n0..n0+15 and cols k0..k0+15 of X -> {b0, b1} of the n8 tile at n0, {b0, b1} of the n8
// tile at n0 + 8 (registers 0..3), via ldmatrix without .trans.
template <int kStride>
__device__ __forceinline__ uint32_t bt_addr(uint32_t tile, int n0, int k0, int lane) {
  return tile + 2 * (lane_rows_bit4<kStride>(lane) + n0 * kStride + k0);
}
// B operand where X[k][n] is row-major (B = X, e.g. V in P V): rows k0..k0+15, cols n0..n0+15
// -> {b0, b1} of the n8 tile at n0, {b0, b1} of the n8 tile at n0 + 8, via ldmatrix .trans.
template <int kStride>
__device__ __forceinline__ uint32_t b_addr_trans(uint32_t tile, int k0, int n0, int lane) {
  return tile + 2 * (lane_rows_bit3<kStride>(lane) + k0 * kStride + n0);
}
// A operand from the transposed storage T[col][row] (A[row][col] = T[col][row], e.g. dS from the
// shared dS^T tile): the 16x16 block of A at (r0, c0) -> a0..a3, via ldmatrix .trans.
template <int kStride>
__device__ __forceinline__ uint32_t a_addr_trans(uint32_t tile_t, int r0, int c0, int lane) {
  return tile_t + 2 * (lane_rows_bit4<kStride>(lane) + c0 * kStride + r0);
}

// Accumulator (C layout, rows g / g + 8, cols 2t, 2t + 1 of each n8 tile) -> A operand of the
// next product, for the k16 step made of n8 tiles 2s and 2s + 1.
template <typename Elem>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack2<Elem>(c0[0], c0[1]);
  a[1] = pack2<Elem>(c0[2], c0[3]);
  a[2] = pack2<Elem>(c1[0], c1[1]);
  a[3] = pack2<Elem>(c1[2], c1[3]);
}

}  // namespace cpattn::cuda
