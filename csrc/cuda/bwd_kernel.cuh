// Backward attention kernels for sm80+ (FlashAttention-2 algorithm), from the global lse and
// delta = rowsum(dout * out) - dlse that the preprocess (bwd_preprocess.cu) left in base-2 form:
//
//   dK/dV pass, one thread block per (key block, kv head, batch) (and head-dim slice, for the
//   largest head dims: kernel_config.h): each warp owns 16 keys and
//   keeps their dK, dV rows in fp32 registers while the block walks every query tile that sees
//   the key block, for every query head of the kv head (GQA sums over the group without atomics;
//   with few kv heads the group is split over head_splits blocks, whose fp32 parts
//   dkv_reduce_kernel adds in a fixed order):
//     S^T = K Q^T, P^T = exp2(S^T * scale * log2 e - lse_log2), dV += P^T dO,
//     dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q,
//   and, unless deterministic, dQ += dS K through a shared dS^T tile and fp32 atomics.
//   dQ pass (deterministic option), one thread block per (query block, head, batch): recomputes
//   S, P, dP and dS for its rows against every key block they see and keeps dQ in registers.
//
// Scores and masks as in the forward kernel (tiling.h); scale is applied to dK and dQ at the end.
//
// kScored selects the path with the score options (ScoreOptions, cpattn/params.h), as the forward
// defines them: P recomputed from HeadScoring::logit2 (softcap, then ALiBi on global positions),
// the prefix-LM union in the element mask, and dS = P (dP - delta) d(logit)/d(score) (1 - tanh^2
// under a softcap; ALiBi adds a constant, no term). Sinks need nothing here: the lse the backward
// receives already holds them (log(exp(sink) + sum)), so P is the probability actually applied;
// the sinks' own gradient is computed outside the kernels (sink_grad). The plain instantiation
// (kScored = false) runs the code it had before.
//
// Accumulate mode (BwdParamsCuda::accumulate, the ring's bwd_add) adds the gradients into fp32
// dq, dk, dv instead of writing them, so that no fp32 gradient of a sub-problem is allocated: the
// dK/dV epilogue reads, adds and writes its rows (each (key, column) belongs to one thread of one
// block), the head-split reduction and the deterministic dQ pass add instead of storing, and the
// dQ atomics go straight into dq (scaled there; dq_accum's conversion pass is skipped). Only the
// dK/dV kernel has an instantiation of its own for it (kAccumulate: the atomics sit in its main
// loop); the other kernels branch once in their epilogue.
#pragma once

#ifndef CPATTN_CUDA_EMULATE
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpattn/softmax_state.h"
#include "cpattn/tiling.h"
#include "cuda/fwd_kernel.cuh"
#include "cuda/kernel_config.h"
#include "cuda/params.h"
#include "cuda/ptx.cuh"
#include "cuda/tile_io.cuh"

namespace cpattn::cuda {

// acc += C B for one warp: C is the warp's 16 x (16 * kKSteps) accumulator (2 * kKSteps n8 tiles,
// C layout, turned into A operands by c_to_a), B rows [0, 16 * kKSteps) x columns
// [c0, c0 + 8 * kNTiles) of a row-major shared tile (row stride kStride). The backward's
// dV += P^T dO, dK += dS^T Q and dQ += dS K.
template <typename Elem, int kKSteps, int kNTiles, int kStride>
__device__ __forceinline__ void mma_c_b(float (&acc)[kNTiles][4], const float (&c)[2 * kKSteps][4],
                                        uint32_t b_tile, int c0, int lane) {
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    c_to_a<Elem>(a, c[2 * ks], c[2 * ks + 1]);
    mma_k16<Elem, 1>(&acc, &a, [&](int np, uint32_t(&b)[4]) {
      ldmatrix_x4_trans(b, elem_addr(b_tile, b_trans_offset<kStride>(ks * 16, c0 + np * 16, lane)));
    });
  }
}

