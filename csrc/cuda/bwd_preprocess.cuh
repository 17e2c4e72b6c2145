// Backward preprocess kernel: per query row, delta = rowsum(dout * out) - dlse (no rowsum term
// without out) and the lse in
// base 2 (an empty row's -inf becomes +inf, so its probabilities recompute to exactly 0), into
// the (B, H, seqlen_q_rounded) fp32 workspace; rows past seqlen_q get +inf and 0. One warp per row.
#pragma once

#include <cstdint>

#include "cpattn/softmax_state.h"
#include "cuda/kernel_config.h"
#include "cuda/params.h"
#include "cuda/ptx.cuh"

namespace cpattn::cuda {

template <typename TOut, typename TdOut>
__global__ void __launch_bounds__(32 * kPreprocessWarps)
    bwd_preprocess_kernel(const __grid_constant__ BwdParamsCuda p) {
  const int out_head_dim = p.out_head_dim;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kPreprocessWarps + (threadIdx.x >> 5);
  const int rounded = p.seqlen_q_rounded;
  if (row >= static_cast<int64_t>(p.shape.batch) * p.shape.heads * rounded) return;
  const int s = static_cast<int>(row % rounded);
  const int64_t bh = row / rounded;
  const int h = static_cast<int>(bh % p.shape.heads);
  const int b = static_cast<int>(bh / p.shape.heads);
  float delta = 0.f;
  float lse2 = __int_as_float(0x7f800000);  // +inf
  if (s < p.shape.seqlen_q) {
    float acc = 0.f;
    if (p.out != nullptr) {  // else the caller folded rowsum(dout * out) into dlse (row_dot)
      const TOut* o = static_cast<const TOut*>(p.out) + b * p.out_strides.batch +
                      h * p.out_strides.head + static_cast<int64_t>(s) * p.out_strides.seq;
      const TdOut* d = static_cast<const TdOut*>(p.dout) + b * p.dout_strides.batch +
                       h * p.dout_strides.head + static_cast<int64_t>(s) * p.dout_strides.seq;
      for (int c = lane; c < out_head_dim; c += 32) acc += to_float(o[c]) * to_float(d[c]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    delta = acc;
    if (p.dlse != nullptr)
      delta -= p.dlse[b * p.dlse_strides.batch + h * p.dlse_strides.head +
                      static_cast<int64_t>(s) * p.dlse_strides.seq];
    const float l = p.lse[b * p.lse_strides.batch + h * p.lse_strides.head +
                          static_cast<int64_t>(s) * p.lse_strides.seq];
    lse2 = backward_reference(l);
  }
  if (lane == 0) {
    p.lse_log2[row] = lse2;
    p.delta[row] = delta;
  }
}

}  // namespace cpattn::cuda
