// CUDA kernels on plain pointers; they return a cudaError_t value for the op layer to report.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cpattn::cuda {

int merge_state(float* out, float* lse, const float* part_out, const float* part_lse,
                int64_t batch, int64_t seqlen, int64_t heads, int64_t head_dim,
                cudaStream_t stream);

}  // namespace cpattn::cuda