template <typename Cfg, typename Elem, typename GradT, bool kScored, bool kAccumulate = false>
__global__ void __launch_bounds__(Cfg::kThreads)
    attention_bwd_dkdv_kernel(const __grid_constant__ BwdParamsCuda p) {
  static_assert(!kAccumulate || std::is_same_v<GradT, float>, "accumulators are fp32");
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kThreads = Cfg::kThreads, kStride = Cfg::kStride, kDSStride = Cfg::kDSStride;
  constexpr int kKSteps = Cfg::kKSteps, kQTiles = Cfg::kQTiles, kMSteps = Cfg::kMSteps;
  constexpr int kDTiles = Cfg::kDTiles;

  Elem* const sK_ = shared_tiles<Elem>();
  Elem* const sV_ = sK_ + Cfg::kKVElems;
  Elem* const sQ0 = sV_ + Cfg::kKVElems;                                // per stage: Q, then dO
  Elem* const sdS_ = sQ0 + 4 * Cfg::kQElems;                            // dS^T [key][query]
  float* const sLse0 = reinterpret_cast<float*>(sdS_ + Cfg::kDSElems);  // lse, delta per stage

  // Key block, and the slice [d0, d0 + kSliceDim) of the head dim this block owns in dK / dV / dQ;
  // kv head, and the share of its query heads (head split) this block walks.
  const int n_block = blockIdx.x / Cfg::kSplit, b = blockIdx.z;
  const int hk = blockIdx.y / p.head_splits, split = blockIdx.y % p.head_splits;
  const int d0 = (Cfg::kSplit > 1 ? blockIdx.x % Cfg::kSplit : 0) * Cfg::kSliceDim;
  const int group = p.shape.heads / p.shape.kv_heads / p.head_splits;  // query heads walked here
  const int h_first = (hk * p.head_splits + split) * group;
  const int seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int rounded = p.seqlen_q_rounded;
  const int n0 = n_block * kBlockN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const Mask& mask = p.mask;
  const float scale_log2 = p.scale_log2;

  const BlockRange qb =
      query_blocks_of_keys(mask, n0, min(n0 + kBlockN, seqlen_k), seqlen_q, kBlockM);
  const int m_blocks = qb.count();
  const int total = m_blocks * group;  // (query head, query block) tiles, head-major

  float dk[kDTiles][4], dv[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  // Query tile (head h, rows from m0) into stage st: Q, dO at sQ0 + st * 2 * kQElems; lse_log2,
  // delta at sLse0 + st * 2 * kBlockM.
  auto load_q_tile = [&](int h, int m0, int st) {
    Elem* const sQ = sQ0 + st * 2 * Cfg::kQElems;
    float* const sLse = sLse0 + st * 2 * kBlockM;
    load_rows_async<kBlockM, Cfg>(sQ, p.q, p.q_strides, b, h, m0, seqlen_q, tid);
    load_rows_async<kBlockM, Cfg>(sQ + Cfg::kQElems, p.dout, p.dout_strides, b, h, m0, seqlen_q,
                                  tid);
    const int64_t row0 = (static_cast<int64_t>(b) * p.shape.heads + h) * rounded + m0;
    load_floats_async<kBlockM, kThreads>(sLse, p.lse_log2 + row0, tid);
    load_floats_async<kBlockM, kThreads>(sLse + kBlockM, p.delta + row0, tid);
  };

  if (total > 0) {
    load_kv_async<Cfg>(p, b, hk, n_block, sK_, sV_, tid);
    load_q_tile(h_first, qb.first * kBlockM, 0);
    cp_async_commit();
  }

  // This thread's keys: warp * 16 + g + 8 * half (local to the block); the query rows that see
  // each (empty for a key past the sequence end).
  const int warp_key0 = warp * 16;
  IndexBounds rows_of_key[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = n0 + warp_key0 + g + 8 * half;
    rows_of_key[half] =
        key < seqlen_k ? visible_rows_of_key(mask, key, seqlen_q) : IndexBounds{0, -1};
    if constexpr (kScored)  // every query sees a prefix key (mask.h's union)
      if (prefix_keys(mask, seqlen_k).contains(key)) rows_of_key[half] = {0, seqlen_q - 1};
  }

  const uint32_t sK = smem_u32(sK_), sV = smem_u32(sV_), sdS = smem_u32(sdS_);
  // (h, m0): the current tile's query head and first row; tiles go head-major.
  int h = h_first, m0 = qb.first * kBlockM;
  for (int it = 0; it < total; ++it) {
    const int stage = it & 1;
    // Shared addresses of this stage's Q and dO tiles (stage 1 follows stage 0).
    const uint32_t sQ = smem_u32(sQ0) + stage * (4 * Cfg::kQElems);
    const uint32_t sdO = sQ + 2 * Cfg::kQElems;
    const float* const sLse = sLse0 + stage * 2 * kBlockM;
    const float* const sDelta = sLse + kBlockM;
    const int h_cur = h, m0_cur = m0;
    m0 += kBlockM;
    if (m0 > qb.last * kBlockM) {
      m0 = qb.first * kBlockM;
      ++h;
    }
    cp_async_wait<0>();
    __syncthreads();  // this stage has landed; every warp is done with the other one and sdS
    if (it + 1 < total) {
      load_q_tile(h, m0, stage ^ 1);
      cp_async_commit();
    }
    if (tile_is_empty(mask, m0_cur, kBlockM, n0, kBlockN, seqlen_q, seqlen_k)) continue;
    const bool masked = tile_needs_mask(mask, m0_cur, kBlockM, n0, kBlockN, seqlen_q, seqlen_k);

    // S^T = K Q^T: this warp's 16 keys x the tile's kBlockM queries.
    float st[kQTiles][4], dpt[kQTiles][4];
    mma_a_bt<Elem, kKSteps, kQTiles, kStride>(st, sK, warp_key0, sQ, lane);
    if constexpr (kScored) {
      // dP^T = V dO^T first: P^T and dS^T then come from one pass over S^T and dP^T, in their
      // place (the chain-rule factor needs no registers of its own).
      mma_a_bt<Elem, kKSteps, kQTiles, kStride>(dpt, sV, warp_key0, sdO, lane);
      const HeadScoring scoring = HeadScoring::of(p.score, h_cur);
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
        const float2 l2 = *reinterpret_cast<const float2*>(sLse + qt * 8 + 2 * t);
        const float2 d = *reinterpret_cast<const float2*>(sDelta + qt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = m0_cur + qt * 8 + 2 * t + (e & 1);
          const int key = n0 + warp_key0 + g + 8 * (e >> 1);
          float dcap;
          const float logit = scoring.logit2(st[qt][e] * scale_log2, row, key, &dcap);
          float pv = fast_exp2(logit - ((e & 1) ? l2.y : l2.x));
          if (masked && !rows_of_key[e >> 1].contains(row)) pv = 0.f;
          st[qt][e] = pv;
          dpt[qt][e] = pv * (dpt[qt][e] - ((e & 1) ? d.y : d.x)) * dcap;
        }
      }
    } else {
      // P^T from the global lse (base 2; +inf for an empty row gives 0).
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
        const float2 l2 = *reinterpret_cast<const float2*>(sLse + qt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = fast_exp2(fmaf(st[qt][e], scale_log2, -((e & 1) ? l2.y : l2.x)));
          if (masked && !rows_of_key[e >> 1].contains(m0_cur + qt * 8 + 2 * t + (e & 1))) pv = 0.f;
          st[qt][e] = pv;
        }
      }
    }
    // dV += P^T dO.
    mma_c_b<Elem, kMSteps, kDTiles, kStride>(dv, st, sdO, d0, lane);
    if constexpr (!kScored) {
      // dP^T = V dO^T.
      mma_a_bt<Elem, kKSteps, kQTiles, kStride>(dpt, sV, warp_key0, sdO, lane);
      // dS^T = P^T (dP^T - delta), in place of dP^T.
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt) {
        const float2 d = *reinterpret_cast<const float2*>(sDelta + qt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[qt][e] = st[qt][e] * (dpt[qt][e] - ((e & 1) ? d.y : d.x));
      }
    }
    // dK += dS^T Q (scaled at the end).
    mma_c_b<Elem, kMSteps, kDTiles, kStride>(dk, dpt, sQ, d0, lane);

    if (p.dq_accum != nullptr) {
      // dS^T -> shared, then dQ(tile rows) += dS K, in units of 16 rows x 32 columns.
#pragma unroll
      for (int qt = 0; qt < kQTiles; ++qt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<uint32_t*>(sdS_ + (warp_key0 + g + 8 * half) * kDSStride + qt * 8 +
                                       2 * t) =
              pack2<Elem>(dpt[qt][2 * half], dpt[qt][2 * half + 1]);
      __syncthreads();
      float* const dq_tile =
          p.dq_accum +
          ((static_cast<int64_t>(b) * p.shape.heads + h_cur) * rounded + m0_cur) * kHeadDim;
      // Accumulate mode: dq's rows of this tile (strided, no rows past seqlen_q).
      [[maybe_unused]] float* const dq_rows =
          kAccumulate
              ? static_cast<float*>(p.dq) + b * p.dq_strides.batch + h_cur * p.dq_strides.head +
                    static_cast<int64_t>(m0_cur) * p.dq_strides.seq
              : nullptr;
      constexpr int kColUnits = Cfg::kSliceDim / Cfg::kDqCols;
      for (int u = warp; u < Cfg::kDqUnits; u += Cfg::kWarps) {
        const int r0 = (u / kColUnits) * 16, c0 = d0 + (u % kColUnits) * Cfg::kDqCols;
        float acc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
        for (int ns = 0; ns < kBlockN / 16; ++ns) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, elem_addr(sdS, a_trans_offset<kDSStride>(r0, ns * 16, lane)));
          mma_k16<Elem, 1>(&acc, &a, [&](int j, uint32_t(&bk)[4]) {
            ldmatrix_x4_trans(bk,
                              elem_addr(sK, b_trans_offset<kStride>(ns * 16, c0 + j * 16, lane)));
          });
        }
        if constexpr (kAccumulate) {
          // Into dq itself: scaled here, only its real rows and columns.
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = r0 + g + 8 * half;
            if (m0_cur + r >= seqlen_q) continue;
            float* const dst = dq_rows + static_cast<int64_t>(r) * p.dq_strides.seq;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int c = c0 + j * 8 + 2 * t + e;
                if (c < p.dq_cols) atomicAdd(dst + c, acc[j][2 * half + e] * p.softmax_scale);
              }
          }
        } else {
          // One base address per unit; the rest are compile-time offsets (RED [R + imm]).
          float* const dst = dq_tile + (r0 + g) * kHeadDim + c0 + 2 * t;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              atomicAdd(dst + half * 8 * kHeadDim + j * 8, acc[j][2 * half]);
              atomicAdd(dst + half * 8 * kHeadDim + j * 8 + 1, acc[j][2 * half + 1]);
            }
        }
      }
    }
  }

  // Epilogue: dK (scaled) and dV of this warp's keys, (B, Sk, Hkv, D) in GradT (added into them
  // in accumulate mode), or this split's fp32 part of them. A key block that no query sees writes
  // zeros (adds nothing).
  const float scale = p.softmax_scale;
  if (p.head_splits > 1) {
    const int64_t part = static_cast<int64_t>(p.shape.batch) * seqlen_k * p.shape.kv_heads *
                         kHeadDim;  // one (kind, split) slice of dkv_partial
    float* const dk_part = p.dkv_partial + split * part +
                           (static_cast<int64_t>(b) * seqlen_k * p.shape.kv_heads + hk) * kHeadDim;
    float* const dv_part = dk_part + p.head_splits * part;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = n0 + warp_key0 + g + 8 * half;
      if (key >= seqlen_k) continue;
      const int64_t at = static_cast<int64_t>(key) * p.shape.kv_heads * kHeadDim + d0;
      store_acc_row(dk_part + at, dk, half, scale, t);
      store_acc_row(dv_part + at, dv, half, 1.f, t);
    }
    return;
  }
  GradT* const dk_out = static_cast<GradT*>(p.dk) + b * p.dk_strides.batch + hk * p.dk_strides.head;
  GradT* const dv_out = static_cast<GradT*>(p.dv) + b * p.dv_strides.batch + hk * p.dv_strides.head;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = n0 + warp_key0 + g + 8 * half;
    if (key >= seqlen_k) continue;
    GradT* const dk_row = dk_out + static_cast<int64_t>(key) * p.dk_strides.seq + d0;
    GradT* const dv_row = dv_out + static_cast<int64_t>(key) * p.dv_strides.seq + d0;
    if constexpr (kAccumulate) {
      add_acc_row(dk_row, dk, half, scale, t, p.dk_cols - d0);
      add_acc_row(dv_row, dv, half, 1.f, t, p.dv_cols - d0);
    } else {
      store_acc_row(dk_row, dk, half, scale, t);
      store_acc_row(dv_row, dv, half, 1.f, t);
    }
  }
}

