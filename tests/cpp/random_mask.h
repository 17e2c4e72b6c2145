// Random masks for the header tests (test_mask.cpp, test_tiling.cpp): causal or not, each window
// side unbounded (1 in 4) or in [0, window_max], both offsets in [offset_lo, offset_hi].
// uniform(lo, hi) draws an integer in [lo, hi]; the draws come in this order.
#pragma once

#include <cstdint>

#include "cpattn/mask.h"

namespace cpattn {

template <typename Uniform>
Mask random_mask(Uniform&& uniform, int64_t window_max, int64_t offset_lo, int64_t offset_hi) {
  Mask m;
  m.causal = uniform(0, 1) == 1;
  m.window_left = uniform(0, 3) == 0 ? -1 : uniform(0, window_max);
  m.window_right = uniform(0, 3) == 0 ? -1 : uniform(0, window_max);
  m.q_offset = uniform(offset_lo, offset_hi);
  m.k_offset = uniform(offset_lo, offset_hi);
  return m;
}

}  // namespace cpattn
