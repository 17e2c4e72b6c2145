// Batched split-KV decode (flash-decoding) over one rank's shard of a sharded KV cache
// (cpattn/kv_cache.h), for bf16 / fp16 caches: the attention of a few query rows per sequence
// (Sq = 1 for decode, a few for speculative or chunked steps) over every slot the rank stores,
// for the whole batch in one launch.
//
// decode_split_kernel: one thread block per (key split, kv head and query row group, batch). The
// block takes its sequence's slots [split * split_slots, ...) up to the count the rank stores
// (from the device array cache_lens), in tiles of kBlockN keys, and computes for the G query
// heads of its kv head times Sq rows (GQA: they share every K/V load) the online-softmax state
// of softmax_state.h in fp32, base 2. Every (query, key) pair follows the rules on global
// positions: query row i of sequence b at q_start[b] + i (a device array too), slot s at
// CacheSharding::position(rank, s); the mask rule of mask.h (causal, window, prefix) and the
// score options (softcap, ALiBi: HeadScoring::logit2) as the forward's scored path applies them.
// A split writes its partial (out, lse), natural log, empty (0, -inf) when it sees no key.
//
// decode_merge_kernel: merges the splits of each row in split order (merge_weights_n) into the
// fp32 out and lse. Both kernels compile for CUDA and for the host emulation of tests/emulate.
#pragma once

#ifndef CPATTN_CUDA_EMULATE
#include <cuda_runtime.h>
#endif

#include <cstdint>

#include "cpattn/kv_cache.h"
#include "cpattn/softmax_state.h"
#include "cuda/fwd_kernel.cuh"
#include "cuda/kernel_config.h"
#include "cuda/params.h"
#include "cuda/ptx.cuh"
#include "cuda/tile_io.cuh"

namespace cpattn::cuda {

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Eight 16-bit elements: one 16-byte shared load.
template <typename Elem>
struct alignas(16) Chunk8 {
  Elem e[8];
};

template <typename Cfg, typename Elem>
__global__ void __launch_bounds__(Cfg::kThreads)
    decode_split_kernel(const __grid_constant__ DecodeParamsCuda p) {
  constexpr int kHeadDim = Cfg::kHeadDim, kRows = Cfg::kRows, kCols = Cfg::kCols;
  constexpr int kBlockN = Cfg::kBlockN, kStride = Cfg::kStride, kWarps = Cfg::kWarps;
  constexpr int kThreads = Cfg::kThreads;

  Elem* const sK = shared_tiles<Elem>();
  Elem* const sV = sK + Cfg::kKVElems;
  float* const sQ = reinterpret_cast<float*>(sK + 2 * Cfg::kKVElems);
  float* const sP = sQ + kRows * kHeadDim;           // [warp][row][lane]
  float* const sO = reinterpret_cast<float*>(sK);    // after the key loop: [warp][row][col]
  float* const sL = sO + kWarps * kRows * kHeadDim;  // [warp][row]

  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.row_groups, row0 = (blockIdx.y % p.row_groups) * kRows;
  const int group = p.heads / p.kv_heads, Sq = p.seqlen_q;
  const int rows_here = min(kRows, group * Sq - row0);  // >= 1 (choose_decode_grid's row groups)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  // Block row r is row row0 + r of the kv head: query head hk * G + (row0 + r) / Sq, query row
  // (row0 + r) % Sq of the sequence.
  auto head_of = [&](int r) { return hk * group + (row0 + r) / Sq; };
  auto qrow_of = [&](int r) { return (row0 + r) % Sq; };

  const int64_t q_begin = p.q_start[b];
  const int64_t stored = p.sharding.count(p.rank, p.cache_lens[b]);
  const int64_t slot_begin = int64_t(split) * p.split_slots;
  const int64_t slot_end =
      stored < slot_begin + p.split_slots ? stored : slot_begin + p.split_slots;

  // Q rows in fp32 with the scale folded in (scores come out in base 2); rows past rows_here 0.
  const Elem* const q = static_cast<const Elem*>(p.q) + b * p.q_strides.batch;
  for (int x = tid; x < kRows * kHeadDim; x += kThreads) {
    const int r = x / kHeadDim, c = x % kHeadDim;
    sQ[x] = r < rows_here
                ? to_float(q[qrow_of(r) * p.q_strides.seq + head_of(r) * p.q_strides.head + c]) *
                      p.scale_log2
                : 0.f;
  }

  OnlineSoftmaxRow row[kRows];  // this warp's keys; `sum` is this lane's part of the row sum
  float acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;

  const Elem* const k_base =
      static_cast<const Elem*>(p.k_cache) + b * p.k_strides.batch + hk * p.k_strides.head;
  const Elem* const v_base =
      static_cast<const Elem*>(p.v_cache) + b * p.v_strides.batch + hk * p.v_strides.head;
  for (int64_t n0 = slot_begin; n0 < slot_end; n0 += kBlockN) {
    const int valid = static_cast<int>(slot_end - n0 < kBlockN ? slot_end - n0 : kBlockN);
    // Slots are in position order: the tile's keys lie in [first, last] (with positions of other
    // ranks between them). A tile no query row can see is skipped whole (windows, causal).
    Mask tile_mask = p.mask;
    tile_mask.q_offset = q_begin;
    tile_mask.k_offset = p.sharding.position(p.rank, n0);
    const int64_t span = p.sharding.position(p.rank, n0 + valid - 1) - tile_mask.k_offset + 1;
    if (tile_mask.classify(0, Sq, 0, span) == BlockKind::kEmpty) continue;

    // Slots past `valid` are zero-filled: never read from the cache (they may hold anything).
    load_tile_async<kBlockN, kHeadDim, kStride, kThreads>(sK, k_base + n0 * p.k_strides.seq,
                                                          p.k_strides.seq, valid, tid);
    load_tile_async<kBlockN, kHeadDim, kStride, kThreads>(sV, v_base + n0 * p.v_strides.seq,
                                                          p.v_strides.seq, valid, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // the tiles (and, the first time, sQ) are in place

    // This lane's key: its scores for every row, base 2.
    const int key = warp * 32 + lane;
    const int64_t key_pos = p.sharding.position(p.rank, n0 + key);
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.f;
    const Elem* const k_row = sK + key * kStride;
#pragma unroll
    for (int c8 = 0; c8 < kHeadDim / 8; ++c8) {
      const Chunk8<Elem> kc = *reinterpret_cast<const Chunk8<Elem>*>(k_row + c8 * 8);
      float kf[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) kf[e] = to_float(kc.e[e]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows_here) break;
        const float* const qr = sQ + r * kHeadDim + c8 * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) s[r] = fmaf(qr[e], kf[e], s[r]);
      }
    }

    // Score options and mask, then the online softmax of each row over the warp's 32 keys.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows_here) break;
      const int64_t q_pos = q_begin + qrow_of(r);
      const bool seen = key < valid && p.mask.visible_pos(q_pos, key_pos);
      // ALiBi on global positions: HeadScoring's offsets are 0 and stride 1 (DecodeParamsCuda).
      const float x = HeadScoring::of(p.score, head_of(r)).logit2(s[r], q_pos, key_pos);
      const float score = seen ? x : neg_inf();
      const float factor = row[r].rescale_for_block_max(warp_max(score));
      const float pr = fast_exp2(score - row[r].reference());
      row[r].sum += pr;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= factor;
      sP[(warp * kRows + r) * 32 + lane] = pr;
    }
    __syncthreads();  // P of the warp's keys in sP

