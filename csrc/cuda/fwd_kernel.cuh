// Forward attention kernel (FlashAttention-2 algorithm) for sm80+: bf16 / fp16 inputs, fp32
// accumulation with mma.sync.m16n8k16, online softmax in base 2 with the scale folded into one
// FFMA per score, K/V tiles double-buffered through shared memory with cp.async.
//
// One thread block per (query block, head, batch). The block visits only the key blocks that its
// rows see (tiling.h); tiles cut by the mask or a sequence end are masked element by element,
// every other visited tile runs unmasked. Query row r sits at global position q_offset + r, key
// column c at k_offset + c (the mask rule of mask.h), which covers causal, sliding windows,
// bottom-right alignment and every ring step. A row that sees no key gets out 0 and lse -inf.
//
// kScored selects the path with the score options (ScoreOptions, cpattn/params.h): softcap and
// ALiBi per score (HeadScoring::logit2), the prefix-LM union in the element mask, and the sink
// once per row in the epilogue (add_sink; a caller that merges partial results passes none). The
// plain instantiation (kScored = false) compiles exactly the code it had before.
#pragma once

#ifndef CPATTN_CUDA_EMULATE
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpattn/softmax_state.h"
#include "cpattn/tiling.h"
#include "cuda/kernel_config.h"
#include "cuda/params.h"
#include "cuda/ptx.cuh"
#include "cuda/tile_io.cuh"

namespace cpattn::cuda {

// A thread block of the forward's grid (fwd_launch: one per query block, head and batch; the
// deterministic dQ pass's too): first row m0, head h, its kv head hk, batch b, and the key blocks
// kb that its rows see (tiling.h). The heaviest query blocks (the last ones, under a causal mask)
// are scheduled first.
struct QueryBlock {
  int m0, h, hk, b;
  BlockRange kb;
};
template <typename Cfg, typename Params>
__device__ __forceinline__ QueryBlock query_block(const Params& p) {
  const int m0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * Cfg::kBlockM, h = blockIdx.y;
  return {m0, h, h / (p.shape.heads / p.shape.kv_heads), static_cast<int>(blockIdx.z),
          key_blocks_of_rows(p.mask, m0, min(m0 + Cfg::kBlockM, p.shape.seqlen_q), p.shape.seqlen_k,
                             Cfg::kBlockN)};
}

template <typename Cfg, typename Elem, typename OutT, bool kScored>
__global__ void __launch_bounds__(Cfg::kThreads)
    attention_fwd_kernel(const __grid_constant__ FwdParamsCuda p) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  constexpr int kThreads = Cfg::kThreads, kStride = Cfg::kStride, kMTiles = Cfg::kMTiles;
  constexpr int kKSteps = Cfg::kKSteps, kSTiles = Cfg::kSTiles, kOTiles = Cfg::kOTiles;
  constexpr bool kQInRegs = Cfg::kQInRegs;

  // K/V stages 0 and 1, then Q; with Q in registers, Q's tile is stage 1 until its fragments
  // are read (the first iteration).
  Elem* const smem = shared_tiles<Elem>();
  Elem* const sQ = smem + (kQInRegs ? 1 : 2) * Cfg::kStageElems;

  const QueryBlock blk = query_block<Cfg>(p);
  const int m0 = blk.m0, h = blk.h, b = blk.b;
  const int seqlen_q = p.shape.seqlen_q, seqlen_k = p.shape.seqlen_k;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const Mask& mask = p.mask;

  OutT* const out = static_cast<OutT*>(p.out) + b * p.out_strides.batch + h * p.out_strides.head;
  float* const lse = p.lse + (static_cast<int64_t>(b) * p.shape.heads + h) * seqlen_q;

  if (blk.kb.empty()) {  // no row of this block sees a key
    for (int i = tid; i < kBlockM * (kHeadDim / 2); i += kThreads) {
      const int r = i / (kHeadDim / 2), c = (i % (kHeadDim / 2)) * 2;
      if (m0 + r < seqlen_q) store2(out + (m0 + r) * p.out_strides.seq + c, 0.f, 0.f);
    }
    float empty_lse = neg_inf();
    if constexpr (kScored)  // only the sink in the denominator: add_sink(-inf, sink)
      if (p.score.sinks != nullptr) empty_lse = add_sink(neg_inf(), p.score.sinks[h]).lse;
    for (int r = tid; r < kBlockM; r += kThreads)
      if (m0 + r < seqlen_q) lse[m0 + r] = empty_lse;
    return;
  }

