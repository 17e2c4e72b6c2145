// A 16-lane fp32 vector through GCC/Clang vector extensions. Each kernels_<isa>.cpp compiles the
// kernel with its own -m flags, so the same code becomes AVX-512, AVX2 or SSE2 instructions.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include <cmath>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

constexpr int kLanes = 16;

// Uninitialised array aligned to 64 bytes (a cache line, one AVX-512 vector): operands and
// scratch that the micro-kernels stream through with full-vector loads must not straddle lines.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using AlignedArray = std::unique_ptr<T[], FreeDeleter>;
template <typename T>
AlignedArray<T> aligned_array(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes > 0 ? bytes : 64);
  if (!p) throw std::bad_alloc();
  return AlignedArray<T>(static_cast<T*>(p));
}
typedef float vfloat __attribute__((vector_size(64)));
// The widest vector this ISA holds in one register: 16 lanes with AVX-512, 8 with AVX, 4 with
// SSE2. The micro-kernel (micro_gemm.h) keeps its accumulators at this width: GCC lowers a
// 64-byte vfloat on AVX2 / SSE2 through the stack (lane-by-lane broadcasts, spilled halves),
// several times slower than the scalar code.
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#elif defined(__AVX__)
constexpr int kNativeLanes = 8;
#else
constexpr int kNativeLanes = 4;
#endif
typedef float vnative __attribute__((vector_size(4 * kNativeLanes)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vbits16 __attribute__((vector_size(32)));  // 16 bf16 or fp16 bit patterns

// Unaligned loads and stores of either width (memcpy: no alignment or aliasing assumptions).
template <typename V>
inline V load_vector(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename V>
inline void store_vector(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}
inline vfloat load(const float* p) { return load_vector<vfloat>(p); }
inline void store(float* p, vfloat v) { store_vector(p, v); }
inline vfloat broadcast(float x) { return vfloat{} + x; }
inline vnative load_native(const float* p) { return load_vector<vnative>(p); }
inline void store_native(float* p, vnative v) { store_vector(p, v); }
inline vnative broadcast_native(float x) { return vnative{} + x; }

// The bf16 bits of x, rounded to nearest even; a NaN stays a (quiet) NaN.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline vbits16 bf16_bits(vfloat x) {  // the same, 16 lanes at a time
  vuint u;
  std::memcpy(&u, &x, sizeof(u));
  const vuint rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vuint quiet_nan = (u >> 16) | 0x40u;
  return __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded, vbits16);
}

// An fp32 value as two 16-bit halves, the high one its bf16 truncation: fp32 sums beside a bf16
// result keep their high halves in the result itself and only the low ones apart (the backward's
// dK / dV sums, KeyGradSums; the ring's dQ), in half the bytes of an fp32 copy, the same bits.
inline vfloat join_halves(const uint16_t* high, const uint16_t* low) {  // 16 values
#ifdef __AVX512BW__  // one widening load each (the generic form splits into halves)
  const __m512i h =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)));
  const __m512i l =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low)));
  return (vfloat)_mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(h, 16), l));
#else
  vbits16 h, l;
  std::memcpy(&h, high, sizeof(h));
  std::memcpy(&l, low, sizeof(l));
  const vuint u = __builtin_convertvector(h, vuint) << 16 | __builtin_convertvector(l, vuint);
  vfloat x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}
inline void split_halves(vfloat x, uint16_t* high, uint16_t* low) {
#ifdef __AVX512BW__  // narrowing stores (vpmovdw truncates: the low halves as they are)
  const __m512i u = _mm512_castps_si512((__m512)x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(high),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(low), _mm512_cvtepi32_epi16(u));
#else
  vuint u;
  std::memcpy(&u, &x, sizeof(u));
  const vbits16 h = __builtin_convertvector(u >> 16, vbits16),
                l = __builtin_convertvector(u & 0xffffu, vbits16);
  std::memcpy(high, &h, sizeof(h));
  std::memcpy(low, &l, sizeof(l));
#endif
}
inline float join_halves(uint16_t high, uint16_t low) {  // one value
  const uint32_t u = static_cast<uint32_t>(high) << 16 | low;
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}
inline void split_halves(float x, uint16_t& high, uint16_t& low) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  high = static_cast<uint16_t>(u >> 16);
  low = static_cast<uint16_t>(u & 0xffffu);
}

