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

// How the backward of a call of shape `shape` cuts its work (attention_kernel.h): the splits of
// the key blocks per (batch, kv head) pair, each with its own dQ buffer, and the query rows per
// chunk. For the cost model's memory figures (cpattn.plan).
struct BackwardChunking {
  int64_t key_splits = 0;
  int64_t chunk_rows = 0;
};
BackwardChunking backward_chunking(const AttnShape& shape);

#define CPATTN_DECLARE_ISA(isa)                                          \
  namespace isa {                                                        \
  void attention_fwd(const FwdParams& params);                           \
  void attention_bwd(const BwdParams& params);                           \
  void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n); \
  BackwardChunking backward_chunking(const AttnShape& shape);            \
  }
CPATTN_DECLARE_ISA(avx512bf16)
CPATTN_DECLARE_ISA(avx512)
CPATTN_DECLARE_ISA(avx2)
CPATTN_DECLARE_ISA(generic)
#undef CPATTN_DECLARE_ISA

}  // namespace cpattn::cpu
