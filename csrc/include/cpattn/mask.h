// The attention mask rule, defined once on global token positions.
//
// Key at global position j is visible to the query at global position i iff
//   j < prefix_end  or  [(not causal or j <= i)  and  (left < 0 or j >= i - left)  and
//                        (right < 0 or j <= i + right)].
// The prefix (prefix-LM: keys below P are seen by every query, e.g. causal=true with P gives
// bidirectional attention inside the prompt) is off by default (prefix_end = -kUnbounded: local
// masks may hold negative positions, so 0 would not do).
// Local query row r sits at global position q_offset + r; local key column c at k_offset + c.
// A ring step, a zigzag segment or bottom-right alignment is only a choice of the two offsets.
//
// Without a prefix, the visible keys of each query form an interval [first_key(i), last_key(i)]
// that is never empty on the unbounded position line, and both its ends grow by one per query
// (and likewise for the queries that see a key). Block spans and block classification rest on
// that; the prefix adds the fixed key interval [.., prefix_end) to every query's set, which the
// spans and the classification below take as a union.
#pragma once

#include <cstdint>

#include "cpattn/config.h"

namespace cpattn {

// An inclusive range of local indices; empty when first > last.
struct PosRange {
  int64_t first;
  int64_t last;
  CPATTN_HOST_DEVICE bool empty() const { return first > last; }
};

enum class BlockKind : int { kEmpty = 0, kPartial = 1, kFull = 2 };

constexpr int64_t kUnbounded = INT64_MAX / 4;  // stands for +-infinity, safe to add offsets to
// Token positions (offsets, and offsets plus lengths) must stay within +-kMaxPosition, so that the
// sentinels above lie beyond every position and position +- window never overflows.
constexpr int64_t kMaxPosition = kUnbounded - 1;

// A window side that reaches kUnbounded reaches past every position: it means unbounded (-1).
CPATTN_HOST_DEVICE int64_t normalized_window(int64_t side) {
  return side >= kUnbounded ? -1 : side;
}

struct Mask {
  bool causal = false;
  int64_t window_left = -1;          // -1: unbounded
  int64_t window_right = -1;         // -1: unbounded
  int64_t q_offset = 0;              // global position of local query 0
  int64_t k_offset = 0;              // global position of local key 0
  int64_t prefix_end = -kUnbounded;  // keys at positions < prefix_end are seen by every query

  CPATTN_HOST_DEVICE bool has_prefix() const { return prefix_end > -kUnbounded; }

  // Visible key positions of query position i: [first_key(i), last_key(i)].
  CPATTN_HOST_DEVICE int64_t first_key(int64_t i) const {
    return window_left >= 0 ? i - window_left : -kUnbounded;
  }
  CPATTN_HOST_DEVICE int64_t last_key(int64_t i) const {
    int64_t hi = window_right >= 0 ? i + window_right : kUnbounded;
    if (causal && i < hi) hi = i;
    return hi;
  }
  // Query positions that see key position j: [first_query(j), last_query(j)].
  CPATTN_HOST_DEVICE int64_t first_query(int64_t j) const {
    int64_t lo = window_right >= 0 ? j - window_right : -kUnbounded;
    if (causal && j > lo) lo = j;
    return lo;
  }
  CPATTN_HOST_DEVICE int64_t last_query(int64_t j) const {
    return window_left >= 0 ? j + window_left : kUnbounded;
  }

