// What the emulated kernel tests share on the host: the emulated launch with the launchers'
// geometry, the 16-bit element types' conversions (and the tests' tolerances in each), and
// random operands with their exact values. Included after the kernels' headers.
#pragma once

#include <functional>
#include <random>
#include <type_traits>
#include <vector>

namespace cpattn::cuda {

// Runs body on the host emulation with the launch geometry the launchers use (kernel_config.h).
inline void launch(const LaunchShape& l, const std::function<void()>& body) {
  emu::launch({l.grid[0], l.grid[1], l.grid[2]}, l.threads, l.smem_bytes, body);
}

// The 16-bit element types on the host: rounding from float, the exact value back, the dtype
// code, and the tests' tolerances for outputs and gradients in that type.
template <typename Elem>
struct Host {
  static constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<Elem, __half>, "bf16 or fp16 elements only");
  static Elem enc(float x) {
    if constexpr (kBf16)
      return __float2bfloat16_rn(x);
    else
      return __float2half_rn(x);
  }
  static double dec(Elem x) {
    if constexpr (kBf16)
      return __bfloat162float(x);
    else
      return __half2float(x);
  }
  static constexpr DType kType = kBf16 ? DType::kBFloat16 : DType::kFloat16;
  static constexpr double kOutTol = kBf16 ? 1e-2 : 2e-3, kGradTol = kBf16 ? 2e-2 : 4e-3;
};

// n standard-normal values rounded to Elem, and in `values` the exact values they hold.
template <typename Elem>
std::vector<Elem> random_elems(size_t n, std::mt19937& rng, std::vector<double>* values) {
  std::normal_distribution<float> nd;
  std::vector<Elem> x(n);
  values->resize(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = Host<Elem>::enc(nd(rng));
    (*values)[i] = Host<Elem>::dec(x[i]);
  }
  return x;
}

}  // namespace cpattn::cuda
