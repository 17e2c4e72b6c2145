// The sharded KV cache (kv_cache.h): the owner rule and its slots are a bijection, and the spans of
// a shard cover every visible (query, key) pair exactly once over all ranks. Also the N-way merge
// of softmax_state.h against double math.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpattn/kv_cache.h"
#include "cpattn/softmax_state.h"

namespace cpattn {
namespace {

const float kNegInf = -std::numeric_limits<float>::infinity();

TEST(CacheSharding, SlotsAreDenseAndInvertible) {
  for (int64_t world : {1, 2, 3, 4, 7})
    for (int64_t il : {1, 2, 3, 16}) {
      const CacheSharding s{world, il};
      const int64_t n = 5 * il * world + 7;
      std::vector<int64_t> next(world, 0);  // next free slot per rank in position order
      for (int64_t t = 0; t < n; ++t) {
        const int64_t r = s.owner(t);
        ASSERT_EQ(r, (t / il) % world);
        ASSERT_EQ(s.slot(t), next[r]) << "slots fill in position order, W=" << world << " I=" << il;
        ASSERT_EQ(s.position(r, s.slot(t)), t);
        ++next[r];
        for (int64_t rank = 0; rank < world; ++rank)
          ASSERT_EQ(s.count(rank, t + 1), next[rank]) << "t=" << t << " rank " << rank;
      }
      for (int64_t slots = 0; slots < 3 * il; ++slots) {
        const int64_t m = s.max_tokens(slots);
        ASSERT_LE(s.count(0, m), slots);
        ASSERT_GT(s.count(0, m + 1), slots) << "max_tokens is the largest that fits";
      }
    }
}

struct RuleCase {
  bool causal;
  int64_t left, right;
  int64_t prefix = -kUnbounded;
};

// Over all ranks, the spans compute each visible pair once and no hidden pair; at most one span
// per rank is unmasked.
// runs_only (ALiBi) or a prefix: every span is a run of consecutive positions.
void check_spans(int64_t world, int64_t il, int64_t n, int64_t q_begin, int64_t num_q,
                 const RuleCase& rc, bool runs_only = false) {
  const CacheSharding s{world, il};
  Mask rule;
  rule.causal = rc.causal;
  rule.window_left = rc.left;
  rule.window_right = rc.right;
  rule.prefix_end = rc.prefix;
  const bool only_runs = runs_only || rule.has_prefix();
  std::vector<int> seen(num_q * n, 0);
  for (int64_t rank = 0; rank < world; ++rank) {
    int unmasked = 0;
    int64_t last_end = 0;
    for_each_cache_span(
        s, rank, n, rule, q_begin, num_q,
        [&](const CacheSpan& sp) {
          ASSERT_GE(sp.slot_begin, last_end) << "spans are disjoint and ordered";
          ASSERT_LE(sp.slot_end, s.count(rank, n));
          last_end = sp.slot_end;
          const bool plain =
              !only_runs && !sp.mask.causal && sp.mask.window_left < 0 && sp.mask.window_right < 0;
          unmasked += plain;
          if (!plain) {  // a masked span is a run of consecutive positions
            const int64_t p0 = s.position(rank, sp.slot_begin);
            ASSERT_EQ(s.position(rank, sp.slot_end - 1), p0 + sp.slot_end - 1 - sp.slot_begin);
          }
          for (int64_t a = 0; a < num_q; ++a)
            for (int64_t c = 0; c < sp.slot_end - sp.slot_begin; ++c) {
              if (!sp.mask.visible(a, c)) continue;
              const int64_t j = s.position(rank, sp.slot_begin + c);
              ASSERT_TRUE(rule.visible_pos(q_begin + a, j))
                  << "hidden pair i=" << q_begin + a << " j=" << j << " rank " << rank;
              ++seen[a * n + j];
            }
        },
        runs_only);
    ASSERT_LE(unmasked, 1);
  }
  for (int64_t a = 0; a < num_q; ++a)
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(seen[a * n + j], rule.visible_pos(q_begin + a, j) ? 1 : 0)
          << "pair i=" << q_begin + a << " j=" << j << " W=" << world << " I=" << il << " n=" << n
          << " causal=" << rc.causal << " window=(" << rc.left << "," << rc.right << ")"
          << " prefix=" << rc.prefix << " runs_only=" << runs_only;
}

TEST(CacheSpans, RunsOnlyAndPrefixCoverEveryVisiblePairOnce) {
  const RuleCase rules[] = {{true, -1, -1},    {false, -1, -1},   {true, 6, -1},
                            {true, -1, -1, 5}, {true, 2, -1, 30}, {true, -1, -1, 75}};
  for (int64_t world : {1, 2, 3})
    for (int64_t il : {1, 5, 16})
      for (int64_t n : {1, 40, 70})
        for (int64_t num_q : {1, 3})
          for (const RuleCase& rc : rules)
            for (bool runs_only : {false, true}) {
              check_spans(world, il, n, n - num_q < 0 ? 0 : n - num_q, num_q, rc, runs_only);
              check_spans(world, il, n, n / 3, num_q, rc, runs_only);
            }
}

TEST(CacheSpans, CoverEveryVisiblePairOnce) {
  const RuleCase rules[] = {{true, -1, -1}, {false, -1, -1}, {true, 6, -1},
                            {false, 4, 3},  {true, 0, -1},   {false, -1, 0}};
  for (int64_t world : {1, 2, 3, 4})
    for (int64_t il : {1, 2, 5, 16})
      for (int64_t n : {1, 7, 40, 70})
        for (int64_t num_q : {1, 3, 9})
          for (const RuleCase& rc : rules) {
            check_spans(world, il, n, n - num_q < 0 ? 0 : n - num_q, num_q, rc);  // decode
            check_spans(world, il, n, n, num_q, rc);  // queries after the cached keys (prefill)
            check_spans(world, il, n, n / 3, num_q, rc);
          }
}

TEST(CacheSpans, DecodeIsOneUnmaskedCallPlusShortRuns) {
  // Causal decode of 4 tokens at the end of 1000 cached ones, token-level round robin over 4
  // ranks: one unmasked span of all older keys, and one single-slot run per newer token.
  const CacheSharding s{4, 1};
  Mask causal;
  causal.causal = true;
  for (int64_t rank = 0; rank < 4; ++rank) {
    std::vector<CacheSpan> spans;
    for_each_cache_span(s, rank, 1000, causal, 996, 4,
                        [&](const CacheSpan& sp) { spans.push_back(sp); });
    int64_t slots = 0;
    for (const CacheSpan& sp : spans) slots += sp.slot_end - sp.slot_begin;
    EXPECT_EQ(slots, 250);
    EXPECT_FALSE(spans[0].mask.causal);
    EXPECT_EQ(spans.size(), rank == 0 ? 1u : 2u);  // position 996 (rank 0) all queries see
  }
}

// ---- N-way merge ------------------------------------------------------------------------------

TEST(MergeWeightsN, MatchesDoubleMath) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 4.f);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t n = 1 + trial % 6;
    std::vector<float> lse(2 * n, 123.f), w(n);  // stride 2: the odd entries must not be read
    for (int64_t i = 0; i < n; ++i)              // a part empty now and then
      lse[2 * i] = (trial % 5 == 0 && i == 0 && n > 1) ? kNegInf : normal(rng);
    const float merged = merge_weights_n(lse.data(), n, 2, w.data());
    double mx = -INFINITY, sum = 0;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(lse[2 * i]));
    for (int64_t i = 0; i < n; ++i) sum += std::exp(double(lse[2 * i]) - mx);
    const double want = mx + std::log(sum);
    EXPECT_NEAR(merged, want, 1e-5 * std::max(1.0, std::fabs(want)));
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(w[i], std::exp(double(lse[2 * i]) - want), 1e-6);
      EXPECT_NEAR(merged_weight(lse[2 * i], merged), w[i], 1e-5);
      total += w[i];
    }
    EXPECT_NEAR(total, 1.0, 1e-6);
  }
}