// Deterministic dQ: one thread block per (query block, head, batch), warps split the rows.
template <typename Cfg, typename Elem, typename GradT, bool kScored>
__global__ void __launch_bounds__(Cfg::kThreads)
    attention_bwd_dq_kernel(const __grid_constant__ BwdParamsCuda p) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStride = Cfg::kStride;
  constexpr int kKSteps = Cfg::kKSteps, kSTiles = Cfg::kSTiles, kOTiles = Cfg::kOTiles;
  static_assert(Cfg::kMTiles == 1, "the dQ pass gives each warp one m16 tile");

  Elem* const sQ = shared_tiles<Elem>();
  Elem* const sdO = sQ + Cfg::kQElems;
  Elem* const sKV = sdO + Cfg::kQElems;  // K/V stages 0 and 1

  const QueryBlock blk = query_block<Cfg>(p);
  const int m0 = blk.m0, h = blk.h, b = blk.b;
  const int seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const Mask& mask = p.mask;
  const float scale_log2 = p.scale_log2;
  const int warp_row0 = warp * 16;

  float dq[kOTiles][4];
#pragma unroll
  for (int dt = 0; dt < kOTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;

  const KvStages<Cfg, Elem> kv{sKV, b, blk.hk, blk.kb.first};
  const int n_blocks = blk.kb.count();
  if (n_blocks > 0) {
    load_rows_async<kBlockM, Cfg>(sQ, p.q, p.q_strides, b, h, m0, seqlen_q, tid);
    load_rows_async<kBlockM, Cfg>(sdO, p.dout, p.dout_strides, b, h, m0, seqlen_q, tid);
    kv.load(p, 0, tid);
  }

  // This thread's rows g and g + 8 of the warp's m16 tile: key bounds, lse and delta.
  const int64_t ws_row = (static_cast<int64_t>(b) * p.shape.heads + h) * p.seqlen_q_rounded;
  IndexBounds keys_of_row[2];
  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = m0 + warp_row0 + g + 8 * half;
    keys_of_row[half] = visible_keys_of_row(mask, r, seqlen_k);
    lse2[half] = p.lse_log2[ws_row + r];  // rows up to the rounded length exist
    delta[half] = p.delta[ws_row + r];
  }

  [[maybe_unused]] HeadScoring scoring;
  [[maybe_unused]] IndexBounds prefix{0, -1};
  if constexpr (kScored) {
    scoring = HeadScoring::of(p.score, h);
    prefix = prefix_keys(mask, seqlen_k);
  }

  const uint32_t sQ_u = smem_u32(sQ), sdO_u = smem_u32(sdO);
  for (int it = 0; it < n_blocks; ++it) {
    const int n0 = (blk.kb.first + it) * kBlockN;
    const uint32_t sK = kv.wait(it), sV = sK + 2 * Cfg::kKVElems;
    if (it + 1 < n_blocks) kv.load(p, it + 1, tid);
    if (tile_is_empty(mask, m0, kBlockM, n0, kBlockN, seqlen_q, seqlen_k)) continue;
    const bool masked = tile_needs_mask(mask, m0, kBlockM, n0, kBlockN, seqlen_q, seqlen_k);

    // S = Q K^T and dP = dO V^T for this warp's 16 rows.
    float s[kSTiles][4], dp[kSTiles][4];
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const int a_at = a_offset<kStride>(warp_row0, ks * 16, lane);
      uint32_t aq[4], ao[4];
      ldmatrix_x4(aq, elem_addr(sQ_u, a_at));
      ldmatrix_x4(ao, elem_addr(sdO_u, a_at));
      // S and dP side by side (their n8 tile pairs share the row addresses).
#pragma unroll
      for (int np = 0; np < kSTiles / 2; ++np) {
        const int b_at = bt_offset<kStride>(np * 16, ks * 16, lane);
        uint32_t bk[4], bv[4];
        ldmatrix_x4(bk, elem_addr(sK, b_at));
        ldmatrix_x4(bv, elem_addr(sV, b_at));
        mma_16816<Elem>(s[2 * np], aq, bk[0], bk[1]);
        mma_16816<Elem>(s[2 * np + 1], aq, bk[2], bk[3]);
        mma_16816<Elem>(dp[2 * np], ao, bv[0], bv[1]);
        mma_16816<Elem>(dp[2 * np + 1], ao, bv[2], bv[3]);
      }
    }
    // dS = P (dP - delta), P = exp2(S * scale * log2 e - lse_log2), masked pairs 0.
    if constexpr (kScored) {
      // P from the logit, the prefix joins the row's keys, dS takes d(logit)/d(score).
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = m0 + warp_row0 + g + 8 * (e >> 1);
          const int key = n0 + nt * 8 + 2 * t + (e & 1);
          float dcap;
          float pv =
              fast_exp2(scoring.logit2(s[nt][e] * scale_log2, row, key, &dcap) - lse2[e >> 1]);
          if (masked && !prefix.contains(key) && !keys_of_row[e >> 1].contains(key)) pv = 0.f;
          s[nt][e] = pv * (dp[nt][e] - delta[e >> 1]) * dcap;
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = fast_exp2(fmaf(s[nt][e], scale_log2, -lse2[e >> 1]));
          if (masked && !keys_of_row[e >> 1].contains(n0 + nt * 8 + 2 * t + (e & 1))) pv = 0.f;
          s[nt][e] = pv * (dp[nt][e] - delta[e >> 1]);
        }
    }
    // dQ += dS K.
    mma_c_b<Elem, Cfg::kPSteps, kOTiles, kStride>(dq, s, sK, 0, lane);
  }

  GradT* const dq_out = static_cast<GradT*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head;
  const float scale = p.softmax_scale;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = m0 + warp_row0 + g + 8 * half;
    if (r >= seqlen_q) continue;
    GradT* const dq_row = dq_out + static_cast<int64_t>(r) * p.dq_strides.seq;
    if constexpr (std::is_same_v<GradT, float>)
      if (p.accumulate) {  // a uniform branch, after the main loop
        add_acc_row(dq_row, dq, half, scale, t, p.dq_cols);
        continue;
      }
    store_acc_row(dq_row, dq, half, scale, t);
  }
}

