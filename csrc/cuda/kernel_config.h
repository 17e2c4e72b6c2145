// Tile shapes of the CUDA attention kernels per head dim. Shared-memory tiles are row-major with
// rows padded by 8 elements (16 bytes), so that the 8 row addresses of an ldmatrix fall in 8
// different 16-byte bank groups (no bank conflicts, no swizzle arithmetic).
#pragma once

#include <cstdint>

#include "cuda/params.h"

namespace cpattn::cuda {

// Forward (and the tile vocabulary of the deterministic dQ pass): one thread block per
// (query block, head, batch); kWarps warps split the kBlockM query rows (kMTiles m16 tiles each);
// K/V tiles of kBlockN keys go through two cp.async stages. kQInRegs keeps the Q fragments in
// registers for the whole block (Q's shared tile is then reused as the second K/V stage).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, bool kQInRegs_>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMTiles = kBlockM / (16 * kWarps);  // m16 tiles per warp
  static constexpr int kStride = kHeadDim + 8;             // shared row stride, elements
  static constexpr int kKSteps = kHeadDim / 16;            // k16 steps of Q K^T
  static constexpr int kSTiles = kBlockN / 8;              // n8 tiles of a score row block
  static constexpr int kOTiles = kHeadDim / 8;             // n8 tiles of an output row block
  static constexpr int kPSteps = kBlockN / 16;             // k16 steps of P V
  static constexpr int kQElems = kBlockM * kStride;
  static constexpr int kKVElems = kBlockN * kStride;  // one K or V tile
  static constexpr int kStageElems = 2 * kKVElems;    // K and V
  static constexpr int kSmemElems =
      kQInRegs ? kStageElems + (kQElems > kStageElems ? kQElems : kStageElems)
               : kQElems + 2 * kStageElems;
  static constexpr int kSmemBytes = kSmemElems * 2;
  static_assert(kMTiles >= 1 && kBlockM == 16 * kWarps * kMTiles, "kBlockM = 16 * warps * m");
  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "head dim and kBlockN: multiples of 16");
};

template <int kHeadDim>
struct FwdConfigFor;
template <>
struct FwdConfigFor<32> : FwdConfig<32, 128, 64, 4, true> {};
template <>
struct FwdConfigFor<64> : FwdConfig<64, 128, 64, 4, true> {};
template <>
struct FwdConfigFor<96> : FwdConfig<96, 128, 64, 8, true> {};
template <>
struct FwdConfigFor<128> : FwdConfig<128, 128, 64, 8, true> {};
template <>
struct FwdConfigFor<160> : FwdConfig<160, 128, 32, 8, true> {};
template <>
struct FwdConfigFor<192> : FwdConfig<192, 128, 32, 8, true> {};
template <>
struct FwdConfigFor<256> : FwdConfig<256, 128, 32, 8, false> {};

// Backward, dK/dV pass: one thread block per (key block, kv head, batch); each of the kWarps
// warps owns 16 keys (kBlockN = 16 * kWarps) and keeps their dK and dV rows in registers while
// the block walks the query tiles (kBlockM rows, two cp.async stages) of every query head of its
// kv head. dQ, when accumulated here, goes through a shared dS tile and fp32 atomics.
// kSplit > 1 splits the head dim of dK, dV (and of dQ's columns) over kSplit thread blocks per
// key block, which all recompute S and dP over the full head dim: dK and dV of 16 keys x 256
// columns would not fit in registers.
// The forward's scored instantiation (fwd_kernel.cuh, kScored): the same tiles with Q read from
// shared memory, since its per-score options need the registers Q's fragments would hold (no
// spills: the ptxas report).
template <typename Cfg>
using ScoredFwdConfig =
    FwdConfig<Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kWarps, /*kQInRegs=*/false>;

