// The CPU kernels compiled for AVX-512 with bf16 dot products (flags set in CMakeLists.txt):
// the fp32 kernels as in kernels_avx512.cpp, plus both passes on bf16 operands.
#define CPATTN_CPU_ISA avx512bf16
#define CPATTN_MR 8
#define CPATTN_NV 2
#include "cpu/attention_kernel.h"
#include "cpu/attention_kernel_bf16.h"
#include "cpu/kernels.h"

namespace cpattn::cpu::avx512bf16 {
void attention_fwd(const FwdParams& params) {
  if (params.q16)
    attention_fwd_bf16_impl(params);
  else
    attention_fwd_impl(params);
}
void attention_bwd(const BwdParams& params) {
  if (params.q16)
    attention_bwd_bf16_impl(params);
  else
    attention_bwd_impl(params);
}
void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n) {
  round_split_sums_impl(high, low, n);
}
BackwardChunking backward_chunking(const AttnShape& shape) {
  return {key_splits(shape), chunk_rows(shape)};
}
}  // namespace cpattn::cpu::avx512bf16