// The pair of an element-wise pass over fp32 pairs (pairs_launch) that this thread handles: pair
// i, in a row of kHeadDim / 2 pairs whose index is (i0 * n1 + i1) * n2 + i2; c is its first
// column.
struct PairIndex {
  int64_t i;
  int i0, i1, i2, c;
};
template <int kHeadDim>
__device__ __forceinline__ PairIndex pair_index(int n1, int n2) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = i / (kHeadDim / 2);
  return {i, static_cast<int>(row / n2 / n1), static_cast<int>(row / n2 % n1),
          static_cast<int>(row % n2), static_cast<int>(i % (kHeadDim / 2)) * 2};
}

// dq (B, Sq, H, D) in GradT = scale * dq_accum (B, H, rounded, D) fp32.
template <int kHeadDim, typename GradT>
__global__ void dq_convert_kernel(const __grid_constant__ BwdParamsCuda p) {
  const PairIndex at = pair_index<kHeadDim>(p.shape.heads, p.shape.seqlen_q);
  if (at.i >= dq_pairs(p.shape)) return;  // p.shape.head_dim == kHeadDim
  const int b = at.i0, h = at.i1, s = at.i2, c = at.c;
  const int64_t bh = static_cast<int64_t>(b) * p.shape.heads + h;
  const float2 x =
      *reinterpret_cast<const float2*>(p.dq_accum + (bh * p.seqlen_q_rounded + s) * kHeadDim + c);
  GradT* const dst = static_cast<GradT*>(p.dq) + b * p.dq_strides.batch + h * p.dq_strides.head +
                     static_cast<int64_t>(s) * p.dq_strides.seq + c;
  store2(dst, x.x * p.softmax_scale, x.y * p.softmax_scale);
}

