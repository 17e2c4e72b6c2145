// The entry points (kernels.h) of one instruction set's kernels, for the kernels_<isa>.cpp that
// defines CPATTN_CPU_ISA, CPATTN_MR and CPATTN_NV, CPATTN_CPU_BF16_DOT where the ISA has bf16
// dot products (both passes then also take bf16 operands), and CPATTN_CPU_BRGEMM where it builds
// the brgemm path. Included once per file.
#include "cpu/attention_kernel.h"
#ifdef CPATTN_CPU_BF16_DOT
#include "cpu/attention_kernel_bf16.h"
#endif
#ifdef CPATTN_CPU_BRGEMM
#include "cpu/attention_kernel_brgemm.h"
#endif
#include "cpu/kernels.h"

namespace cpattn::cpu::CPATTN_CPU_ISA {
void attention_fwd(const FwdParams& params) {
#ifdef CPATTN_CPU_BF16_DOT
  if (params.q16) return attention_fwd_bf16_impl(params);
#endif
  attention_fwd_impl(params);
}
void attention_bwd(const BwdParams& params) {
#ifdef CPATTN_CPU_BF16_DOT
  if (params.q16) return attention_bwd_bf16_impl(params);
#endif
  attention_bwd_impl(params);
}
#ifdef CPATTN_CPU_BRGEMM
void attention_fwd_brgemm(const FwdParams& params) { attention_fwd_brgemm_impl(params); }
void attention_bwd_brgemm(const BwdParams& params) { attention_bwd_brgemm_impl(params); }
#endif
void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n) {
  round_split_sums_impl(high, low, n);
}
BackwardBands backward_bands(const AttnShape& shape, int64_t operand_bytes, DType grad) {
  return {key_splits(shape), band_rows(shape), backward_buffer_bytes(shape, operand_bytes, grad)};
}
}  // namespace cpattn::cpu::CPATTN_CPU_ISA
