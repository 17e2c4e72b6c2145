#include <cstdlib>
#include <cstring>

#include "cpattn/env.h"
#include "cpu/kernels.h"

namespace cpattn::cpu {
namespace {

enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

Isa detect() {
  Isa best = Isa::kGeneric;
#if defined(__x86_64__)
  __builtin_cpu_init();
  // every variant above generic is built with -mavx2 -mfma -mf16c
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    best = Isa::kAvx2;
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    best = Isa::kAvx512;
  if (best == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16")) best = Isa::kAvx512Bf16;
#endif
  // CPATTN_CPU_ISA can only lower the choice: asking for more than the CPU has would crash.
  if (const char* want = env::cpu_isa()) {
    Isa asked = best;
    if (!std::strcmp(want, "generic")) asked = Isa::kGeneric;
    if (!std::strcmp(want, "avx2")) asked = Isa::kAvx2;
    if (!std::strcmp(want, "avx512")) asked = Isa::kAvx512;
    if (asked < best) best = asked;
  }
  return best;
}

Isa isa() {
  static const Isa chosen = detect();
  return chosen;
}

}  // namespace

const char* active_isa() {
  switch (isa()) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

bool has_bf16_dot() { return isa() == Isa::kAvx512Bf16; }

void attention_fwd(const FwdParams& params) {
  switch (isa()) {
    case Isa::kAvx512Bf16:
      return avx512bf16::attention_fwd(params);
    case Isa::kAvx512:
      return avx512::attention_fwd(params);
    case Isa::kAvx2:
      return avx2::attention_fwd(params);
    default:
      return generic::attention_fwd(params);
  }
}

void attention_bwd(const BwdParams& params) {
  switch (isa()) {
    case Isa::kAvx512Bf16:
      return avx512bf16::attention_bwd(params);
    case Isa::kAvx512:
      return avx512::attention_bwd(params);
    case Isa::kAvx2:
      return avx2::attention_bwd(params);
    default:
      return generic::attention_bwd(params);
  }
}

void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n) {
  switch (isa()) {
    case Isa::kAvx512Bf16:
      return avx512bf16::round_split_sums(high, low, n);
    case Isa::kAvx512:
      return avx512::round_split_sums(high, low, n);
    case Isa::kAvx2:
      return avx2::round_split_sums(high, low, n);
    default:
      return generic::round_split_sums(high, low, n);
  }
}

BackwardChunking backward_chunking(const AttnShape& shape) {
  switch (isa()) {
    case Isa::kAvx512Bf16:
      return avx512bf16::backward_chunking(shape);
    case Isa::kAvx512:
      return avx512::backward_chunking(shape);
    case Isa::kAvx2:
      return avx2::backward_chunking(shape);
    default:
      return generic::backward_chunking(shape);
  }
}

}  // namespace cpattn::cpu