template <int kHeadDim_, int kBlockM_, int kWarps_, int kSplit_ = 1>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kSplit = kSplit_;
  static constexpr int kSliceDim = kHeadDim / kSplit;  // dK / dV / dQ columns per thread block
  static constexpr int kBlockN = 16 * kWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kDSStride = kBlockM + 8;  // shared dS^T tile [key][query]
  static constexpr int kKSteps = kHeadDim / 16;  // k16 steps over the head dim
  static constexpr int kQTiles = kBlockM / 8;    // n8 tiles of S^T (columns: queries)
  static constexpr int kMSteps = kBlockM / 16;   // k16 steps over queries (dV, dK)
  static constexpr int kDTiles = kSliceDim / 8;  // n8 tiles of this block's dK / dV rows
  static constexpr int kDqCols = 32;             // dQ work unit: 16 query rows x 32 columns
  static constexpr int kDqUnits = (kBlockM / 16) * (kSliceDim / kDqCols);
  static constexpr int kKVElems = kBlockN * kStride;
  static constexpr int kQElems = kBlockM * kStride;
  static constexpr int kDSElems = kBlockN * kDSStride;
  // K, V, then two stages of (Q, dO), then dS^T, then two stages of (lse_log2, delta) in fp32.
  static constexpr int kSmemBytes =
      2 * (2 * kKVElems + 4 * kQElems + kDSElems) + 2 * 2 * kBlockM * 4;
  static_assert(kHeadDim % 32 == 0, "backward head dims: multiples of 32");
  static_assert(kSliceDim % 32 == 0, "kSplit must leave slices of multiples of 32 columns");
  static_assert(kBlockM % 16 == 0 && kBlockM >= 16, "kBlockM: a multiple of 16");
};

template <int kHeadDim>
struct BwdConfigFor;
template <>
struct BwdConfigFor<32> : BwdConfig<32, 64, 8> {};
template <>
struct BwdConfigFor<64> : BwdConfig<64, 64, 8> {};
template <>
struct BwdConfigFor<96> : BwdConfig<96, 32, 4> {};
template <>
struct BwdConfigFor<128> : BwdConfig<128, 32, 4> {};
template <>
struct BwdConfigFor<160> : BwdConfig<160, 16, 4> {};
template <>
struct BwdConfigFor<192> : BwdConfig<192, 16, 4> {};
template <>
struct BwdConfigFor<256> : BwdConfig<256, 32, 4, 2> {};

// Backward, deterministic dQ pass: the forward's shape (warps split the query rows, one m16 tile
// each) with its key tile, 64 query rows, Q and dO fragments read from shared memory, dQ rows in
// registers.
template <int kHeadDim>
struct DqConfigFor : FwdConfig<kHeadDim, 64, FwdConfigFor<kHeadDim>::kBlockN, 4, false> {};

// Decode (decode_kernel.cuh): one thread block per (key split, kv head and query row group,
// batch). Each of the kWarps warps takes 32 keys of a kBlockN-key tile, one key per lane, and
// keeps its own online-softmax state for the block's kRows query rows (the G query heads of the
// kv head times Sq rows, which share every K/V load); each lane also holds kCols output columns.
// K and V tiles go through shared memory (coalesced cp.async); Q sits there in fp32.
template <int kHeadDim_>
struct DecodeConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 32 * kWarps;
  static constexpr int kRows = kHeadDim <= 128 ? 16 : 8;  // accumulators: kRows * kCols per lane
  static constexpr int kCols = kHeadDim / 32;
  static constexpr int kStride = kHeadDim + 8;  // conflict-free 16-byte reads of a lane's key row
  static constexpr int kMaxRowGroups = 4;       // more query rows: the generic kernels serve them
  static constexpr int kMaxSplits = 1024;
  static constexpr int kKVElems = kBlockN * kStride;
  // K and V tiles (16-bit), Q (kRows x kHeadDim fp32), P (kWarps x kRows x 32 fp32); after the
  // key loop the tiles' space holds the warps' partial rows (kWarps x kRows x (kHeadDim + 1)).
  static constexpr int kTileBytes = 2 * kKVElems * 2;
  static constexpr int kQBytes = kRows * kHeadDim * 4;
  static constexpr int kPBytes = kWarps * kRows * 32 * 4;
  static constexpr int kSmemBytes = kTileBytes + kQBytes + kPBytes;
  static_assert(kHeadDim % 32 == 0, "decode head dims: multiples of 32");
  static_assert(kWarps * kRows * (kHeadDim + 1) * 4 <= kTileBytes, "warp partials fit the tiles");
};

