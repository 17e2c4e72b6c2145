// The KV cache sharded over W ranks for inference: which rank stores each token, where, and how
// queries attend to one rank's shard exactly.
//
// Owner rule. Token t (its global position in the sequence) lives on rank (t / I) % W, where
// I = interleave: blocks of I consecutive tokens are dealt round-robin (I = 1 deals single tokens,
// a large I keeps runs contiguous). On its owner it sits at local slot (t / (I W)) I + t % I, so a
// rank's slots fill in position order: the tokens of positions [0, n) it owns are exactly its
// first count(rank, n) slots, and the storage stays dense.
//
// Attention over a shard. A shard's slots are not at contiguous positions, but each block of I
// slots is (a run of stride 1), so the mask rule of mask.h applies to a run with the run's first
// position as key offset. The rule only has to be evaluated where it cuts: for queries at
// positions [p, p + Sq), the keys that every query sees (causal: positions <= p) form one slot
// range that needs no mask, whatever their positions; only the keys that some but not all queries
// see (causal: positions in (p, p + Sq), fewer than Sq) are attended run by run with the rule.
// A decode step is then one unmasked kernel call over the shard plus at most ceil(Sq / I) + 1
// small masked ones, with no gather of positions and no general key-position mapping.
#pragma once

#include <cstdint>

#include "cpattn/config.h"
#include "cpattn/mask.h"

namespace cpattn {

struct CacheSharding {
  int64_t world = 1;
  int64_t interleave = 1;

  CPATTN_HOST_DEVICE int64_t owner(int64_t t) const { return (t / interleave) % world; }
  CPATTN_HOST_DEVICE int64_t slot(int64_t t) const {
    return (t / (interleave * world)) * interleave + t % interleave;
  }
  // Inverse of slot() on `rank`: the position of the token in local slot s.
  CPATTN_HOST_DEVICE int64_t position(int64_t rank, int64_t s) const {
    return ((s / interleave) * world + rank) * interleave + s % interleave;
  }
  // Slots `rank` uses for the tokens of positions [0, n). Never larger on a later rank, so rank
  // 0's count is the slot count every rank needs.
  CPATTN_HOST_DEVICE int64_t count(int64_t rank, int64_t n) const {
    const int64_t round = interleave * world;
    const int64_t rem = n % round - rank * interleave;
    return (n / round) * interleave + (rem < 0 ? 0 : (rem > interleave ? interleave : rem));
  }
  // The longest sequence that fits in `slots` slots per rank (rank 0 fills up first).
  CPATTN_HOST_DEVICE int64_t max_tokens(int64_t slots) const {
    return (slots / interleave) * interleave * world + slots % interleave;
  }
};

// A part of one rank's shard: local slots [slot_begin, slot_end) attended by every query row with
// `mask` (query row 0 and slot_begin are the mask's local index 0).
struct CacheSpan {
  int64_t slot_begin;
  int64_t slot_end;
  Mask mask;
};

namespace detail {

// Spans for the positions [lo, hi] that `rank` owns, one per run of consecutive positions, each
// with the rule at the run's global offsets.
template <typename F>
CPATTN_HOST_DEVICE void masked_runs(const CacheSharding& s, int64_t rank, const Mask& rule,
                                    int64_t q_begin, int64_t num_q, int64_t lo, int64_t hi, F& f) {
  int64_t x = lo;
  while (x <= hi) {
    const int64_t block = x / s.interleave;
    const int64_t skip = ((rank - block % s.world) % s.world + s.world) % s.world;
    if (skip != 0) {  // jump to the next block this rank owns
      x = (block + skip) * s.interleave;
      continue;
    }
    const int64_t block_end = (block + 1) * s.interleave - 1;
    const int64_t end = block_end < hi ? block_end : hi;
    CacheSpan span;
    span.slot_begin = s.slot(x);
    span.slot_end = span.slot_begin + (end - x + 1);
    span.mask = rule;
    span.mask.q_offset = q_begin;
    span.mask.k_offset = x;
    if (span.mask.classify(0, num_q, 0, end - x + 1) != BlockKind::kEmpty) f(span);
    x = end + 1;
  }
}

}  // namespace detail

// Calls f(const CacheSpan&) for spans of `rank`'s shard that together cover, exactly once, every
// (query, key) pair visible under `rule` (its offsets are ignored) between the queries at
// positions [q_begin, q_begin + num_q) and the keys of positions [0, n) stored on `rank`.
// At most one span is unmasked (the keys every query sees); the others are runs of consecutive
// positions, each at most I slots long. `runs_only` (ALiBi: the score depends on each key's
// position) or a prefix in `rule` (it widens the visible keys beyond the intervals below):
// every span is such a run, with its mask on global positions.
template <typename F>
CPATTN_HOST_DEVICE void for_each_cache_span(const CacheSharding& s, int64_t rank, int64_t n,
                                            const Mask& rule, int64_t q_begin, int64_t num_q, F&& f,
                                            bool runs_only = false) {
  if (n <= 0 || num_q <= 0) return;
  if (runs_only || rule.has_prefix()) {
    detail::masked_runs(s, rank, rule, q_begin, num_q, 0, n - 1, f);
    return;
  }
  const int64_t i_first = q_begin, i_last = q_begin + num_q - 1;
  // Key positions some query sees, and those every query sees (both ends of a query's interval
  // grow with the query, see mask.h).
  int64_t any_lo = rule.first_key(i_first), any_hi = rule.last_key(i_last);
  any_lo = any_lo < 0 ? 0 : any_lo;
  any_hi = any_hi > n - 1 ? n - 1 : any_hi;
  if (any_lo > any_hi) return;
  int64_t all_lo = rule.first_key(i_last), all_hi = rule.last_key(i_first);
  all_lo = all_lo < any_lo ? any_lo : all_lo;
  all_hi = all_hi > any_hi ? any_hi : all_hi;
  if (all_lo > all_hi) {
    detail::masked_runs(s, rank, rule, q_begin, num_q, any_lo, any_hi, f);
    return;
  }
  detail::masked_runs(s, rank, rule, q_begin, num_q, any_lo, all_lo - 1, f);
  CacheSpan all;
  all.slot_begin = s.count(rank, all_lo);
  all.slot_end = s.count(rank, all_hi + 1);
  all.mask = Mask{};  // every query sees every key: positions do not matter
  if (all.slot_end > all.slot_begin) f(all);
  detail::masked_runs(s, rank, rule, q_begin, num_q, all_hi + 1, any_hi, f);
}

}  // namespace cpattn
