// Entry points of the CPU kernels. The instruction set is chosen at run time (dispatch.cpp).
#pragma once

#include "cpu/params.h"

namespace cpattn::cpu {

void attention_fwd(const FwdParams& params);
void attention_bwd(const BwdParams& params);
// Rounds n split fp32 sums (BwdParams::dq_low) to the nearest bf16, in place in `high`.
void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n);

// The instruction set the kernels run with: "avx512bf16", "avx512", "avx2" or "generic". The
// environment variable CPATTN_CPU_ISA may ask for a lower one (tests use it to cover every path).
const char* active_isa();

// Whether the kernels take bf16 operands (FwdParams::q16...): AVX-512 with bf16 dot products.
bool has_bf16_dot();

#define CPATTN_DECLARE_ISA(isa)                                          \
  namespace isa {                                                        \
  void attention_fwd(const FwdParams& params);                           \
  void attention_bwd(const BwdParams& params);                           \
  void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n); \
  }
CPATTN_DECLARE_ISA(avx512bf16)
CPATTN_DECLARE_ISA(avx512)
CPATTN_DECLARE_ISA(avx2)
CPATTN_DECLARE_ISA(generic)
#undef CPATTN_DECLARE_ISA

}  // namespace cpattn::cpu
