// The -inf safe LSE merge and the online softmax row state, against direct double math.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpattn/softmax_state.h"

namespace cpattn {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const float kNegInf = -std::numeric_limits<float>::infinity();

// log(exp(a) + exp(b)) in double, in the stable form.
double logaddexp(double a, double b) {
  const double mx = std::max(a, b);
  if (mx == -kInf) return -kInf;
  return mx + std::log1p(std::exp(-std::fabs(a - b)));
}

void expect_merge(float a, float b) {
  const MergeWeights w = merge_weights(a, b);
  const double lse = logaddexp(a, b);
  ASSERT_FALSE(std::isnan(w.weight_a) || std::isnan(w.weight_b) || std::isnan(w.lse))
      << a << " " << b;
  EXPECT_NEAR(w.lse, lse, 1e-6 * std::max(1.0, std::fabs(lse))) << a << " " << b;
  // w_a = exp(a - lse) = 1 / (1 + exp(b - a)): the form that does not lose a - lse to rounding.
  EXPECT_NEAR(w.weight_a, 1.0 / (1.0 + std::exp(double(b) - double(a))), 1e-6) << a << " " << b;
  EXPECT_NEAR(w.weight_b, 1.0 / (1.0 + std::exp(double(a) - double(b))), 1e-6) << a << " " << b;
  EXPECT_NEAR(w.weight_a + w.weight_b, 1.0, 1e-6);
}

TEST(MergeWeights, RandomFiniteValues) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 5.f);
  for (int t = 0; t < 10000; ++t) expect_merge(normal(rng), normal(rng));
}

TEST(MergeWeights, EqualInputs) {
  const MergeWeights w = merge_weights(1.5f, 1.5f);
  EXPECT_FLOAT_EQ(w.weight_a, 0.5f);
  EXPECT_FLOAT_EQ(w.weight_b, 0.5f);
  EXPECT_NEAR(w.lse, 1.5 + std::log(2.0), 1e-6);
}

TEST(MergeWeights, OneSideEmpty) {
  for (float x : {-30.f, 0.f, 2.5f, 1e4f}) {
    const MergeWeights a_empty = merge_weights(kNegInf, x);
    EXPECT_EQ(a_empty.weight_a, 0.f);
    EXPECT_EQ(a_empty.weight_b, 1.f);
    EXPECT_EQ(a_empty.lse, x);
    const MergeWeights b_empty = merge_weights(x, kNegInf);
    EXPECT_EQ(b_empty.weight_a, 1.f);
    EXPECT_EQ(b_empty.weight_b, 0.f);
    EXPECT_EQ(b_empty.lse, x);
  }
}

TEST(MergeWeights, BothEmptyStaysEmpty) {
  const MergeWeights w = merge_weights(kNegInf, kNegInf);
  EXPECT_EQ(w.weight_a, 0.f);
  EXPECT_EQ(w.weight_b, 0.f);
  EXPECT_TRUE(std::isinf(w.lse) && w.lse < 0);
  // Merging the result with an empty state again keeps it empty and NaN-free.
  const MergeWeights again = merge_weights(w.lse, kNegInf);
  EXPECT_EQ(again.weight_a, 0.f);
  EXPECT_EQ(again.weight_b, 0.f);
  EXPECT_TRUE(std::isinf(again.lse) && again.lse < 0);
}

TEST(MergeWeights, LargeMagnitudesWhereTheExpFormOverflows) {
  // exp(100) already overflows float: the naive log(exp(a) + exp(b)) would give inf and NaN
  // weights. The stable form must stay finite and exact.
  ASSERT_TRUE(std::isinf(std::exp(100.f)));
  for (auto [a, b] : {std::pair{100.f, 99.f},
                      {1000.f, 1000.5f},
                      {1e4f, 1e4f - 3.f},
                      {3e38f, 3e38f},
                      {-1000.f, -1001.f},
                      {-1e4f, 50.f},
                      {88.f, -88.f}}) {
    expect_merge(a, b);
    const MergeWeights w = merge_weights(a, b);
    EXPECT_TRUE(std::isfinite(w.lse)) << a << " " << b;
  }
}