  const KvStages<Cfg, Elem> kv{smem, b, blk.hk, blk.kb.first};
  load_rows_async<kBlockM, Cfg>(sQ, p.q, p.q_strides, b, h, m0, seqlen_q, tid);
  kv.load(p, 0, tid);

  // This thread's rows: warp * 16 * kMTiles + mt * 16 + g + 8 * half (local to the block).
  const int warp_row0 = warp * 16 * kMTiles;
  IndexBounds keys_of_row[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      keys_of_row[mt][half] =
          visible_keys_of_row(mask, m0 + warp_row0 + mt * 16 + g + 8 * half, seqlen_k);

  // Q's A fragment of m16 tile mt, k16 step ks: in q_frag, or read from sQ at every tile.
  uint32_t q_frag[kQInRegs ? kMTiles : 1][kQInRegs ? kKSteps : 1][4];
  auto q_addr = [&](int mt, int ks) {
    return elem_addr(smem_u32(sQ), a_offset<kStride>(warp_row0 + mt * 16, ks * 16, lane));
  };
  float o[kMTiles][kOTiles][4];
  // The online softmax of softmax_state.h (the CPU kernels' too), base 2; `sum` holds this
  // thread's part of the row sum (its quad adds the four parts up in the epilogue).
  OnlineSoftmaxRow row[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kOTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
  const float scale_log2 = p.scale_log2;
  // The scored path turns the scores into base-2 logits before the softmax, which then takes
  // them as they are (scale 1); the plain path folds the scale into the softmax's FFMA.
  const float softmax_scale2 = kScored ? 1.f : scale_log2;

  const int n_blocks = blk.kb.count();
  for (int it = 0; it < n_blocks; ++it) {
    const int n0 = (blk.kb.first + it) * kBlockN;
    const uint32_t sK = kv.wait(it), sV = sK + 2 * Cfg::kKVElems;
    if constexpr (kQInRegs) {
      if (it == 0) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) ldmatrix_x4(q_frag[mt][ks], q_addr(mt, ks));
        __syncthreads();  // sQ is the second stage, overwritten by the prefetch below
      }
    }
    if (it + 1 < n_blocks) kv.load(p, it + 1, tid);
    if (tile_is_empty(mask, m0, kBlockM, n0, kBlockN, seqlen_q, seqlen_k)) continue;
    const bool masked = tile_needs_mask(mask, m0, kBlockM, n0, kBlockN, seqlen_q, seqlen_k);

    // S = Q K^T for this warp's rows and the tile's kBlockN keys.
    float s[kMTiles][kSTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][ks][e];
        } else {
          ldmatrix_x4(a[mt], q_addr(mt, ks));
        }
      }
      mma_k16<Elem, kMTiles>(s, a, [&](int np, uint32_t(&bk)[4]) {
        ldmatrix_x4(bk, elem_addr(sK, bt_offset<kStride>(np * 16, ks * 16, lane)));
      });
    }

    if constexpr (kScored) {
      // logit2 on every score, then the mask: the union of the prefix and the row's interval.
      // (Both read from the parameters here, per tile, rather than held across the loop: fewer
      // live registers.)
      const HeadScoring scoring = HeadScoring::of(p.score, h);
      const IndexBounds prefix = prefix_keys(mask, seqlen_k);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = m0 + warp_row0 + mt * 16 + g + 8 * (e >> 1);
            const int c = n0 + nt * 8 + 2 * t + (e & 1);
            const bool hidden =
                masked && !prefix.contains(c) && !keys_of_row[mt][e >> 1].contains(c);
            s[mt][nt][e] = hidden ? neg_inf() : scoring.logit2(s[mt][nt][e] * scale_log2, r, c);
          }
    } else if (masked) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (!keys_of_row[mt][e >> 1].contains(n0 + nt * 8 + 2 * t + (e & 1)))
              s[mt][nt][e] = neg_inf();
    }

    // Online softmax: new row maxima (quad shuffles), rescale what was accumulated, P in place.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        // The block maximum in base 2 (scale > 0 commutes with max): the row state rescales
        // its sum and gives the factor for o and the reference point subtracted before exp2.
        const float factor = row[mt][half].rescale_for_block_max(quad_max(mx) * softmax_scale2);
        const float ref = row[mt][half].reference();
