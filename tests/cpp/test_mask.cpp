// The mask rule and the block spans / classification derived from it, against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>

#include "cpattn/mask.h"
#include "random_mask.h"

namespace cpattn {
namespace {

// The rule as docs/design.md states it, on global positions (query i, key j).
bool brute_visible(const Mask& m, int64_t i, int64_t j) {
  if (j < m.prefix_end) return true;  // prefix-LM: seen by every query
  return (!m.causal || j <= i) && (m.window_left < 0 || j >= i - m.window_left) &&
         (m.window_right < 0 || j <= i + m.window_right);
}
bool brute_local(const Mask& m, int64_t r, int64_t c) {
  return brute_visible(m, m.q_offset + r, m.k_offset + c);
}

struct Problem {
  Mask mask;
  int64_t seqlen_q;
  int64_t seqlen_k;
};

// Random masks with small windows and offsets so that every kind of block shows up.
class RandomProblems {
 public:
  explicit RandomProblems(uint64_t seed) : rng_(seed) {}
  Problem next() {
    Problem p;
    p.mask = random_mask([this](int64_t lo, int64_t hi) { return uniform(lo, hi); }, 20, -40, 60);
    if (uniform(0, 2) == 0) p.mask.prefix_end = uniform(-45, 80);
    p.seqlen_q = uniform(1, 40);
    p.seqlen_k = uniform(1, 40);
    return p;
  }
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }

 private:
  std::mt19937_64 rng_;
};

constexpr int kTrials = 2000;

TEST(Mask, VisibleMatchesRule) {
  RandomProblems gen(1);
  for (int t = 0; t < kTrials; ++t) {
    const Problem p = gen.next();
    for (int64_t r = 0; r < p.seqlen_q; ++r)
      for (int64_t c = 0; c < p.seqlen_k; ++c)
        ASSERT_EQ(p.mask.visible(r, c), brute_local(p.mask, r, c))
            << "trial " << t << " r " << r << " c " << c;
  }
}

TEST(Mask, VisiblePosSpotChecks) {
  Mask m;  // no mask: everything visible, whatever the positions
  EXPECT_TRUE(m.visible_pos(-1000000, 1000000));
  m.causal = true;
  EXPECT_TRUE(m.visible_pos(5, 5));
  EXPECT_TRUE(m.visible_pos(5, -100));
  EXPECT_FALSE(m.visible_pos(5, 6));
  m.window_left = 2;
  EXPECT_TRUE(m.visible_pos(5, 3));
  EXPECT_FALSE(m.visible_pos(5, 2));
  m = Mask{};
  m.window_left = 0;
  m.window_right = 0;  // the diagonal only
  EXPECT_TRUE(m.visible_pos(7, 7));
  EXPECT_FALSE(m.visible_pos(7, 6));
  EXPECT_FALSE(m.visible_pos(7, 8));
  m = Mask{};
  m.window_right = 3;  // right only: no limit to the left
  EXPECT_TRUE(m.visible_pos(10, -1000));
  EXPECT_TRUE(m.visible_pos(10, 13));
  EXPECT_FALSE(m.visible_pos(10, 14));
}

TEST(Mask, HugePositionsDoNotOverflow) {
  Mask m;
  m.causal = true;
  m.q_offset = int64_t{1} << 50;
  m.k_offset = (int64_t{1} << 50) - 10;
  EXPECT_TRUE(m.visible(0, 0));
  EXPECT_TRUE(m.visible(0, 10));
  EXPECT_FALSE(m.visible(0, 11));
  const PosRange keys = m.key_span(0, 4, 100);
  EXPECT_EQ(keys.first, 0);
  EXPECT_EQ(keys.last, 13);
  m.k_offset = -(int64_t{1} << 50);
  EXPECT_EQ(m.classify(0, 64, 0, 128), BlockKind::kFull);
}

TEST(Mask, WindowsBeyondEveryPositionAreUnbounded) {
  EXPECT_EQ(normalized_window(-1), -1);
  EXPECT_EQ(normalized_window(0), 0);
  EXPECT_EQ(normalized_window(kUnbounded - 1), kUnbounded - 1);
  EXPECT_EQ(normalized_window(kUnbounded), -1);
  EXPECT_EQ(normalized_window(INT64_MAX), -1);  // i + window would overflow
  // At the position limits nothing overflows: a finite window just below kUnbounded stays
  // exact, a normalised one is unbounded.
  Mask m;
  m.window_left = normalized_window(kUnbounded - 1);  // == kMaxPosition: finite
  m.window_right = normalized_window(INT64_MAX);
  EXPECT_TRUE(m.visible_pos(kMaxPosition, 0));
  EXPECT_FALSE(m.visible_pos(kMaxPosition, -1));
  EXPECT_TRUE(m.visible_pos(-kMaxPosition, kMaxPosition));
  m.causal = true;
  EXPECT_FALSE(m.visible_pos(-kMaxPosition, kMaxPosition));
  EXPECT_EQ(m.classify(0, 64, 0, 64), BlockKind::kPartial);
}

// Brute-force [min, max] of the key columns that rows [a, b) see (key_span), or of the query
// rows that see key columns [a, b) (query span); empty when none.
PosRange brute_span(const Problem& p, bool key_span, int64_t a, int64_t b) {
  const int64_t other = key_span ? p.seqlen_k : p.seqlen_q;
  PosRange s{other, -1};
  for (int64_t x = a; x < b; ++x)
    for (int64_t y = 0; y < other; ++y)
      if (key_span ? brute_local(p.mask, x, y) : brute_local(p.mask, y, x)) {
        s.first = std::min(s.first, y);
        s.last = std::max(s.last, y);
      }
  return s;
}

// key_span of a random range [a, b) of rows, or query_span of a random range of key columns,
// against brute force; then more(trial, problem, a, b, span) for checks of one direction.
template <typename More>
void check_spans(uint64_t seed, bool key_span, More more) {
  RandomProblems gen(seed);
  for (int t = 0; t < kTrials; ++t) {
    const Problem p = gen.next();
    const int64_t n = key_span ? p.seqlen_q : p.seqlen_k;
    const int64_t a = gen.uniform(0, n - 1);
    const int64_t b = gen.uniform(a + 1, n);
    const PosRange got =
        key_span ? p.mask.key_span(a, b, p.seqlen_k) : p.mask.query_span(a, b, p.seqlen_q);
    const PosRange want = brute_span(p, key_span, a, b);
    ASSERT_EQ(got.empty(), want.empty()) << "trial " << t;
    if (want.empty()) continue;
    ASSERT_EQ(got.first, want.first) << "trial " << t;
    ASSERT_EQ(got.last, want.last) << "trial " << t;
    more(t, p, a, b, want);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Mask, KeySpanMatchesBruteForce) {
  check_spans(2, true, [](int t, const Problem& p, int64_t r0, int64_t r1, PosRange want) {
    // No gaps: every column in the span is seen by some row of the range (a prefix may leave
    // a gap between itself and the rows' intervals).
    if (p.mask.prefix_end > p.mask.k_offset) return;
    for (int64_t c = want.first; c <= want.last; ++c) {
      bool seen = false;
      for (int64_t r = r0; r < r1 && !seen; ++r) seen = brute_local(p.mask, r, c);
      ASSERT_TRUE(seen) << "trial " << t << " gap at column " << c;
    }
  });
}

TEST(Mask, QuerySpanMatchesBruteForce) {
  check_spans(3, false, [](int, const Problem&, int64_t, int64_t, PosRange) {});
}

TEST(Mask, SingleRowAndColumnSpansAreExactlyTheVisibleSets) {
  RandomProblems gen(4);
  for (int t = 0; t < kTrials / 4; ++t) {
    const Problem p = gen.next();
    for (int64_t r = 0; r < p.seqlen_q && p.mask.prefix_end <= p.mask.k_offset; ++r) {
      const PosRange s = p.mask.key_span(r, r + 1, p.seqlen_k);
      for (int64_t c = 0; c < p.seqlen_k; ++c)
        ASSERT_EQ(!s.empty() && c >= s.first && c <= s.last, brute_local(p.mask, r, c));
    }
    for (int64_t c = 0; c < p.seqlen_k; ++c) {
      const PosRange s = p.mask.query_span(c, c + 1, p.seqlen_q);
      for (int64_t r = 0; r < p.seqlen_q; ++r)
        ASSERT_EQ(!s.empty() && r >= s.first && r <= s.last, brute_local(p.mask, r, c));
    }
  }
}

TEST(Mask, ClassifyMatchesBruteForce) {
  RandomProblems gen(5);
  int counts[3] = {0, 0, 0};
  for (int t = 0; t < 4 * kTrials; ++t) {
    const Problem p = gen.next();
    const int64_t r0 = gen.uniform(0, p.seqlen_q - 1), r1 = gen.uniform(r0 + 1, p.seqlen_q);
    const int64_t c0 = gen.uniform(0, p.seqlen_k - 1), c1 = gen.uniform(c0 + 1, p.seqlen_k);
    int64_t visible = 0;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) visible += brute_local(p.mask, r, c);
    const BlockKind want = visible == 0                       ? BlockKind::kEmpty
                           : visible == (r1 - r0) * (c1 - c0) ? BlockKind::kFull
                                                              : BlockKind::kPartial;
    ASSERT_EQ(p.mask.classify(r0, r1, c0, c1), want)
        << "trial " << t << " rows [" << r0 << "," << r1 << ") cols [" << c0 << "," << c1 << ")";
    ++counts[static_cast<int>(want)];
  }
  // The random problems really exercise all three kinds.
  EXPECT_GT(counts[0], 100);
  EXPECT_GT(counts[1], 100);
  EXPECT_GT(counts[2], 100);
}

TEST(Mask, PrefixSpotChecks) {
  Mask m;  // causal prefix-LM with a prompt of 4 tokens
  m.causal = true;
  m.prefix_end = 4;
  EXPECT_TRUE(m.visible_pos(0, 3));   // a prompt token sees the whole prompt
  EXPECT_FALSE(m.visible_pos(0, 4));  // but not the continuation
  EXPECT_TRUE(m.visible_pos(9, 2));
  EXPECT_FALSE(m.visible_pos(5, 6));
  m.window_left = 1;  // a window does not hide the prefix
  EXPECT_TRUE(m.visible_pos(20, 0));
  EXPECT_FALSE(m.visible_pos(20, 10));
  EXPECT_EQ(m.classify(0, 4, 0, 4), BlockKind::kFull);
  EXPECT_EQ(m.classify(10, 12, 4, 6), BlockKind::kEmpty);
  EXPECT_EQ(m.classify(10, 12, 3, 6), BlockKind::kPartial);
}

TEST(Mask, ClassifyDegenerateBlocksAreEmpty) {
  Mask m;
  EXPECT_EQ(m.classify(3, 3, 0, 10), BlockKind::kEmpty);
  EXPECT_EQ(m.classify(0, 10, 5, 4), BlockKind::kEmpty);
  EXPECT_EQ(m.classify(0, 10, 0, 10), BlockKind::kFull);
}

TEST(Mask, BottomRightAlignment) {
  // Sq = 1, Sk = 50, causal: the single decode query sits at position 49 and sees every key.
  const Mask decode = bottom_right_mask(true, -1, -1, 1, 50);
  EXPECT_EQ(decode.q_offset, 49);
  EXPECT_EQ(decode.k_offset, 0);
  EXPECT_EQ(decode.classify(0, 1, 0, 50), BlockKind::kFull);
  // Sq = 8 > Sk = 3: the first five queries sit before key 0 and see nothing.
  const Mask tall = bottom_right_mask(true, -1, -1, 8, 3);
  for (int64_t r = 0; r < 8; ++r) EXPECT_EQ(tall.key_span(r, r + 1, 3).empty(), r < 5) << r;
  const Mask win = bottom_right_mask(false, 2, 1, 4, 10);
  EXPECT_TRUE(win.causal == false && win.window_left == 2 && win.window_right == 1);
  EXPECT_TRUE(win.visible(0, 4) && win.visible(0, 7) && !win.visible(0, 3) && !win.visible(0, 8));
}

}  // namespace
}  // namespace cpattn