// dk, dv (B, Sk, Hkv, D) in GradT = the sum over the head splits of dkv_partial, in split order
// (added into them, in their real columns, in accumulate mode).
template <int kHeadDim, typename GradT>
__global__ void dkv_reduce_kernel(const __grid_constant__ BwdParamsCuda p) {
  const int64_t pairs = dkv_pairs(p.shape);  // p.shape.head_dim == kHeadDim
  const PairIndex at = pair_index<kHeadDim>(p.shape.seqlen_k, p.shape.kv_heads);
  if (at.i >= pairs) return;
  const int b = at.i0, s = at.i1, hk = at.i2, c = at.c;
  const int64_t part = pairs * 2;  // elements of one (kind, split) slice
  for (int kind = 0; kind < 2; ++kind) {
    const float* src = p.dkv_partial + kind * p.head_splits * part + 2 * at.i;
    float x = 0.f, y = 0.f;
    for (int sp = 0; sp < p.head_splits; ++sp) {
      const float2 v = *reinterpret_cast<const float2*>(src + sp * part);
      x += v.x;
      y += v.y;
    }
    const BshdStrides& st = kind == 0 ? p.dk_strides : p.dv_strides;
    GradT* const dst = static_cast<GradT*>(kind == 0 ? p.dk : p.dv) + b * st.batch +
                       static_cast<int64_t>(s) * st.seq + hk * st.head + c;
    if constexpr (std::is_same_v<GradT, float>)
      if (p.accumulate) {  // element-wise: the row may be unaligned for a pair
        const int cols = kind == 0 ? p.dk_cols : p.dv_cols;
        if (c < cols) dst[0] += x;
        if (c + 1 < cols) dst[1] += y;
        continue;
      }
    store2(dst, x, y);
  }
}