#pragma unroll
        for (int dt = 0; dt < kOTiles; ++dt) {
          o[mt][dt][2 * half] *= factor;
          o[mt][dt][2 * half + 1] *= factor;
        }
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(fmaf(s[mt][nt][2 * half + e], softmax_scale2, -ref));
            s[mt][nt][2 * half + e] = pv;
            sum += pv;
          }
        row[mt][half].sum += sum;  // NaN scores make it NaN: out and lse NaN, as on the CPU
      }

      // O += P V: P from the score registers (C layout -> A layout), V tiles via ldmatrix.trans.
#pragma unroll
    for (int ps = 0; ps < Cfg::kPSteps; ++ps) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) c_to_a<Elem>(a[mt], s[mt][2 * ps], s[mt][2 * ps + 1]);
      mma_k16<Elem, kMTiles>(o, a, [&](int dp, uint32_t(&bv)[4]) {
        ldmatrix_x4_trans(bv, elem_addr(sV, b_trans_offset<kStride>(ps * 16, dp * 16, lane)));
      });
    }
  }

  // Epilogue: normalise, write out (B, Sq, H, D) in OutT and the natural-log LSE.
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      OnlineSoftmaxRow full = row[mt][half];
      full.sum = quad_sum(full.sum);
      float inv = full.inv_sum();
      const bool has_sink = kScored && p.score.sinks != nullptr;
      [[maybe_unused]] SinkNormalisation sunk{1.f, 0.f};
      if constexpr (kScored) {
        if (has_sink) {  // the sink joins the denominator once, here
          sunk = add_sink(full.lse(), p.score.sinks[h]);
          inv *= sunk.out_factor;
        }
      }
      const int r = m0 + warp_row0 + mt * 16 + g + 8 * half;
      if (r < seqlen_q) {
        store_acc_row(out + static_cast<int64_t>(r) * p.out_strides.seq, o[mt], half, inv, t);
        if (t == 0) lse[r] = has_sink ? sunk.lse : full.lse();
      }
    }
}

// Whether a forward call needs the scored instantiation: any score option, a prefix or sinks.
inline bool fwd_needs_scoring(const FwdParamsCuda& p) {
  return p.score.modifies_scores() || p.score.sinks != nullptr || p.mask.has_prefix();
}

#ifndef CPATTN_CUDA_EMULATE  // the tests emulate the kernels on the host, without launchers
// Launches kernel(p) as `l` says (above 48 KiB of shared memory the kernel must opt in first).
template <typename Kernel, typename Params>
int launch_kernel(Kernel kernel, const LaunchShape& l, const Params& p, cudaStream_t stream) {
  if (l.smem_bytes > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem_bytes);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  kernel<<<dim3(l.grid[0], l.grid[1], l.grid[2]), l.threads, l.smem_bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename Cfg, typename Elem, typename OutT>
int launch_fwd_config(const FwdParamsCuda& p, cudaStream_t stream) {
  if (fwd_needs_scoring(p)) {
    using SCfg = ScoredFwdConfig<Cfg>;
    return launch_kernel(attention_fwd_kernel<SCfg, Elem, OutT, true>, fwd_launch<SCfg>(p.shape), p,
                         stream);
  }
  return launch_kernel(attention_fwd_kernel<Cfg, Elem, OutT, false>, fwd_launch<Cfg>(p.shape), p,
                       stream);
}

#endif  // CPATTN_CUDA_EMULATE

template <DType kDtype>
using ElemT = std::conditional_t<kDtype == DType::kBFloat16, __nv_bfloat16, __half>;

#ifndef CPATTN_CUDA_EMULATE
// launch.template operator()<Elem, OutT>() with kDtype's element type and the type of the
// results (out, or the gradients): fp32 or the element type.
template <DType kDtype, typename Launch>
int launch_typed(DType out_dtype, Launch&& launch) {
  using Elem = ElemT<kDtype>;
  if (out_dtype == DType::kFloat32) return launch.template operator()<Elem, float>();
  return launch.template operator()<Elem, Elem>();
}

template <DType kDtype, int kHeadDim>
int launch_fwd(const FwdParamsCuda& p, void* stream) {
  return launch_typed<kDtype>(p.out_dtype, [&]<typename Elem, typename OutT>() {
    return launch_fwd_config<FwdConfigFor<kHeadDim>, Elem, OutT>(p,
                                                                 static_cast<cudaStream_t>(stream));
  });
}

#endif  // CPATTN_CUDA_EMULATE

}  // namespace cpattn::cuda
