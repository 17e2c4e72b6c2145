// Merge of a partial (out, lse) into a running fp32 (out, lse) on the GPU, with the header core's
// -inf-safe weights. One warp-row of the thread block per (batch, seq, head) row of out.
#include <cuda_runtime.h>

#include <cstdint>

#include "cpattn/softmax_state.h"
#include "cuda/merge_state.h"

namespace cpattn::cuda {
namespace {

__global__ void merge_state_kernel(float* out, float* lse, const float* part_out,
                                   const float* part_lse, int64_t rows, int64_t seqlen,
                                   int64_t heads, int64_t head_dim, MergeStrides st) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y;
  if (row >= rows) return;  // row = (b * S + s) * H + h
  const int64_t h = row % heads, s = (row / heads) % seqlen, b = row / (heads * seqlen);
  float* const l = lse + b * st.lse_batch + h * st.lse_head + s * st.lse_seq;
  const MergeWeights w = merge_weights(*l, part_lse[(b * heads + h) * seqlen + s]);
  float* const o = out + b * st.out_batch + s * st.out_seq + h * st.out_head;
  const float* const po = part_out + row * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x)
    o[d] = w.weight_a * o[d] + w.weight_b * po[d];
  __syncwarp();  // every lane has read *l (through merge_weights) before lane 0 writes it
  if (threadIdx.x == 0) *l = w.lse;
}

}  // namespace

int merge_state(float* out, float* lse, const float* part_out, const float* part_lse, int64_t batch,
                int64_t seqlen, int64_t heads, int64_t head_dim, const MergeStrides& strides,
                cudaStream_t stream) {
  const int64_t rows = batch * seqlen * heads;
  if (rows == 0) return static_cast<int>(cudaSuccess);  // an empty grid is a launch error
  const dim3 block(32, 4);
  const dim3 grid(static_cast<unsigned>((rows + block.y - 1) / block.y));
  merge_state_kernel<<<grid, block, 0, stream>>>(out, lse, part_out, part_lse, rows, seqlen, heads,
                                                 head_dim, strides);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cpattn::cuda