// Whether a backward call needs the scored instantiation: a score option or a prefix (sinks enter
// only through the lse, above).
inline bool bwd_needs_scoring(const BwdParamsCuda& p) {
  return p.score.modifies_scores() || p.mask.has_prefix();
}

#ifndef CPATTN_CUDA_EMULATE  // the tests emulate the kernels on the host, without launchers
template <int kHeadDim, typename Elem, typename GradT, bool kScored>
int launch_bwd_kernels(const BwdParamsCuda& p, cudaStream_t stream) {
  using Cfg = BwdConfigFor<kHeadDim>;
  using DqCfg = DqConfigFor<kHeadDim>;
  const LaunchShape dkdv = dkdv_launch<Cfg>(p.shape, p.head_splits);
  int e = 0;
  if constexpr (std::is_same_v<GradT, float>) {
    e = p.accumulate
            ? launch_kernel(attention_bwd_dkdv_kernel<Cfg, Elem, float, kScored, true>, dkdv, p,
                            stream)
            : launch_kernel(attention_bwd_dkdv_kernel<Cfg, Elem, float, kScored>, dkdv, p, stream);
  } else {
    if (p.accumulate) return static_cast<int>(cudaErrorInvalidValue);  // fp32 accumulators only
    e = launch_kernel(attention_bwd_dkdv_kernel<Cfg, Elem, GradT, kScored>, dkdv, p, stream);
  }
  if (e != 0) return e;
  if (p.head_splits > 1) {
    e = launch_kernel(dkv_reduce_kernel<kHeadDim, GradT>, pairs_launch(dkv_pairs(p.shape)), p,
                      stream);
    if (e != 0) return e;
  }
  if (p.dq_accum != nullptr) {
    if (p.accumulate) return 0;  // the atomics went into dq itself
    return launch_kernel(dq_convert_kernel<kHeadDim, GradT>, pairs_launch(dq_pairs(p.shape)), p,
                         stream);
  }
  return launch_kernel(attention_bwd_dq_kernel<DqCfg, Elem, GradT, kScored>,
                       dq_launch<DqCfg>(p.shape), p, stream);
}

template <int kHeadDim, typename Elem, typename GradT>
int launch_bwd_typed(const BwdParamsCuda& p, cudaStream_t stream) {
  if (bwd_needs_scoring(p)) return launch_bwd_kernels<kHeadDim, Elem, GradT, true>(p, stream);
  return launch_bwd_kernels<kHeadDim, Elem, GradT, false>(p, stream);
}

template <DType kDtype, int kHeadDim>
int launch_bwd(const BwdParamsCuda& p, void* stream) {
  return launch_typed<kDtype>(p.grad_dtype, [&]<typename Elem, typename GradT>() {
    return launch_bwd_typed<kHeadDim, Elem, GradT>(p, static_cast<cudaStream_t>(stream));
  });
}

#endif  // CPATTN_CUDA_EMULATE

}  // namespace cpattn::cuda
