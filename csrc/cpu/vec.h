// A 16-lane fp32 vector through GCC/Clang vector extensions. Each kernels_<isa>.cpp compiles the
// kernel with its own -m flags, so the same code becomes AVX-512, AVX2 or SSE2 instructions.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
inline vfloat broadcast(float x) { return vfloat{} + x; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// 2^x, relative error ~2e-7; 0 for x < -126 (and for -inf), so masked scores vanish exactly.
inline vfloat exp2(vfloat x) {
  const vfloat lo = broadcast(-126.f);
  const vfloat clamped = x < lo ? lo : x;
  // n = round(x) via the 1.5 * 2^23 trick, f = x - n in [-0.5, 0.5]
  const vfloat magic = broadcast(12582912.f);
  const vfloat n = (clamped + magic) - magic;
  const vfloat f = clamped - n;
  // 2^f = e^(f ln2), Taylor to degree 7 (|f ln2| <= 0.35)
  vfloat p = broadcast(1.5252733804059841e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vfloat r = p * scale;
  return x < lo ? vfloat{} : r;
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
