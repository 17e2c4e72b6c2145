// Dispatch over the compiled (dtype, head dim) instantiations. CMake writes CPATTN_HEAD_DIMS, the
// comma-separated head dims whose csrc/cuda/inst/ files it compiles (CPATTN_CUDA_HEAD_DIMS), into
// a generated header.
#include <cuda_runtime.h>

#include "cpattn_cuda_head_dims.h"
#include "cuda/kernel_config.h"
#include "cuda/params.h"

#ifndef CPATTN_HEAD_DIMS
#error "CPATTN_HEAD_DIMS (e.g. 64, 128) must be defined by the build"
#endif

namespace cpattn::cuda {
namespace {

constexpr int kHeadDims[] = {CPATTN_HEAD_DIMS};

template <DType kDtype, int... kDims>
struct Dispatch {
  static int fwd(const FwdParamsCuda& p, void* stream) {
    int result = kErrNoKernel;
    ((p.shape.head_dim == kDims ? (result = launch_fwd<kDtype, kDims>(p, stream), true) : false) ||
     ...);
    return result;
  }
  static int dkdv_blocks(int head_dim, int seqlen_k) {
    ShapeCuda s;
    s.batch = s.kv_heads = 1;
    s.seqlen_k = seqlen_k;
    int result = 0;
    ((head_dim == kDims
          ? (result = static_cast<int>(dkdv_launch<BwdConfigFor<kDims>>(s, 1).grid[0]), true)
          : false) ||
     ...);
    return result;
  }
  static int decode(const DecodeParamsCuda& p, void* stream) {
    int result = kErrNoKernel;
    ((p.head_dim == kDims ? (result = launch_decode<kDtype, kDims>(p, stream), true) : false) ||
     ...);
    return result;
  }
  static DecodeGrid decode_grid(int head_dim, int batch, int kv_heads, int rows, int64_t slots,
                                int64_t target_blocks) {
    DecodeGrid grid;
    ((head_dim == kDims ? (grid = choose_decode_grid<DecodeConfig<kDims>>(batch, kv_heads, rows,
                                                                          slots, target_blocks),
                           true)
                        : false) ||
     ...);
    return grid;
  }
  static int bwd(const BwdParamsCuda& p, void* stream) {
    int result = kErrNoKernel;
    ((p.shape.head_dim == kDims ? (result = launch_bwd<kDtype, kDims>(p, stream), true) : false) ||
     ...);
    return result;
  }
};

}  // namespace

const int* compiled_head_dims(int* count) {
  *count = static_cast<int>(sizeof(kHeadDims) / sizeof(kHeadDims[0]));
  return kHeadDims;
}

int bwd_dkdv_blocks(int head_dim, int seqlen_k) {
  return Dispatch<DType::kBFloat16, CPATTN_HEAD_DIMS>::dkdv_blocks(head_dim, seqlen_k);
}

int run_fwd(const FwdParamsCuda& p, void* stream) {
  switch (p.dtype) {
    case DType::kBFloat16:
      return Dispatch<DType::kBFloat16, CPATTN_HEAD_DIMS>::fwd(p, stream);
    case DType::kFloat16:
      return Dispatch<DType::kFloat16, CPATTN_HEAD_DIMS>::fwd(p, stream);
    default:
      return kErrNoKernel;
  }
}

DecodeGrid decode_grid(int head_dim, int batch, int kv_heads, int rows_per_kv_head, int64_t slots,
                       int64_t target_blocks) {
  return Dispatch<DType::kBFloat16, CPATTN_HEAD_DIMS>::decode_grid(
      head_dim, batch, kv_heads, rows_per_kv_head, slots, target_blocks);
}

int run_decode(const DecodeParamsCuda& p, void* stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads == 0) return 0;  // an empty grid: nothing to do
  switch (p.dtype) {
    case DType::kBFloat16:
      return Dispatch<DType::kBFloat16, CPATTN_HEAD_DIMS>::decode(p, stream);
    case DType::kFloat16:
      return Dispatch<DType::kFloat16, CPATTN_HEAD_DIMS>::decode(p, stream);
    default:
      return kErrNoKernel;
  }
}

int run_bwd(const BwdParamsCuda& p, void* stream) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return kErrNoKernel;
  const int e = run_bwd_preprocess(p, stream);
  if (e != 0) return e;
  if (p.dtype == DType::kBFloat16)
    return Dispatch<DType::kBFloat16, CPATTN_HEAD_DIMS>::bwd(p, stream);
  return Dispatch<DType::kFloat16, CPATTN_HEAD_DIMS>::bwd(p, stream);
}

}  // namespace cpattn::cuda