// Streams base-2 scores through OnlineSoftmaxRow in blocks, accumulating a weighted sum of
// values the way the kernel does (rescale by the returned factor, add exp2(score - reference)).
struct StreamResult {
  float lse;
  float mean;  // sum_j p_j value_j / sum_j p_j
};
StreamResult stream(const std::vector<float>& scores, const std::vector<float>& values,
                    const std::vector<size_t>& block_ends) {
  OnlineSoftmaxRow row;
  float acc = 0.f;
  size_t begin = 0;
  for (size_t end : block_ends) {
    float block_max = kNegInf;
    for (size_t j = begin; j < end; ++j) block_max = std::max(block_max, scores[j]);
    const float factor = row.rescale_for_block_max(block_max);
    EXPECT_FALSE(std::isnan(factor));
    acc *= factor;
    const float ref = row.reference();
    EXPECT_TRUE(std::isfinite(ref));
    for (size_t j = begin; j < end; ++j) {
      const float p = exp2f(scores[j] - ref);
      row.sum += p;
      acc += p * values[j];
    }
    begin = end;
  }
  return {row.lse(), acc * row.inv_sum()};
}

// Natural-log LSE of base-2 scores (ln sum 2^s) and the softmax mean, directly in double.
StreamResult direct(const std::vector<float>& scores, const std::vector<float>& values) {
  double mx = -kInf;
  for (float s : scores) mx = std::max(mx, double(s));
  if (mx == -kInf) return {kNegInf, 0.f};
  double sum = 0, acc = 0;
  for (size_t j = 0; j < scores.size(); ++j) {
    const double p = std::exp2(double(scores[j]) - mx);
    sum += p;
    acc += p * values[j];
  }
  return {float((mx + std::log2(sum)) * std::log(2.0)), float(acc / sum)};
}

TEST(OnlineSoftmaxRow, StreamEqualsDirectLogSumExp) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 4.f);
  std::uniform_int_distribution<int> len(1, 300), coin(0, 9);
  for (int t = 0; t < 500; ++t) {
    const int n = len(rng);
    std::vector<float> scores(n), values(n);
    for (int j = 0; j < n; ++j) {
      scores[j] = coin(rng) == 0 ? kNegInf : normal(rng) + (t % 5 == 0 ? 300.f : 0.f);
      values[j] = normal(rng);
    }
    if (t % 7 == 0)  // a leading run of masked scores: the first blocks see nothing
      std::fill(scores.begin(), scores.begin() + n / 2, kNegInf);
    std::vector<size_t> ends;
    for (size_t e = 0; e < size_t(n);) {
      e = std::min<size_t>(n, e + 1 + rng() % 40);
      ends.push_back(e);
    }
    const StreamResult got = stream(scores, values, ends);
    const StreamResult want = direct(scores, values);
    if (std::isinf(want.lse)) {
      EXPECT_TRUE(std::isinf(got.lse) && got.lse < 0) << "trial " << t;
      EXPECT_EQ(got.mean, 0.f) << "trial " << t;
      continue;
    }
    EXPECT_NEAR(got.lse, want.lse, 2e-6 * std::max(1.f, std::fabs(want.lse))) << "trial " << t;
    EXPECT_NEAR(got.mean, want.mean, 2e-5 * std::max(1.f, std::fabs(want.mean))) << "trial " << t;
  }
}

TEST(OnlineSoftmaxRow, AllMaskedRowIsEmpty) {
  const std::vector<float> scores(50, kNegInf), values(50, 1.f);
  const StreamResult r = stream(scores, values, {10, 20, 50});
  EXPECT_TRUE(std::isinf(r.lse) && r.lse < 0);
  EXPECT_EQ(r.mean, 0.f);
  OnlineSoftmaxRow fresh;
  EXPECT_EQ(fresh.inv_sum(), 0.f);
  EXPECT_EQ(fresh.reference(), 0.f);
  EXPECT_TRUE(std::isinf(fresh.lse()) && fresh.lse() < 0);
}

TEST(OnlineSoftmaxRow, RescaleFactorIsExp2OfMaxDifference) {
  OnlineSoftmaxRow row;
  EXPECT_EQ(row.rescale_for_block_max(kNegInf), 1.f);  // still empty: nothing to rescale
  EXPECT_EQ(row.rescale_for_block_max(3.f), 0.f);      // from -inf: exp2(-inf) = 0
  row.sum = 1.f;
  EXPECT_EQ(row.rescale_for_block_max(1.f), 1.f);  // lower block max: max unchanged
  EXPECT_EQ(row.max, 3.f);
  EXPECT_FLOAT_EQ(row.rescale_for_block_max(5.f), 0.25f);
  EXPECT_FLOAT_EQ(row.sum, 0.25f);
  EXPECT_EQ(row.reference(), 5.f);
}

