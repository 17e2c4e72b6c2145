// CUDA entry points of the op layer: the merge of partial results.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "cuda/merge_state.h"
#include "ops/ops.h"

namespace cpattn::ops {

void merge_into_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse) {
  TORCH_CHECK(out.stride(3) == 1, "cpattn: merge out must be contiguous in head_dim");
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor po = part_out.to(at::kFloat).contiguous();
  const at::Tensor pl = part_lse.to(at::kFloat).contiguous();
  const cuda::MergeStrides st{out.stride(0), out.stride(1), out.stride(2),
                              lse.stride(0), lse.stride(1), lse.stride(2)};
  const int err = cuda::merge_state(out.data_ptr<float>(), lse.data_ptr<float>(),
                                    po.data_ptr<float>(), pl.data_ptr<float>(), out.size(0),
                                    out.size(1), out.size(2), out.size(3), st,
                                    at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "cpattn: merge_state_ CUDA kernel failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void merge_state_cuda_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                       const at::Tensor& part_lse) {
  check_merge_args(out, lse, part_out, part_lse);
  merge_into_cuda(out, lse, part_out, part_lse);
}

}  // namespace cpattn::ops