    // acc += P V over the warp's 32 keys; this lane's kCols columns.
    for (int j = 0; j < 32; ++j) {
      const Elem* const v_row = sV + (warp * 32 + j) * kStride + lane * kCols;
      float vf[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) vf[c] = to_float(v_row[c]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows_here) break;
        const float pr = sP[(warp * kRows + r) * 32 + j];
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = fmaf(pr, vf[c], acc[r][c]);
      }
    }
    __syncthreads();  // every warp is done with the tiles and sP before the next copies
  }

  // Each warp's partial rows (normalised, natural-log lse) -> shared, merged over the warps.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows_here) break;
    OnlineSoftmaxRow full = row[r];
    full.sum = warp_sum(full.sum);
    const float inv = full.inv_sum();
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      sO[(warp * kRows + r) * kHeadDim + lane * kCols + c] = acc[r][c] * inv;
    if (lane == 0) sL[warp * kRows + r] = full.lse();
  }
  __syncthreads();
  const int64_t rows_total = int64_t(p.batch) * Sq * p.heads;
  for (int x = tid; x < rows_here * kHeadDim; x += kThreads) {
    const int r = x / kHeadDim, c = x % kHeadDim;
    float w[kWarps];
    const float lse = merge_weights_n(sL + r, kWarps, kRows, w);
    float o = 0.f;
#pragma unroll
    for (int n = 0; n < kWarps; ++n) o += w[n] * sO[(n * kRows + r) * kHeadDim + c];
    const int h = head_of(r), i = qrow_of(r);
    const int64_t out_row = (int64_t(b) * Sq + i) * p.heads + h;  // (B, Sq, H) rows
    p.part_out[(split * rows_total + out_row) * kHeadDim + c] = o;
    if (c == 0) p.part_lse[split * rows_total + (int64_t(b) * p.heads + h) * Sq + i] = lse;
  }
}

// One warp per row of out: the splits' weights (merge_weights_n, in split order) into shared
// memory by lane 0, then the weighted sum of the partial rows by every lane.
template <int kHeadDim>
__global__ void __launch_bounds__(32 * kDecodeMergeWarps)
    decode_merge_kernel(const __grid_constant__ DecodeParamsCuda p) {
  float* const weights = shared_tiles<float>() + (threadIdx.x >> 5) * p.splits;
  const int lane = threadIdx.x & 31;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads;
  const int64_t row = int64_t(blockIdx.x) * kDecodeMergeWarps + (threadIdx.x >> 5);
  const bool live = row < rows;  // row = (b * Sq + i) * H + h
  const int64_t h = row % p.heads, i = (row / p.heads) % p.seqlen_q,
                b = row / (int64_t(p.heads) * p.seqlen_q);
  const int64_t lse_at = (b * p.heads + h) * p.seqlen_q + i;
  if (live && lane == 0)
    p.lse[lse_at] = merge_weights_n(p.part_lse + lse_at, p.splits, rows, weights);
  __syncthreads();  // the weights of every warp's row (no early return before it)
  if (!live) return;
  float* const out =
      p.out + b * p.out_strides.batch + i * p.out_strides.seq + h * p.out_strides.head;
  for (int c = lane; c < kHeadDim; c += 32) {
    float o = 0.f;
    for (int n = 0; n < p.splits; ++n)
      o += weights[n] * p.part_out[(n * rows + row) * kHeadDim + c];
    out[c] = o;
  }
}

#ifndef CPATTN_CUDA_EMULATE
template <DType kDtype, int kHeadDim>
int launch_decode(const DecodeParamsCuda& p, void* stream) {
  using Cfg = DecodeConfig<kHeadDim>;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int e = launch_kernel(decode_split_kernel<Cfg, ElemT<kDtype>>, decode_launch<Cfg>(p), p, s);
  if (e != 0) return e;
  return launch_kernel(decode_merge_kernel<kHeadDim>, decode_merge_launch(p), p, s);
}
#endif  // CPATTN_CUDA_EMULATE

}  // namespace cpattn::cuda
