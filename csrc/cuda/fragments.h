// Lane addressing of ldmatrix for the mma.m16n8k16 operand roles, as element offsets into a
// row-major shared tile with rows kStride elements apart. Host and device: the host test
// (tests/cpp/test_fragments.cpp) replays ldmatrix and mma from the PTX ISA's fragment tables on
// these same offsets. tile_io.cuh turns them into shared addresses.
//
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i of lane l gets
// matrix i's (row l/4, cols 2(l%4), 2(l%4)+1), or with .trans its (rows 2(l%4), 2(l%4)+1 of
// column l/4). Two lane patterns occur: lane bit 3 selects the row half and bit 4 the column half
// of the 16x16 block, or the reverse.
#pragma once

#include "cpattn/config.h"

namespace cpattn::cuda {

template <int kStride>
CPATTN_HOST_DEVICE int lane_rows_bit3(int lane) {
  return ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
}
template <int kStride>
CPATTN_HOST_DEVICE int lane_rows_bit4(int lane) {
  return ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
}

// A operand, row-major tile X[row][col]: the 16x16 block at (r0, c0) -> a0..a3 (ldmatrix).
template <int kStride>
CPATTN_HOST_DEVICE int a_offset(int r0, int c0, int lane) {
  return lane_rows_bit3<kStride>(lane) + r0 * kStride + c0;
}
// B operand for X^T where X[n][k] is row-major (B[k][n] = X[n][k], e.g. K in Q K^T): rows
// n0..n0+15 and cols k0..k0+15 of X -> {b0, b1} of the n8 tile at n0 in registers 0, 1 and of the
// n8 tile at n0 + 8 in registers 2, 3 (ldmatrix).
template <int kStride>
CPATTN_HOST_DEVICE int bt_offset(int n0, int k0, int lane) {
  return lane_rows_bit4<kStride>(lane) + n0 * kStride + k0;
}
// B operand where X[k][n] is row-major (B = X, e.g. V in P V): rows k0..k0+15 and cols
// n0..n0+15 -> {b0, b1} of the n8 tile at n0 in registers 0, 1 and of the n8 tile at n0 + 8 in
// registers 2, 3 (ldmatrix .trans).
template <int kStride>
CPATTN_HOST_DEVICE int b_trans_offset(int k0, int n0, int lane) {
  return lane_rows_bit3<kStride>(lane) + k0 * kStride + n0;
}
// A operand from the transposed storage T[col][row] (A[row][col] = T[col][row], e.g. dS from the
// shared dS^T tile): the 16x16 block of A at (r0, c0) -> a0..a3 (ldmatrix .trans).
template <int kStride>
CPATTN_HOST_DEVICE int a_trans_offset(int r0, int c0, int lane) {
  return lane_rows_bit4<kStride>(lane) + c0 * kStride + r0;
}

// Accumulator (C layout) -> A operand of the next product: the A fragment of the k16 step made of
// n8 tiles 2s and 2s + 1 holds, in register i, elements kCToAElem[i] and kCToAElem[i] + 1 of
// C tile 2s + kCToATile[i] (rows g / g + 8 and cols 2t, 2t + 1 line up in both layouts).
constexpr int kCToATile[4] = {0, 0, 1, 1};
constexpr int kCToAElem[4] = {0, 2, 0, 2};

}  // namespace cpattn::cuda