// The split / row-group grid of a decode launch (cuda/params.h DecodeGrid), from shapes only:
// `rows` query rows per kv head, `slots` cache slots per sequence on this rank.
template <typename Cfg>
DecodeGrid choose_decode_grid(int batch, int kv_heads, int rows, int64_t slots,
                              int64_t target_blocks) {
  DecodeGrid grid;
  grid.row_groups = (rows + Cfg::kRows - 1) / Cfg::kRows;
  if (grid.row_groups > Cfg::kMaxRowGroups) return {};
  if (grid.row_groups < 1) grid.row_groups = 1;
  const int64_t tiles = slots > 0 ? (slots + Cfg::kBlockN - 1) / Cfg::kBlockN : 1;
  const int64_t per_split = int64_t(batch) * kv_heads * grid.row_groups;
  int64_t splits = (target_blocks + per_split - 1) / (per_split > 0 ? per_split : 1);
  splits = splits < 1 ? 1 : splits > tiles ? tiles : splits;
  splits = splits > Cfg::kMaxSplits ? Cfg::kMaxSplits : splits;
  const int64_t tiles_per_split = (tiles + splits - 1) / splits;
  grid.split_slots = tiles_per_split * Cfg::kBlockN;
  grid.splits = static_cast<int>((tiles + tiles_per_split - 1) / tiles_per_split);
  return grid;
}

// How a kernel is launched: grid, threads per block and dynamic shared memory, derived once from
// the configs above for the launchers (fwd_kernel.cuh, bwd_kernel.cuh, bwd_preprocess.cu) and the
// host emulation of the kernels (tests/emulate) alike.
struct LaunchShape {
  unsigned grid[3] = {1, 1, 1};
  int threads = 0;
  int smem_bytes = 0;
};

// Forward: one thread block per (query block, head, batch).
template <typename Cfg>
LaunchShape fwd_launch(const ShapeCuda& s) {
  return {{static_cast<unsigned>((s.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM),
           static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch)},
          Cfg::kThreads,
          Cfg::kSmemBytes};
}

// dK/dV pass: one thread block per (key block and head-dim slice, kv head and head split, batch).
template <typename Cfg>
LaunchShape dkdv_launch(const ShapeCuda& s, int head_splits) {
  return {{static_cast<unsigned>((s.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN * Cfg::kSplit),
           static_cast<unsigned>(s.kv_heads * head_splits), static_cast<unsigned>(s.batch)},
          Cfg::kThreads,
          Cfg::kSmemBytes};
}

// Deterministic dQ pass: the forward's grid; two stages of K/V and the Q and dO tiles in shared
// memory.
template <typename Cfg>
LaunchShape dq_launch(const ShapeCuda& s) {
  LaunchShape l = fwd_launch<Cfg>(s);
  l.smem_bytes = (2 * Cfg::kQElems + 2 * Cfg::kStageElems) * 2;
  return l;
}

// Backward preprocess: one warp per (batch, head, query row up to seqlen_q_rounded).
constexpr int kPreprocessWarps = 8;
inline LaunchShape preprocess_launch(const ShapeCuda& s, int seqlen_q_rounded) {
  const int64_t rows = static_cast<int64_t>(s.batch) * s.heads * seqlen_q_rounded;
  return {{static_cast<unsigned>((rows + kPreprocessWarps - 1) / kPreprocessWarps), 1, 1},
          32 * kPreprocessWarps,
          0};
}

// Decode: the split kernel's grid (decode_grid), then the merge's, one warp per (batch, query
// row, head) row with the splits' weights in shared memory.
template <typename Cfg>
LaunchShape decode_launch(const DecodeParamsCuda& p) {
  return {{static_cast<unsigned>(p.splits), static_cast<unsigned>(p.kv_heads * p.row_groups),
           static_cast<unsigned>(p.batch)},
          Cfg::kThreads,
          Cfg::kSmemBytes};
}
constexpr int kDecodeMergeWarps = 4;
inline LaunchShape decode_merge_launch(const DecodeParamsCuda& p) {
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  return {{static_cast<unsigned>((rows + kDecodeMergeWarps - 1) / kDecodeMergeWarps), 1, 1},
          32 * kDecodeMergeWarps,
          kDecodeMergeWarps * p.splits * 4};
}

// Element-wise passes over pairs of fp32 values: one thread per pair.
inline LaunchShape pairs_launch(int64_t pairs) {
  return {{static_cast<unsigned>((pairs + 255) / 256), 1, 1}, 256, 0};
}
// dq_convert_kernel: (B, H, Sq, D / 2) pairs; dkv_reduce_kernel: (B, Sk, Hkv, D / 2) pairs.
CPATTN_HOST_DEVICE int64_t dq_pairs(const ShapeCuda& s) {
  return static_cast<int64_t>(s.batch) * s.heads * s.seqlen_q * (s.head_dim / 2);
}
CPATTN_HOST_DEVICE int64_t dkv_pairs(const ShapeCuda& s) {
  return static_cast<int64_t>(s.batch) * s.seqlen_k * s.kv_heads * (s.head_dim / 2);
}

}  // namespace cpattn::cuda
