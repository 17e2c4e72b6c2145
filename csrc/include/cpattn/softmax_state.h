// Online softmax and the log-sum-exp merge, -inf safe.
//
// A partial attention result is a pair (o, lse): o = sum_j p_j v_j / sum_j p_j over some key set,
// lse = log(sum_j exp(s_j)). Two results over disjoint key sets merge exactly:
//   lse = max + log(exp(lse_a - max) + exp(lse_b - max)),  o = w_a o_a + w_b o_b,
//   w_a = exp(lse_a - lse), w_b = exp(lse_b - lse).
// A row that saw no key has lse = -inf and o = 0; two such rows merge to (0, -inf), not NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpattn/config.h"

namespace cpattn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

CPATTN_HOST_DEVICE float neg_inf() { return -std::numeric_limits<float>::infinity(); }

// Weights of the two parts in the merge of (lse_a, lse_b), and the merged lse.
struct MergeWeights {
  float weight_a;
  float weight_b;
  float lse;
};

CPATTN_HOST_DEVICE MergeWeights merge_weights(float lse_a, float lse_b) {
  const float mx = lse_a > lse_b ? lse_a : lse_b;
  if (mx == neg_inf()) return {0.f, 0.f, neg_inf()};  // both empty: stays empty
  const float ea = expf(lse_a - mx);                  // exp(-inf) = 0 for an empty side
  const float eb = expf(lse_b - mx);
  const float sum = ea + eb;
  return {ea / sum, eb / sum, mx + logf(sum)};
}

// N-way form of the same merge, for N partial results over disjoint key sets (one per rank):
//   lse = max + log(sum_n exp(lse_n - max)),  w_n = exp(lse_n - max) / sum_m exp(lse_m - max).
// lse_n is read at lse[n * stride]; weights[n] receives w_n. When every part is empty the weights
// are 0 and the merged lse is -inf (no NaN). For n = 2 it computes exactly what merge_weights does.
CPATTN_HOST_DEVICE float merge_weights_n(const float* lse, int64_t n, int64_t stride,
                                         float* weights) {
  float mx = neg_inf();
  for (int64_t i = 0; i < n; ++i) mx = lse[i * stride] > mx ? lse[i * stride] : mx;
  if (mx == neg_inf()) {
    for (int64_t i = 0; i < n; ++i) weights[i] = 0.f;
    return neg_inf();
  }
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    weights[i] = expf(lse[i * stride] - mx);  // exp(-inf) = 0 for an empty part
    sum += weights[i];
  }
  for (int64_t i = 0; i < n; ++i) weights[i] /= sum;
  return mx + logf(sum);
}

// The weight w = exp(lse_part - lse_merged) of one part in a merged result, recomputed from the
// merged lse (the backward of the merge). 0 when the merged row is empty.
CPATTN_HOST_DEVICE float merged_weight(float lse_part, float lse_merged) {
  return lse_merged == neg_inf() ? 0.f : expf(lse_part - lse_merged);
}

// The attention sink of a row (a per-head logit in the softmax denominator, without a value),
// added once to a row's merged result over all its keys (o, lse):
//   lse' = log(exp(lse) + exp(sink)),  o' = o * exp(lse - lse').
// Any number of partial results over disjoint key sets merge first (merge_weights), without the
// sink; the sink comes last, so it counts once whatever the merge order or the number of parts.
// The LSE returned with a sink is lse' (what the backward's probabilities are computed from:
// p_j = exp(s_j - lse'), p_sink = exp(sink - lse')). An empty row (lse = -inf) gets o' = 0 and
// lse' = sink; no sink (sink = -inf) changes nothing.
struct SinkNormalisation {
  float out_factor;  // o' = o * out_factor
  float lse;         // lse'
};

CPATTN_HOST_DEVICE SinkNormalisation add_sink(float lse, float sink) {
  const float mx = lse > sink ? lse : sink;
  if (mx == neg_inf()) return {0.f, neg_inf()};
  const float sum = expf(lse - mx) + expf(sink - mx);
  const float merged = mx + logf(sum);
  return {lse == neg_inf() ? 0.f : expf(lse - merged), merged};
}

// The gradient of a row's loss with respect to its sink logit: the sink is a key with value 0,
// so dL/dsink = p_sink * (0 - delta) with p_sink = exp(sink - lse') and delta = rowsum(dO * O) -
// dL/dlse' (the same delta the kernels' dS = P (dP - delta) takes). 0 for an empty row.
CPATTN_HOST_DEVICE float sink_grad(float sink, float lse, float delta) {
  return lse == neg_inf() ? 0.f : -expf(sink - lse) * delta;
}

// Running state of one query row in base 2: scores are pre-multiplied by scale * log2(e),
// max is the running maximum and sum the running sum of exp2(score - max).
struct OnlineSoftmaxRow {
  float max = neg_inf();
  float sum = 0.f;

  // Takes the maximum of a new block of scores; returns the factor that rescales what was
  // accumulated so far. When every score so far is -inf the reference point stays 0 (see
  // reference()), so exp2(-inf - 0) = 0 and no inf - inf appears.
  CPATTN_HOST_DEVICE float rescale_for_block_max(float block_max) {
    const float new_max = block_max > max ? block_max : max;
    const float factor = (new_max == neg_inf()) ? 1.f : exp2f(max - new_max);
    max = new_max;
    sum *= factor;
    return factor;
  }
  // The value subtracted from scores before exp2: the running max, or 0 while it is -inf.
  CPATTN_HOST_DEVICE float reference() const { return max == neg_inf() ? 0.f : max; }

  // 1 / sum for the final normalisation (0 for an empty row, whose accumulator is 0).
  CPATTN_HOST_DEVICE float inv_sum() const { return sum > 0.f ? 1.f / sum : 0.f; }
  // Natural-log LSE of the row (-inf for an empty row; NaN stays NaN).
  CPATTN_HOST_DEVICE float lse() const {
    return sum > 0.f ? (max + log2f(sum)) * kLn2 : (sum == 0.f ? neg_inf() : sum);
  }
};

// Reference point for recomputing probabilities in the backward pass from a natural-log LSE:
// p = exp2(score_base2 - lse_base2). An empty row (-inf) gets +inf, so every p is 0.
CPATTN_HOST_DEVICE float backward_reference(float lse) {
  return lse == neg_inf() ? std::numeric_limits<float>::infinity() : lse * kLog2e;
}

}  // namespace cpattn