  CPATTN_HOST_DEVICE bool visible_pos(int64_t i, int64_t j) const {
    return j < prefix_end || (j >= first_key(i) && j <= last_key(i));
  }
  // Local indices: query row r, key column c.
  CPATTN_HOST_DEVICE bool visible(int64_t r, int64_t c) const {
    return visible_pos(q_offset + r, k_offset + c);
  }
  // How many of the keys at positions [0, num_keys) query position i sees: its interval, and
  // the prefix keys outside it (the cost model's count, op visible_keys).
  CPATTN_HOST_DEVICE int64_t visible_key_count(int64_t i, int64_t num_keys) const {
    const int64_t lo = first_key(i) > 0 ? first_key(i) : 0;
    const int64_t hi = last_key(i) < num_keys - 1 ? last_key(i) : num_keys - 1;
    int64_t count = hi >= lo ? hi - lo + 1 : 0;
    const int64_t prefix = prefix_end < num_keys ? prefix_end : num_keys;  // keys [0, prefix)
    if (prefix > 0) {
      const int64_t shared_hi = hi < prefix - 1 ? hi : prefix - 1;  // prefix keys in [lo, hi]
      count += prefix - (shared_hi >= lo ? shared_hi - lo + 1 : 0);
    }
    return count;
  }

  // Local key columns that some query row in [r0, r1) sees, clipped to [0, num_keys): from the
  // first to the last such column (with a prefix it may hold columns between the prefix and the
  // rows' intervals that no row sees).
  CPATTN_HOST_DEVICE PosRange key_span(int64_t r0, int64_t r1, int64_t num_keys) const {
    PosRange span =
        clip(first_key(q_offset + r0) - k_offset, last_key(q_offset + r1 - 1) - k_offset, num_keys);
    if (k_offset < prefix_end) {  // the prefix keys [0, prefix_end - k_offset) join the span
      const PosRange prefix = clip(0, prefix_end - 1 - k_offset, num_keys);
      if (span.empty()) return prefix;
      span.first = 0;
      span.last = span.last > prefix.last ? span.last : prefix.last;
    }
    return span;
  }
  // Local query rows that see some key column in [c0, c1), clipped to [0, num_queries).
  CPATTN_HOST_DEVICE PosRange query_span(int64_t c0, int64_t c1, int64_t num_queries) const {
    if (k_offset + c0 < prefix_end) return clip(0, num_queries - 1, num_queries);
    return clip(first_query(k_offset + c0) - q_offset, last_query(k_offset + c1 - 1) - q_offset,
                num_queries);
  }

  // Classifies the block of local query rows [r0, r1) x local key columns [c0, c1): empty when
  // the union of the rows' intervals misses the keys, full when every row's interval covers them.
  // With a prefix, the keys in it are visible to every row and the rest follow the intervals.
  CPATTN_HOST_DEVICE BlockKind classify(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (r0 >= r1 || c0 >= c1) return BlockKind::kEmpty;
    const int64_t i_first = q_offset + r0, i_last = q_offset + r1 - 1;
    const int64_t j_first = k_offset + c0, j_last = k_offset + c1 - 1;
    if (j_last < prefix_end) return BlockKind::kFull;
    const int64_t j_rule = j_first < prefix_end ? prefix_end : j_first;  // keys [j_rule, j_last]
    if (last_key(i_last) < j_rule || first_key(i_first) > j_last)        // follow the rule
      return j_first < prefix_end ? BlockKind::kPartial : BlockKind::kEmpty;
    if (first_key(i_last) <= j_rule && last_key(i_first) >= j_last) return BlockKind::kFull;
    return BlockKind::kPartial;
  }

 private:
  CPATTN_HOST_DEVICE static PosRange clip(int64_t lo, int64_t hi, int64_t n) {
    return {lo < 0 ? 0 : lo, hi > n - 1 ? n - 1 : hi};
  }
};

// flash-attn's convention for a local call with seqlen_q != seqlen_k: the last query lines up with
// the last key (query r sits at position r + seqlen_k - seqlen_q).
CPATTN_HOST_DEVICE Mask bottom_right_mask(bool causal, int64_t window_left, int64_t window_right,
                                          int64_t seqlen_q, int64_t seqlen_k) {
  Mask m;
  m.causal = causal;
  m.window_left = window_left;
  m.window_right = window_right;
  m.q_offset = seqlen_k - seqlen_q;
  m.k_offset = 0;
  return m;
}

}  // namespace cpattn
