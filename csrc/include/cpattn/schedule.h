// The ring schedule: at step t rank r holds the K/V shard of rank (r - t) mod W, and computes the
// sub-problems (a run of its queries x a run of the visiting keys) that the mask leaves non-empty,
// each with a local Mask that expresses the global rule (mask.h) in the sub-problem's indices.
#pragma once

#include <cstdint>

#include "cpattn/layout.h"
#include "cpattn/mask.h"

namespace cpattn {

CPATTN_HOST_DEVICE int64_t ring_source(int64_t rank, int64_t step, int64_t world) {
  return ((rank - step) % world + world) % world;
}

CPATTN_HOST_DEVICE int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

struct SubProblem {
  Run q;      // rows of the local queries
  Run k;      // rows of the visiting K/V shard
  Mask mask;  // the rule on the sub-problem's local indices (row 0 = q.local_begin)
};

// The local mask of queries in run q against keys in run k, or false when no pair is visible.
// Unit-stride runs keep the global rule with the runs' global starts as offsets. Striped runs
// (stride W, query a at W*a + rq, key b at W*b + rk) turn the rule into a band on local indices:
//   b - a <= up    from causal (j <= i) and the right window (j <= i + right),
//   a - b <= down  from the left window (j >= i - left),
// with up = floor((bound + rq - rk) / W) and down = floor((left + rk - rq) / W); the band is then
// written as a causal mask with a key offset (up) and a left window (up + down).
CPATTN_HOST_DEVICE bool sub_problem_mask(const Mask& global, const Run& q, const Run& k,
                                         Mask* out) {
  if (q.global_stride == 1) {
    *out = global;
    out->q_offset = q.global_begin;
    out->k_offset = k.global_begin;
  } else {
    const int64_t w = q.global_stride;
    const int64_t rq = q.global_begin, rk = k.global_begin;
    bool up_bounded = false;
    int64_t up = 0;
    if (global.causal) {
      up_bounded = true;
      up = floor_div(rq - rk, w);
    }
    if (global.window_right >= 0) {
      const int64_t r = floor_div(global.window_right + rq - rk, w);
      up = up_bounded && up < r ? up : r;
      up_bounded = true;
    }
    const bool down_bounded = global.window_left >= 0;
    const int64_t down = down_bounded ? floor_div(global.window_left + rk - rq, w) : 0;
    Mask m;
    m.q_offset = 0;
    m.window_right = -1;
    // keys shifted by t: local key b is at b + t; the band is then {a - left' <= b + t <= a}.
    const int64_t t = up_bounded ? -up : (down_bounded && down < 0 ? down : 0);
    m.causal = up_bounded;
    m.k_offset = t;
    m.window_left = down_bounded ? down - t : -1;
    if (down_bounded && m.window_left < 0) return false;  // a - b <= down < -up: empty band
    *out = m;
  }
  return out->classify(0, q.length, 0, k.length) != BlockKind::kEmpty;
}

struct StepPlan {
  int64_t source;  // rank whose K/V shard is used at this step
  int count;
  SubProblem items[4];
};

CPATTN_HOST_DEVICE StepPlan plan_step(Layout layout, int64_t seqlen, int64_t world, int64_t rank,
                                      int64_t step, const Mask& global) {
  StepPlan plan;
  plan.source = ring_source(rank, step, world);
  plan.count = 0;
  const ShardRuns qs = shard_runs(layout, seqlen, world, rank);
  const ShardRuns ks = shard_runs(layout, seqlen, world, plan.source);
  for (int i = 0; i < qs.count; ++i)
    for (int j = 0; j < ks.count; ++j) {
      SubProblem sp;
      sp.q = qs.runs[i];
      sp.k = ks.runs[j];
      if (sub_problem_mask(global, sp.q, sp.k, &sp.mask)) plan.items[plan.count++] = sp;
    }
  return plan;
}

}  // namespace cpattn
