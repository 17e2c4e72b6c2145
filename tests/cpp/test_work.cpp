// The cost model's work counts (cpattn/work.h) against brute-force counts over the schedule.
#include <gtest/gtest.h>

#include "cpattn/work.h"

namespace cpattn {
namespace {

TEST(Work, SumClampedMatchesLoop) {
  for (int64_t a = -20; a <= 20; ++a)
    for (int64_t n = 0; n <= 12; ++n)
      for (int64_t lo = -2; lo <= 6; ++lo)
        for (int64_t hi = lo; hi <= 9; ++hi) {
          int64_t want = 0;
          for (int64_t r = 0; r < n; ++r) want += min_i64(max_i64(a + r, lo), hi);
          ASSERT_EQ(sum_clamped(a, n, lo, hi), want) << a << " " << n << " " << lo << " " << hi;
        }
}

TEST(Work, StepWorkCountsEveryVisiblePairAndTile) {
  const struct {
    bool causal;
    int64_t left, right;
  } masks[] = {{false, -1, -1}, {true, -1, -1}, {true, 5, -1},
               {false, 7, 3},   {true, 0, -1},  {false, -1, 2}};
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (int64_t world = 1; world <= 5; ++world)
      for (const auto& mc : masks) {
        Mask global;
        global.causal = mc.causal;
        global.window_left = mc.left;
        global.window_right = mc.right;
        const int64_t seqlen = 2 * world * 7;
        int64_t total = 0;
        for (int64_t rank = 0; rank < world; ++rank)
          for (int64_t step = 0; step < world; ++step) {
            const StepSchedule sched = schedule_step(layout, seqlen, world, rank, step, global);
            int64_t pairs = 0, tiles = 0;
            for (int n = 0; n < sched.count; ++n) {
              const SubProblem& sp = sched.items[n];
              for (int64_t a = 0; a < sp.q.length; ++a)
                for (int64_t b = 0; b < sp.k.length; ++b) pairs += sp.mask.visible(a, b);
              for (int64_t r0 = 0; r0 < sp.q.length; r0 += 4)
                for (int64_t c0 = 0; c0 < sp.k.length; c0 += 3)
                  if (!tile_is_empty(sp.mask, r0, 4, c0, 3, sp.q.length, sp.k.length))
                    tiles +=
                        (min_i64(r0 + 4, sp.q.length) - r0) * (min_i64(c0 + 3, sp.k.length) - c0);
            }
            const Work w = step_work(layout, seqlen, nullptr, 0, world, rank, step, global, 4, 3);
            ASSERT_EQ(w.pairs, pairs) << "rank " << rank << " step " << step;
            ASSERT_EQ(w.tile_pairs, tiles) << "rank " << rank << " step " << step;
            ASSERT_EQ(w.calls, sched.count);
            total += w.pairs;
          }
        int64_t visible = 0;
        for (int64_t i = 0; i < seqlen; ++i)
          for (int64_t j = 0; j < seqlen; ++j) visible += global.visible_pos(i, j);
        ASSERT_EQ(total, visible) << "layout " << static_cast<int>(layout) << " W " << world;
      }
}

}  // namespace
}  // namespace cpattn