TEST(BackwardReference, RecoversProbabilities) {
  // p = exp(s - lse) = exp2(s * log2(e) - backward_reference(lse)).
  const std::vector<float> scores{-1.f, 0.5f, 2.f, 3.25f};
  double sum = 0;
  for (float s : scores) sum += std::exp(double(s));
  const float lse = float(std::log(sum));
  double total = 0;
  for (float s : scores) {
    const float p = exp2f(s * kLog2e - backward_reference(lse));
    EXPECT_NEAR(p, std::exp(double(s) - lse), 1e-6);
    total += p;
  }
  EXPECT_NEAR(total, 1.0, 1e-6);
  // An empty row (lse = -inf): every probability is 0, even for a finite or -inf score.
  const float ref = backward_reference(kNegInf);
  EXPECT_TRUE(std::isinf(ref) && ref > 0);
  EXPECT_EQ(exp2f(1.f - ref), 0.f);
  EXPECT_EQ(exp2f(kNegInf - ref), 0.f);
}

// The sink joins the softmax once, after any number of merges: merging W parts and adding the
// sink equals the direct softmax over all the scores plus the sink logit.
TEST(Sink, AddedOnceAfterMergesEqualsDirectSoftmax) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  for (int trial = 0; trial < 200; ++trial) {
    const int parts = 1 + trial % 4;
    const float sink = normal(rng);
    std::vector<std::vector<float>> scores(parts);
    std::vector<float> values;  // one scalar value per key, to check the output too
    double denom = std::exp(double(sink)), numer = 0;
    float lse = kNegInf, out = 0.f;
    for (int n = 0; n < parts; ++n) {
      const int keys = (trial + n) % 3;  // some parts are empty
      double part_sum = 0, part_numer = 0;
      for (int j = 0; j < keys; ++j) {
        const float s = normal(rng), v = normal(rng);
        part_sum += std::exp(double(s));
        part_numer += std::exp(double(s)) * v;
      }
      denom += part_sum;
      numer += part_numer;
      const float part_lse = keys ? float(std::log(part_sum)) : kNegInf;
      const float part_out = keys ? float(part_numer / part_sum) : 0.f;
      const MergeWeights w = merge_weights(lse, part_lse);
      out = w.weight_a * out + w.weight_b * part_out;
      lse = w.lse;
    }
    const SinkNormalisation f = add_sink(lse, sink);
    EXPECT_NEAR(f.lse, std::log(denom), 1e-5 * std::max(1.0, std::fabs(std::log(denom))));
    EXPECT_NEAR(out * f.out_factor, numer / denom, 1e-5 * std::max(1.0, std::fabs(numer / denom)));
  }
}

TEST(Sink, EmptyRowAndNoSink) {
  const SinkNormalisation empty = add_sink(kNegInf, 1.5f);  // no key: the sink alone
  EXPECT_EQ(empty.out_factor, 0.f);
  EXPECT_EQ(empty.lse, 1.5f);
  const SinkNormalisation none = add_sink(2.f, kNegInf);  // no sink: nothing changes
  EXPECT_EQ(none.out_factor, 1.f);
  EXPECT_EQ(none.lse, 2.f);
  const SinkNormalisation neither = add_sink(kNegInf, kNegInf);
  EXPECT_EQ(neither.out_factor, 0.f);
  EXPECT_EQ(neither.lse, kNegInf);
  EXPECT_EQ(sink_grad(1.f, kNegInf, 3.f), 0.f);
  // no overflow at large logits
  const SinkNormalisation big = add_sink(100.f, 100.f);
  EXPECT_NEAR(big.lse, 100.f + std::log(2.f), 1e-4);
  EXPECT_NEAR(big.out_factor, 0.5f, 1e-6);
}

// d lse'/d sink = p_sink: sink_grad with delta = -1 (dL/dlse' = 1, no output gradient) is p_sink,
// checked against a finite difference of add_sink.
TEST(Sink, GradientMatchesFiniteDifference) {
  const float lse = 0.7f, sink = -0.3f;
  const double h = 1e-3;
  const double fd = (add_sink(lse, sink + h).lse - add_sink(lse, sink - h).lse) / (2 * h);
  EXPECT_NEAR(sink_grad(sink, add_sink(lse, sink).lse, -1.f), fd, 1e-3);
}

}  // namespace
}  // namespace cpattn