// The fp16 bits of x, rounded to nearest even: beyond the fp16 range to +-inf, below 2^-14 to
// subnormals; a NaN stays a (quiet) NaN.
inline uint16_t fp16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (u < 0x38800000u) {                        // below 2^-14: a multiple of 2^-24
    float magnitude;
    std::memcpy(&magnitude, &u, sizeof(u));
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.f));
  }
  // rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits
  return sign | static_cast<uint16_t>((u + 0xfffu + ((u >> 13) & 1u) - 0x38000000u) >> 13);
}
inline vbits16 fp16_bits(vfloat x) {  // the same, 16 lanes at a time
  vbits16 bits;
#ifdef __AVX512F__
  const __m256i h = _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  std::memcpy(&bits, &h, sizeof(bits));
#elif defined(__F16C__)
  for (int half = 0; half < 2; ++half) {
    __m256 lanes;
    std::memcpy(&lanes, reinterpret_cast<const char*>(&x) + 32 * half, sizeof(lanes));
    const __m128i h = _mm256_cvtps_ph(lanes, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(reinterpret_cast<char*>(&bits) + 16 * half, &h, sizeof(h));
  }
#else
  for (int l = 0; l < kLanes; ++l) bits[l] = fp16_bits(x[l]);
#endif
  return bits;
}
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// 2^x = 2^n * 2^f with n = round(x), f in [-0.5, 0.5]; 2^f by a degree-5 polynomial fitted for
// relative error (max 2.3e-7 in fp32). 0 for x < -126 (and for -inf), so masked scores vanish
// exactly.
inline vfloat exp2_fraction(vfloat f) {
  vfloat p = broadcast(1.3266970636323094e-03f);
  p = p * f + 9.675459936261177e-03f;
  p = p * f + 5.550742521882057e-02f;
  p = p * f + 2.4022121727466583e-01f;
  p = p * f + 6.931469440460205e-01f;
  return p * f + 1.0000001192092896f;
}

#ifdef __AVX512F__
// AVX-512 has the two steps as instructions: vrndscaleps rounds, vscalefps multiplies by 2^n.
// A NaN stays NaN (vmaxps returns its second operand when one is NaN; NLT_UQ is true for NaN).
inline vfloat exp2(vfloat x) {
  const __m512 lo = _mm512_set1_ps(-126.f);
  const __m512 clamped = _mm512_max_ps(lo, (__m512)x);
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat p = exp2_fraction((vfloat)_mm512_sub_ps(clamped, n));
  const __mmask16 kept = _mm512_cmp_ps_mask((__m512)x, lo, _CMP_NLT_UQ);
  return (vfloat)_mm512_maskz_scalef_ps(kept, (__m512)p, n);
}
#else
inline vfloat exp2(vfloat x) {
  const vfloat lo = broadcast(-126.f);
  const vfloat clamped = x < lo ? lo : x;
  // n = round(x) via the 1.5 * 2^23 trick
  const vfloat magic = broadcast(12582912.f);
  const vfloat n = (clamped + magic) - magic;
  const vfloat p = exp2_fraction(clamped - n);
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vfloat r = p * scale;
  return x < lo ? vfloat{} : r;
}
#endif

inline vfloat vabs(vfloat x) { return x < 0.f ? -x : x; }

// tanh(x), max error about 2e-7 relative: an odd Taylor polynomial below |x| = 1/4 (where
// 1 - 2 / (e + 1) would lose the small result to cancellation), 1 - 2 / (exp(2x) + 1) above,
// with 2x clamped to +-40 (tanh is +-1 in fp32 there) so exp2 stays finite.
inline vfloat tanh(vfloat x) {
  const vfloat x2 = x * x;
  vfloat poly = broadcast(62.f / 2835.f);
  poly = poly * x2 - 17.f / 315.f;
  poly = poly * x2 + 2.f / 15.f;
  poly = poly * x2 - 1.f / 3.f;
  const vfloat small = x + x * x2 * poly;
  vfloat twice = x * 2.8853900817779268f;  // 2x log2(e)
  twice = twice > 57.7f ? broadcast(57.7f) : twice;
  twice = twice < -57.7f ? broadcast(-57.7f) : twice;
  const vfloat large = 1.f - 2.f / (exp2(twice) + 1.f);
  return vabs(x) < 0.25f ? small : large;
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
