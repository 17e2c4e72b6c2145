// The tile vocabulary of the attention kernels (forward and backward use it alike): global
// (strided rows) -> shared (padded rows) with cp.async, the two-stage K/V pipeline, shared
// addresses for ldmatrix, the k16 step of the warp's MMAs, and accumulator rows -> global.
#pragma once

#include <cstdint>

#include "cpattn/params.h"
#include "cuda/fragments.h"
#include "cuda/ptx.cuh"

namespace cpattn::cuda {

// The kernel's dynamic shared memory (LaunchShape::smem_bytes), as 16-bit elements.
template <typename Elem>
__device__ __forceinline__ Elem* shared_tiles() {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return reinterpret_cast<Elem*>(smem_raw);
}

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

// Issues the cp.async copies of rows [row0, row0 + kRows) of head `head`, batch b of a
// (B, S, H, D) operand x with seqlen rows (strides st) into a shared tile of Cfg's head dim and
// row stride; rows past seqlen are zero-filled.
template <int kRows, typename Cfg, typename Elem>
__device__ __forceinline__ void load_rows_async(Elem* smem, const void* x, const BshdStrides& st,
                                                int b, int head, int row0, int seqlen, int tid) {
  load_tile_async<kRows, Cfg::kHeadDim, Cfg::kStride, Cfg::kThreads>(
      smem,
      static_cast<const Elem*>(x) + b * st.batch + head * st.head +
          static_cast<int64_t>(row0) * st.seq,
      st.seq, seqlen - row0, tid);
}

// The K and V tiles of key block n_block (Cfg::kBlockN keys) of kv head hk, batch b -> sK, sV.
template <typename Cfg, typename Elem, typename Params>
__device__ __forceinline__ void load_kv_async(const Params& p, int b, int hk, int n_block, Elem* sK,
                                              Elem* sV, int tid) {
  const int n0 = n_block * Cfg::kBlockN;
  load_rows_async<Cfg::kBlockN, Cfg>(sK, p.k, p.k_strides, b, hk, n0, p.shape.seqlen_k, tid);
  load_rows_async<Cfg::kBlockN, Cfg>(sV, p.v, p.v_strides, b, hk, n0, p.shape.seqlen_k, tid);
}

// The K/V pipeline of the kernels that walk key blocks for one block of query rows (forward,
// deterministic dQ): the key blocks from `first` of kv head hk, batch b, double-buffered in two
// shared stages (a stage: the K tile, then the V tile; stage 1 kStageElems after stage 0).
template <typename Cfg, typename Elem>
struct KvStages {
  Elem* stage0;
  int b, hk, first;

  // Issues the copies of the i-th key block into stage i & 1 and commits them (with every copy
  // issued before, as one group).
  template <typename Params>
  __device__ __forceinline__ void load(const Params& p, int i, int tid) const {
    Elem* const sK = stage0 + (i & 1) * Cfg::kStageElems;
    load_kv_async<Cfg>(p, b, hk, first + i, sK, sK + Cfg::kKVElems, tid);
    cp_async_commit();
  }
  // Waits until the i-th key block has landed and every warp is done with the other stage;
  // returns the shared address of its K tile (V's is 2 * kKVElems bytes further).
  __device__ __forceinline__ uint32_t wait(int i) const {
    cp_async_wait<0>();
    __syncthreads();
    return smem_u32(stage0) + (i & 1) * (2 * Cfg::kStageElems);
  }
};

// Stores, times scale, this thread's part of row g + 8 * half of an accumulator of kTiles n8
// tiles (C layout: columns 2t, 2t + 1 of each) into the row starting at dst.
template <int kTiles, typename T>
__device__ __forceinline__ void store_acc_row(T* dst, const float (&acc)[kTiles][4], int half,
                                              float scale, int t) {
#pragma unroll
  for (int dt = 0; dt < kTiles; ++dt)
    store2(dst + dt * 8 + 2 * t, acc[dt][2 * half] * scale, acc[dt][2 * half + 1] * scale);
}

// store_acc_row's accumulate form: adds the same values into the fp32 row at dst, only into its
// columns below `cols` (the accumulator's real head dim, minus the slice start; may be <= 0).
// Element-wise: an accumulator row need not be 8-byte aligned (an odd head dim or stride).
template <int kTiles>
__device__ __forceinline__ void add_acc_row(float* dst, const float (&acc)[kTiles][4], int half,
                                            float scale, int t, int cols) {
#pragma unroll
  for (int dt = 0; dt < kTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = dt * 8 + 2 * t + e;
      if (c < cols) dst[c] += acc[dt][2 * half + e] * scale;
    }
}

// The shared address of element `offset` (fragments.h's lane offsets) of the 16-bit tile at
// shared address `tile` (smem_u32): the row address an ldmatrix lane passes.
__device__ __forceinline__ uint32_t elem_addr(uint32_t tile, int offset) {
  return tile + 2 * offset;
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

// One k16 step of a warp's products: acc[mt] += a[mt] B for its kMTiles m16 tiles (a: A
// fragments, acc: kNTiles n8 accumulator tiles each, C layout). B comes in pairs of n8 tiles,
// load_b(np, b) loading pair np with one ldmatrix_x4 (tile 2np in b[0], b[1], tile 2np + 1 in
// b[2], b[3]) that every m16 tile uses. A single m16 tile passes &acc and &a.
template <typename Elem, int kMTiles, int kNTiles, typename LoadB>
__device__ __forceinline__ void mma_k16(float (*acc)[kNTiles][4], const uint32_t (*a)[4],
                                        LoadB&& load_b) {
  static_assert(kNTiles % 2 == 0, "n8 tiles come in pairs (one ldmatrix_x4)");
#pragma unroll
  for (int np = 0; np < kNTiles / 2; ++np) {
    uint32_t b[4];
    load_b(np, b);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      mma_16816<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
      mma_16816<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
    }
  }
}

// acc = A B^T for one warp: A is the 16 rows from a_row0 of a shared tile, B^T the first
// 8 * kNTiles rows of another (both row-major, kKSteps * 16 columns, row stride kStride); acc is
// kNTiles n8 accumulator tiles (C layout), overwritten. The backward's S^T = K Q^T and
// dP^T = V dO^T.
template <typename Elem, int kKSteps, int kNTiles, int kStride>
__device__ __forceinline__ void mma_a_bt(float (&acc)[kNTiles][4], uint32_t a_tile, int a_row0,
                                         uint32_t b_tile, int lane) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    ldmatrix_x4(a, elem_addr(a_tile, a_offset<kStride>(a_row0, ks * 16, lane)));
    mma_k16<Elem, 1>(&acc, &a, [&](int np, uint32_t(&b)[4]) {
      ldmatrix_x4(b, elem_addr(b_tile, bt_offset<kStride>(np * 16, ks * 16, lane)));
    });
  }
}

}  // namespace cpattn::cuda
