// Launch of the backward preprocess (bwd_preprocess.cuh) for the dtypes of out and dout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bwd_preprocess.cuh"
#include "cuda/params.h"

namespace cpattn::cuda {
namespace {

template <typename TOut, typename TdOut>
int launch(const BwdParamsCuda& p, cudaStream_t stream) {
  const LaunchShape l = preprocess_launch(p.shape, p.seqlen_q_rounded);
  bwd_preprocess_kernel<TOut, TdOut><<<l.grid[0], l.threads, l.smem_bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename TdOut>
int launch_out(const BwdParamsCuda& p, cudaStream_t stream) {
  switch (p.out_dtype) {
    case DType::kFloat32:
      return launch<float, TdOut>(p, stream);
    case DType::kBFloat16:
      return launch<__nv_bfloat16, TdOut>(p, stream);
    default:
      return launch<__half, TdOut>(p, stream);
  }
}

}  // namespace

int run_bwd_preprocess(const BwdParamsCuda& p, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p.dtype == DType::kBFloat16) return launch_out<__nv_bfloat16>(p, s);
  return launch_out<__half>(p, s);
}

}  // namespace cpattn::cuda
