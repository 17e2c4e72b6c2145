#include <cstdlib>
#include <cstring>

#include "cpu/kernels.h"

namespace cpattn::cpu {
namespace {

enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect() {
  Isa best = Isa::kGeneric;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    best = Isa::kAvx512;
#endif
  // CPATTN_CPU_ISA can only lower the choice: asking for more than the CPU has would crash.
  if (const char* want = std::getenv("CPATTN_CPU_ISA")) {
    Isa asked = best;
    if (!std::strcmp(want, "generic")) asked = Isa::kGeneric;
    if (!std::strcmp(want, "avx2")) asked = Isa::kAvx2;
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
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

void attention_fwd(const FwdParams& params) {
  switch (isa()) {
    case Isa::kAvx512: return avx512::attention_fwd(params);
    case Isa::kAvx2: return avx2::attention_fwd(params);
    default: return generic::attention_fwd(params);
  }
}

void attention_bwd(const BwdParams& params) {
  switch (isa()) {
    case Isa::kAvx512: return avx512::attention_bwd(params);
    case Isa::kAvx2: return avx2::attention_bwd(params);
    default: return generic::attention_bwd(params);
  }
}

}  // namespace cpattn::cpu
