// How much attention work the ring schedule gives a rank at a step, for the cost model
// (python/cpattn/plan/work.py): the visible (query, key) pairs, and the pairs in the tiles a kernel
// with block_m x block_n tiles visits (a visited tile costs its full area, masked or not).
#pragma once

#include <cstdint>

#include "cpattn/schedule.h"
#include "cpattn/tiling.h"

namespace cpattn {

struct Work {
  int64_t pairs = 0;       // visible (query, key) pairs
  int64_t tile_pairs = 0;  // pairs in visited tiles (>= pairs)
  int64_t calls = 0;       // kernel calls (sub-problems)
};

// sum_{r=0}^{n-1} clamp(a + r, lo, hi), in O(1); lo <= hi.
inline int64_t sum_clamped(int64_t a, int64_t n, int64_t lo, int64_t hi) {
  if (n <= 0) return 0;
  const int64_t below = min_i64(n, max_i64(lo - a, 0));      // terms a + r < lo
  const int64_t above = min_i64(n, max_i64(a + n - hi, 0));  // terms a + r > hi
  const int64_t mid_first = below, mid_last = n - above;     // r in [mid_first, mid_last)
  int64_t sum = below * lo + above * hi;
  if (mid_last > mid_first) {
    const int64_t count = mid_last - mid_first;
    sum += count * a + (mid_first + mid_last - 1) * count / 2;
  }
  return sum;
}

// Work of one sub-problem: nq local queries x nk local keys under mask m.
inline Work sub_problem_work(const Mask& m, int64_t nq, int64_t nk, int block_m, int block_n) {
  Work w;
  if (nq <= 0 || nk <= 0) return w;
  // Row r sees the local keys [clamp(first - k_offset, 0, nk), clamp(last - k_offset, -1, nk-1)];
  // the interval is never reversed by more than one (mask.h), so the count is hi - lo + 1 >= 0.
  // Unbounded ends are +-kUnbounded, far from overflow.
  const int64_t d = m.q_offset - m.k_offset;
  const int64_t first = m.window_left >= 0 ? d - m.window_left : -kUnbounded;
  int64_t last = m.window_right >= 0 ? d + m.window_right : kUnbounded;
  if (m.causal && d < last) last = d;
  w.pairs = sum_clamped(last, nq, -1, nk - 1) - sum_clamped(first, nq, 0, nk) + nq;
  // The keys a block of rows sees form one interval (the rows' intervals move by one per row and
  // are never empty), so every key block between its first and last is visited.
  for (int64_t r0 = 0; r0 < nq; r0 += block_m) {
    const int64_t r1 = min_i64(r0 + block_m, nq);
    const BlockRange kb = key_blocks_of_rows(m, r0, r1, nk, block_n);
    if (kb.empty()) continue;
    const int64_t c0 = static_cast<int64_t>(kb.first) * block_n;
    const int64_t c1 = min_i64((static_cast<int64_t>(kb.last) + 1) * block_n, nk);
    w.tile_pairs += (r1 - r0) * (c1 - c0);
  }
  w.calls = w.pairs > 0 ? 1 : 0;
  return w;
}

// Work of `rank` at ring step `step` (the sub-problems schedule_step gives); lengths/num_docs != 0:
// the packed documents of schedule_step_varlen instead of one sequence of `seqlen` tokens.
inline Work step_work(Layout layout, int64_t seqlen, const int64_t* lengths, int64_t num_docs,
                      int64_t world, int64_t rank, int64_t step, const Mask& global, int block_m,
                      int block_n) {
  Work total;
  auto add = [&](const SubProblem& sp) {
    const Work w = sub_problem_work(sp.mask, sp.q.length, sp.k.length, block_m, block_n);
    total.pairs += w.pairs;
    total.tile_pairs += w.tile_pairs;
    total.calls += w.calls;
  };
  if (num_docs > 0) {
    schedule_step_varlen(layout, lengths, num_docs, world, rank, step, global, add);
  } else {
    const StepSchedule sched = schedule_step(layout, seqlen, world, rank, step, global);
    for (int i = 0; i < sched.count; ++i) add(sched.items[i]);
  }
  return total;
}

}  // namespace cpattn
