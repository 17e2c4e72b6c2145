// CUDA kernels on plain pointers; they return a cudaError_t value for the op layer to report.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cpattn::cuda {

// Strides in elements: out (B, S, H, D) as (batch, seq, head), head_dim contiguous; lse (B, H, S)
// as (batch, head, seq).
struct MergeStrides {
  int64_t out_batch, out_seq, out_head;
  int64_t lse_batch, lse_head, lse_seq;
};

// out / lse: the running fp32 state, any strides (the ring merges into views); part_out
// (B, S, H, D) and part_lse (B, H, S) fp32 contiguous.
int merge_state(float* out, float* lse, const float* part_out, const float* part_lse, int64_t batch,
                int64_t seqlen, int64_t heads, int64_t head_dim, const MergeStrides& strides,
                cudaStream_t stream);

}  // namespace cpattn::cuda
