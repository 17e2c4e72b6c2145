// The CPU kernels compiled for generic (flags set per file in CMakeLists.txt).
// Micro-tile: 2 rows x 1 vectors of 16 floats, sized to the register file of this ISA.
#define CPATTN_CPU_ISA generic
#define CPATTN_MR 2
#define CPATTN_NV 1
#include "cpu/attention_kernel.h"
#include "cpu/kernels.h"

namespace cpattn::cpu::generic {
void attention_fwd(const FwdParams& params) { attention_fwd_impl(params); }
void attention_bwd(const BwdParams& params) { attention_bwd_impl(params); }
void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n) {
  round_split_sums_impl(high, low, n);
}
BackwardChunking backward_chunking(const AttnShape& shape) {
  return {key_splits(shape), chunk_rows(shape)};
}
}  // namespace cpattn::cpu::generic