TEST(MergeWeightsN, TwoPartsAreExactlyTheTwoWayMerge) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 10.f);
  for (int trial = 0; trial < 1000; ++trial) {
    float lse[2] = {normal(rng), trial % 7 == 0 ? kNegInf : normal(rng)};
    float w[2];
    const float merged = merge_weights_n(lse, 2, 1, w);
    const MergeWeights two = merge_weights(lse[0], lse[1]);
    EXPECT_EQ(merged, two.lse);
    EXPECT_EQ(w[0], two.weight_a);
    EXPECT_EQ(w[1], two.weight_b);
  }
}

TEST(MergeWeightsN, EmptyPartsAndLargeMagnitudes) {
  float all_empty[3] = {kNegInf, kNegInf, kNegInf}, w[4] = {7.f, 7.f, 7.f, 7.f};
  const float lse = merge_weights_n(all_empty, 3, 1, w);
  EXPECT_TRUE(std::isinf(lse) && lse < 0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(w[i], 0.f);
  EXPECT_EQ(merged_weight(kNegInf, lse), 0.f);

  float one[3] = {kNegInf, 2.5f, kNegInf};
  EXPECT_EQ(merge_weights_n(one, 3, 1, w), 2.5f);
  EXPECT_EQ(w[0], 0.f);
  EXPECT_EQ(w[1], 1.f);
  EXPECT_EQ(w[2], 0.f);

  float big[4] = {1e4f, 1e4f - 1.f, 3e38f, 3e38f};  // exp of these overflows float
  const float m = merge_weights_n(big, 4, 1, w);
  EXPECT_TRUE(std::isfinite(m));
  EXPECT_NEAR(w[2], 0.5f, 1e-6);
  EXPECT_EQ(w[0], 0.f);
}

}  // namespace
}  // namespace cpattn
