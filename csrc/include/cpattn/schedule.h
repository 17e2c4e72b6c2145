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
// written as a causal mask with a key offset (up) and a left window (up + down). A prefix
// (j < P) becomes the local keys b < ceil((P - rk) / W), shifted like the band.
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
    int64_t t = up_bounded ? -up : (down_bounded && down < 0 ? down : 0);
    m.causal = up_bounded;
    m.window_left = down_bounded ? down - t : -1;
    if (down_bounded && m.window_left < 0) {  // a - b <= down < -up: empty band
      if (!global.has_prefix()) return false;
      // only the prefix opens keys: a causal band shifted past every query sees nothing else
      m.causal = true;
      m.window_left = -1;
      t = kUnbounded / 2;
    }
    m.k_offset = t;
    // global key j = w b + rk < P  <=>  b < ceil((P - rk) / w)  <=>  b + t < that + t
    if (global.has_prefix()) m.prefix_end = floor_div(global.prefix_end - rk + w - 1, w) + t;
    *out = m;
  }
  return out->classify(0, q.length, 0, k.length) != BlockKind::kEmpty;
}

struct StepSchedule {
  int64_t source;  // rank whose K/V shard is used at this step
  int count;
  SubProblem items[4];
};

CPATTN_HOST_DEVICE StepSchedule schedule_step(Layout layout, int64_t seqlen, int64_t world,
                                              int64_t rank, int64_t step, const Mask& global) {
  StepSchedule sched;
  sched.source = ring_source(rank, step, world);
  sched.count = 0;
  const ShardRuns qs = shard_runs(layout, seqlen, world, rank);
  const ShardRuns ks = shard_runs(layout, seqlen, world, sched.source);
  for (int i = 0; i < qs.count; ++i)
    for (int j = 0; j < ks.count; ++j) {
      SubProblem sp;
      sp.q = qs.runs[i];
      sp.k = ks.runs[j];
      if (sub_problem_mask(global, sp.q, sp.k, &sp.mask)) sched.items[sched.count++] = sp;
    }
  return sched;
}

// The first `length` tokens of a run, or fewer: those at global positions below `limit`.
CPATTN_HOST_DEVICE int64_t run_length_below(const Run& run, int64_t limit) {
  if (run.global_begin >= limit) return 0;
  const int64_t n = (limit - run.global_begin + run.global_stride - 1) / run.global_stride;
  return n < run.length ? n : run.length;
}

// Packed variable-length sequences: document d has lengths[d] real tokens, padded up to a multiple
// of the layout granularity; each document is sharded on its own by the layout and a rank's shard
// is its part of document 0, then of document 1, ... Attention never crosses documents, and the
// padding at the end of a document is neither a query nor a key (runs are clipped to the real
// tokens), so padded rows stay empty (0 / -inf). Calls emit(SubProblem) for step `step`, with runs
// in shard-local indices (local_begin) and positions relative to the document.
// prefix_lens (optional, num_docs entries): document d's own prefix-LM length (0: none) in place
// of global.prefix_end.
template <typename Emit>
void schedule_step_varlen(Layout layout, const int64_t* lengths, int64_t num_docs, int64_t world,
                          int64_t rank, int64_t step, const Mask& global, Emit&& emit,
                          const int64_t* prefix_lens = nullptr) {
  int64_t global_begin = 0;
  for (int64_t d = 0; d < num_docs; ++d) {
    const DocumentShard doc = document_shard(layout, lengths[d], world, rank, global_begin);
    global_begin += doc.padded;
    if (doc.padded == 0) continue;
    Mask doc_mask = global;
    if (prefix_lens != nullptr)
      doc_mask.prefix_end = prefix_lens[d] > 0 ? prefix_lens[d] : -kUnbounded;
    const StepSchedule sched = schedule_step(layout, doc.padded, world, rank, step, doc_mask);
    for (int i = 0; i < sched.count; ++i) {
      SubProblem sp = sched.items[i];
      sp.q.length = run_length_below(sp.q, lengths[d]);
      sp.k.length = run_length_below(sp.k, lengths[d]);
      if (sp.mask.classify(0, sp.q.length, 0, sp.k.length) == BlockKind::kEmpty) continue;
      sp.q.local_begin += doc.local_begin;
      sp.k.local_begin += doc.local_begin;
      emit(sp);
    }
  }
}

}  // namespace cpattn
