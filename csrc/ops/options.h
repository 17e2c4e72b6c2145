// The attention options, one definition for every op: each attention op schema ends with the
// suffix kOptionsSchema, each op implementation with CPATTN_OPTION_PARAMS, and
// parses them once into AttentionOptions (CPATTN_OPTIONS). Adding an option: a field here, its
// schema entry, its parameter, its parse; the Python side is cpattn/options.py (op_kwargs).
// The order of the score rules they drive: docs/design.md, "Score-op order".
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cpattn/mask.h"
#include "cpattn/params.h"
#include "ops/ops.h"

namespace cpattn::ops {

struct AttentionOptions {
  double softmax_scale = 1.0;
  bool causal = false;
  int64_t window_left = -1;  // -1: unbounded
  int64_t window_right = -1;
  double softcap = 0.0;  // 0: none
  std::optional<at::Tensor> alibi_slopes;  // (H,) float, or none
  int64_t prefix_len = 0;  // keys at global positions < prefix_len seen by every query (0: none)
};

// Python passes them by name (cpattn/options.py op_kwargs). softmax_scale has no usable
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
#define CPATTN_OPTION_PARAMS                                                             \
  double softmax_scale, bool causal, int64_t window_left, int64_t window_right,          \
      double softcap, const std::optional<at::Tensor>&alibi_slopes, int64_t prefix_len

// The AttentionOptions of an op's CPATTN_OPTION_PARAMS.
#define CPATTN_OPTIONS                                                                    \
  (::cpattn::ops::AttentionOptions{.softmax_scale = softmax_scale,                        \
                                   .causal = causal,                                      \
                                   .window_left = window_left,                            \
                                   .window_right = window_right,                          \
                                   .softcap = softcap,                                    \
                                   .alibi_slopes = alibi_slopes,                          \
                                   .prefix_len = prefix_len})

// The mask rule of the options on global positions (q_offset = k_offset = 0).
inline Mask global_mask(const AttentionOptions& o) {
  Mask m;
  m.causal = o.causal;
  m.window_left = normalized_window(o.window_left);
  m.window_right = normalized_window(o.window_right);
  if (o.prefix_len > 0) m.prefix_end = o.prefix_len;
  return m;
}

// The score options of the options (no sinks: a caller that applies them adds them), ALiBi on
// global positions from query 0 / key 0.
inline ScoreArgs score_args(const AttentionOptions& o) {
  ScoreArgs a;
  a.softcap = o.softcap;
  a.alibi_slopes = o.alibi_slopes;
  return a;
}

// Checks the options (scale, window, prefix, softcap, slopes for `heads` query heads on
// `device`), naming `fn` in the message.
void check_options(const char* fn, const AttentionOptions& o, int64_t heads, at::Device device);

}  // namespace cpattn::ops
