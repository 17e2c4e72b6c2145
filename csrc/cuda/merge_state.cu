// Merge of a partial (out, lse) into a running fp32 (out, lse) on the GPU, with the header core's
// -inf-safe weights. One thread block row per (batch, seq, head) row of out.
#include <cuda_runtime.h>

#include <cstdint>

#include "cpattn/softmax_state.h"
#include "cuda/merge_state.h"

namespace cpattn::cuda {
namespace {

__global__ void merge_state_kernel(float* out, float* lse, const float* part_out,
                                   const float* part_lse, int64_t rows, int64_t seqlen,
                                   int64_t heads, int64_t head_dim) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y;
  if (row >= rows) return;
  const int64_t h = row % heads, s = (row / heads) % seqlen, b = row / (heads * seqlen);
  const int64_t li = (b * heads + h) * seqlen + s;
  const MergeWeights w = merge_weights(lse[li], part_lse[li]);
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x)
    out[row * head_dim + d] = w.weight_a * out[row * head_dim + d] + w.weight_b * part_out[row * head_dim + d];
  __syncwarp();
  if (threadIdx.x == 0) lse[li] = w.lse;
}

}  // namespace

int merge_state(float* out, float* lse, const float* part_out, const float* part_lse,
                int64_t batch, int64_t seqlen, int64_t heads, int64_t head_dim,
                cudaStream_t stream) {
  const int64_t rows = batch * seqlen * heads;
  if (rows == 0) return static_cast<int>(cudaSuccess);  // an empty grid is a launch error
  const dim3 block(32, 4);
  const dim3 grid(static_cast<unsigned>((rows + block.y - 1) / block.y));
  merge_state_kernel<<<grid, block, 0, stream>>>(out, lse, part_out, part_lse, rows, seqlen,
                                                 heads, head_dim);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cpattn::cuda
