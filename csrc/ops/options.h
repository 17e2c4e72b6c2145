// The attention options in the op layer, one definition for every op: each attention op schema
// ends with the suffix kOptionsSchema (with_options), each op implementation with
// CPATTN_OPTION_PARAMS, parsed once into AttentionOptions (CPATTN_OPTIONS); the per-call
// ScoreArgs and the kernels' ScoreOptions (cpattn/params.h) derive from them here. Adding an
// option: docs/design.md, "Adding a score option" (here: a field, its schema entry, its
// parameter, its parse, its check, its ScoreArgs field and its conversion).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "cpattn/mask.h"
#include "cpattn/params.h"
#include "ops/checks.h"

namespace cpattn::ops {

struct AttentionOptions {
  double softmax_scale = 1.0;
  bool causal = false;
  int64_t window_left = -1;  // -1: unbounded
  int64_t window_right = -1;
  double softcap = 0.0;                    // 0: none
  std::optional<at::Tensor> alibi_slopes;  // (H,) float, or none
  int64_t prefix_len = 0;  // keys at global positions < prefix_len seen by every query (0: none)
};

// Python passes them by name (cpattn/core/options.py op_kwargs). softmax_scale has no usable
// default: 0 fails its check (an op called without it raises, never runs with a guessed scale).
inline constexpr const char* kOptionsSchema =
    "float softmax_scale=0., bool causal=False, int window_left=-1, int window_right=-1, "
    "float softcap=0., Tensor? alibi_slopes=None, int prefix_len=0";

// The schema "head, <kOptionsSchema>) -> returns" of an op whose arguments before the options
// are `head` ("name(Tensor q, ...", without the closing parenthesis).
inline c10::FunctionSchema with_options(const char* head, const char* returns) {
  return torch::schema((std::string(head) + ", " + kOptionsSchema + ") -> " + returns).c_str());
}

// The C++ parameters of kOptionsSchema, in its order (the dispatcher passes them positionally).
#define CPATTN_OPTION_PARAMS                                                                    \
  double softmax_scale, bool causal, int64_t window_left, int64_t window_right, double softcap, \
      const std::optional<at::Tensor>&alibi_slopes, int64_t prefix_len

// The AttentionOptions of an op's CPATTN_OPTION_PARAMS.
#define CPATTN_OPTIONS                                             \
  (::cpattn::ops::AttentionOptions{.softmax_scale = softmax_scale, \
                                   .causal = causal,               \
                                   .window_left = window_left,     \
                                   .window_right = window_right,   \
                                   .softcap = softcap,             \
                                   .alibi_slopes = alibi_slopes,   \
                                   .prefix_len = prefix_len})

// The score options of a call with tensors: softcap (0: none), alibi_slopes and sinks ((H,)
// float, or none), the ALiBi positions of local query 0 / key 0 and their stride. sinks are
// applied by a forward given them; a driver that merges partial results passes none per step
// and applies them once at the end (apply_sinks_).
struct ScoreArgs {
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
  std::optional<at::Tensor> sinks;
  int64_t alibi_q_begin = 0;
  int64_t alibi_k_begin = 0;
  int64_t alibi_stride = 1;
  bool fixed_order = false;  // AttnShape::fixed_order: set by the invariant ops only
};

// The mask rule of the options on global positions (q_offset = k_offset = 0).
inline Mask global_mask(const AttentionOptions& o) {
  Mask m;
  m.causal = o.causal;
  m.window_left = normalized_window(o.window_left);
  m.window_right = normalized_window(o.window_right);
  if (o.prefix_len > 0) m.prefix_end = o.prefix_len;
  return m;
}

// The score arguments of the options (no sinks: a caller that applies them adds them), ALiBi on
// global positions from query 0 / key 0.
inline ScoreArgs score_args(const AttentionOptions& o) {
  ScoreArgs a;
  a.softcap = o.softcap;
  a.alibi_slopes = o.alibi_slopes;
  return a;
}

// The kernels' ScoreOptions from ScoreArgs, on the tensors' device; slopes and sinks receive the
// fp32 copies the pointers point into (the caller keeps them alive while the kernels run).
inline ScoreOptions score_options(const ScoreArgs& a, at::Tensor& slopes, at::Tensor& sinks) {
  ScoreOptions o;
  o.softcap = static_cast<float>(a.softcap);
  if (a.alibi_slopes) {
    slopes = a.alibi_slopes->to(at::kFloat).contiguous();
    o.alibi_slopes = slopes.data_ptr<float>();
  }
  if (a.sinks) {
    sinks = a.sinks->to(at::kFloat).contiguous();
    o.sinks = sinks.data_ptr<float>();
  }
  o.alibi_q_begin = a.alibi_q_begin;
  o.alibi_k_begin = a.alibi_k_begin;
  o.alibi_stride = a.alibi_stride;
  return o;
}

// Checks the score arguments for `heads` query heads on `device`, naming `fn`.
inline void check_score_args(const char* fn, const ScoreArgs& a, int64_t heads, at::Device device) {
  TORCH_CHECK(std::isfinite(a.softcap) && a.softcap >= 0.0, "cpattn.", fn,
              ": softcap must be a finite number >= 0 (0: no softcap), got ", a.softcap);
  check_per_head(fn, "alibi_slopes", a.alibi_slopes, heads, device);
  check_per_head(fn, "sinks", a.sinks, heads, device);
}

// Checks the options (scale, window, prefix, score arguments) for `heads` query heads.
inline void check_options(const char* fn, const AttentionOptions& o, int64_t heads,
                          at::Device device) {
  check_mask_args(o.softmax_scale, o.window_left, o.window_right);
  check_prefix_len(fn, o.prefix_len);
  check_score_args(fn, score_args(o), heads, device);
}

}  // namespace cpattn::ops
