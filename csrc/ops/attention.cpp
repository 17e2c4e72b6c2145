// The device-generic attention ops: arguments checked (checks.h), then the kernels of the tensors'
// device (backend.h). Each *_scored entry checks its arguments on every call, also when a public op
// or a driver (ring, invariant, inference) calls it per sub-problem. Backend registry included.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "cpattn/mask.h"
#include "cpattn/params.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/options.h"

namespace cpattn::ops {
namespace {

std::map<c10::DeviceType, Backend>& backends() {
  static std::map<c10::DeviceType, Backend> table;
  return table;
}

// The mask and score options of a public attention call on global positions. Without offsets
// (cpattn.attention passes none) the rows are bottom-right aligned, flash-attn's convention
// (mask.h bottom_right_mask): the last query lines up with the last key.
std::pair<Mask, ScoreArgs> public_options(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const AttentionOptions& o,
                                          std::optional<int64_t> q_offset,
                                          std::optional<int64_t> k_offset,
                                          const std::optional<at::Tensor>& sinks) {
  check_prefix_len("attention", o.prefix_len);
  TORCH_CHECK(q_offset.has_value() == k_offset.has_value(),
              "cpattn.attention: give q_offset and k_offset, or neither (bottom-right aligned), "
              "got q_offset=",
              q_offset ? std::to_string(*q_offset) : "None",
              ", k_offset=", k_offset ? std::to_string(*k_offset) : "None");
  const AttnShape s = check_qkv(q, k, v);
  Mask m = bottom_right_mask(o.causal, normalized_window(o.window_left),
                             normalized_window(o.window_right), s.seqlen_q, s.seqlen_k);
  if (q_offset) {
    m.q_offset = *q_offset;
    m.k_offset = *k_offset;
  }
  if (o.prefix_len > 0) m.prefix_end = o.prefix_len;
  ScoreArgs a = score_args(o);
  a.sinks = sinks;
  a.alibi_q_begin = m.q_offset;
  a.alibi_k_begin = m.k_offset;
  return {m, a};
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<int64_t> q_offset,
    std::optional<int64_t> k_offset, std::optional<at::ScalarType> out_dtype,
    const std::optional<at::Tensor>& sinks, CPATTN_OPTION_PARAMS) {
  const auto [mask, score] = public_options(q, k, v, CPATTN_OPTIONS, q_offset, k_offset, sinks);
  return attention_fwd_scored(q, k, v, softmax_scale, mask, score, out_dtype);
}

// The options of a public backward call (attention_bwd, attention_bwd_in_dout) on global
// positions, then run(out, dlse, mask, score). row_dot: rowsum(dout * out) (B, H, Sq) fp32
// given in place of out (None), for a caller that holds out in another layout (Ulysses: by
// sequence). The backward's delta is row_dot - dlse, so the backends get it as an undefined out
// (no rowsum term) and dlse - row_dot.
template <typename Run>
auto public_bwd(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& out, const at::Tensor& lse,
                std::optional<int64_t> q_offset, std::optional<int64_t> k_offset,
                const std::optional<at::Tensor>& dlse, const std::optional<at::Tensor>& row_dot,
                const AttentionOptions& o, Run run) {
  const auto [mask, score] = public_options(q, k, v, o, q_offset, k_offset, std::nullopt);
  const bool has_out = out && out->defined(), has_dot = row_dot && row_dot->defined();
  TORCH_CHECK(has_out != has_dot, "cpattn: ", fn, " needs exactly one of out and row_dot, got ",
              has_out ? "both" : "neither");
  std::optional<at::Tensor> shifted = dlse;  // dlse - row_dot
  if (has_dot) {
    TORCH_CHECK(row_dot->scalar_type() == at::kFloat && row_dot->sizes() == lse.sizes() &&
                    row_dot->device() == lse.device(),
                "cpattn: row_dot must be float32 with lse's shape ", lse.sizes(), " and device ",
                lse.device(), ", got ", row_dot->sizes(), " ", row_dot->scalar_type(), " on ",
                row_dot->device());
    const bool has_dlse = dlse && dlse->defined();
    TORCH_CHECK(!has_dlse || dlse->sizes() == lse.sizes(), "cpattn: dlse must have lse's shape ",
                lse.sizes(), ", got ", has_dlse ? dlse->sizes() : lse.sizes());
    shifted = has_dlse ? dlse->to(at::kFloat) - *row_dot : -*row_dot;
  }
  return run(has_out ? *out : at::Tensor(), shifted, mask, score);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& out, const at::Tensor& lse, std::optional<int64_t> q_offset,
    std::optional<int64_t> k_offset, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& dlse, const std::optional<at::Tensor>& row_dot,
    CPATTN_OPTION_PARAMS) {
  return public_bwd(
      "attention_bwd", q, k, v, out, lse, q_offset, k_offset, dlse, row_dot, CPATTN_OPTIONS,
      [&](const at::Tensor& o, const std::optional<at::Tensor>& d, const Mask& m,
          const ScoreArgs& score) {
        return attention_bwd_scored(dout, q, k, v, o, lse, softmax_scale, m, score, grad_dtype, d);
      });
}

std::tuple<at::Tensor, at::Tensor> attention_bwd_in_dout(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& out, const at::Tensor& lse, std::optional<int64_t> q_offset,
    std::optional<int64_t> k_offset, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& row_dot, CPATTN_OPTION_PARAMS) {
  return public_bwd(
      "attention_bwd_in_dout", q, k, v, out, lse, q_offset, k_offset, dlse, row_dot, CPATTN_OPTIONS,
      [&](const at::Tensor& o, const std::optional<at::Tensor>& d, const Mask& m,
          const ScoreArgs& score) {
        return attention_bwd_in_dout_scored(dout, q, k, v, o, lse, softmax_scale, m, score, d);
      });
}

void merge_state_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                  const at::Tensor& part_lse) {
  check_merge_args(out, lse, part_out, part_lse);
  merge_into(out, lse, part_out, part_lse);
}

}  // namespace

namespace {
std::atomic<int64_t> checks_run{0};  // attention_checks_run
}  // namespace

AttnShape check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double softmax_scale, const Mask& mask, const ScoreArgs& score) {
  checks_run.fetch_add(1, std::memory_order_relaxed);
  AttnShape s = check_qkv(q, k, v);
  check_mask_args(softmax_scale, mask.window_left, mask.window_right);
  check_positions(mask.q_offset, s.seqlen_q, mask.k_offset, s.seqlen_k);
  check_score_args("attention", score, s.heads, q.device());
  s.fixed_order = score.fixed_order;
  return s;
}

bool register_backend(c10::DeviceType type, const Backend& backend) {
  backends()[type] = backend;
  return true;
}

const Backend& backend_for(const c10::Device& device) {
  const auto& table = backends();
  const auto it = table.find(device.type());
  if (it != table.end()) return it->second;
  std::ostringstream have;
  for (const auto& [type, backend] : table)
    have << (have.tellp() > 0 ? ", " : "") << c10::DeviceTypeName(type, /*lower_case=*/true);
  TORCH_CHECK(false, "cpattn: no kernel for device ", device, " in this build (", have.str(),
              " tensors only)");
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_scored(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, double softmax_scale,
                                                        const Mask& mask, const ScoreArgs& score,
                                                        std::optional<at::ScalarType> out_dtype) {
  const AttnShape s = check_attention_args(q, k, v, softmax_scale, mask, score);
  const at::ScalarType dtype = out_dtype.value_or(q.scalar_type());
  TORCH_CHECK(is_float_type(dtype), "cpattn: out_dtype must be float32, bfloat16 or float16, got ",
              dtype);
  return backend_for(q.device()).fwd(q, k, v, s, softmax_scale, mask, score, dtype);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_unchecked(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           double softmax_scale, const Mask& mask,
                                                           const ScoreArgs& score,
                                                           at::ScalarType out_dtype) {
  AttnShape s = attn_shape(q, k, v);
  s.fixed_order = score.fixed_order;
  return backend_for(q.device()).fwd(q, k, v, s, softmax_scale, mask, score, out_dtype);
}

int64_t attention_checks_run() { return checks_run.load(std::memory_order_relaxed); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_scored(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Mask& mask,
    const ScoreArgs& score, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& dlse) {
  const AttnShape s = check_attention_args(q, k, v, softmax_scale, mask, score);
  check_bwd_args(dout, q, out, lse, dlse, grad_dtype, s);
  return backend_for(q.device())
      .bwd(dout, q, k, v, out, lse, dlse, s, softmax_scale, mask, score, grad_dtype);
}

std::tuple<at::Tensor, at::Tensor> attention_bwd_in_dout_scored(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Mask& mask,
    const ScoreArgs& score, const std::optional<at::Tensor>& dlse) {
  const AttnShape s = check_attention_args(q, k, v, softmax_scale, mask, score);
  check_bwd_args(dout, q, out, lse, dlse, std::nullopt, s);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type(),
              "cpattn: attention_bwd_in_dout writes dq over dout, so dout must have q's shape ",
              q.sizes(), " and dtype ", q.scalar_type(), ", got ", dout.sizes(), " ",
              dout.scalar_type());
  for (const auto& [name, input] : {std::pair("q", &q), std::pair("k", &k), std::pair("v", &v)})
    TORCH_CHECK(at::get_overlap_status(dout, *input) == at::MemOverlapStatus::No,
                "cpattn: attention_bwd_in_dout writes dq over dout, so dout must not overlap ",
                name, " (the backward still reads it)");
  const Backend& backend = backend_for(q.device());
  if (backend.bwd_in_dout)
    return backend.bwd_in_dout(dout, q, k, v, out, lse, dlse, s, softmax_scale, mask, score);
  auto [dq, dk, dv] =
      backend.bwd(dout, q, k, v, out, lse, dlse, s, softmax_scale, mask, score, std::nullopt);
  dout.copy_(dq);
  return {dk, dv};
}

void attention_bwd_add_scored(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                              const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                              double softmax_scale, const Mask& mask, const ScoreArgs& score,
                              const std::optional<at::Tensor>& dlse,
                              const std::optional<at::Tensor>& dq_low) {
  const AttnShape s = check_attention_args(q, k, v, softmax_scale, mask, score);
  check_bwd_args(dout, q, out, lse, dlse, at::kFloat, s);
  const bool split = dq_low.has_value();
  const at::ScalarType dq_type = split ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(dq.defined() || (dk.defined() && dv.defined()),
              "cpattn: the backward adds into dq, or dk and dv, or all three");
  TORCH_CHECK(!score.fixed_order || q.device().is_cpu(),
              "cpattn: fixed-order running sums are CPU only, got q on ", q.device());
  for (const auto& [target, like, want] :
       {std::tuple(dq, q, dq_type), std::tuple(dk, k, at::kFloat), std::tuple(dv, v, at::kFloat)}) {
    if (!target.defined()) continue;
    TORCH_CHECK(target.scalar_type() == want && target.sizes() == like.sizes() &&
                    target.device() == like.device() && target.stride(3) == 1,
                "cpattn: the backward adds into ", want,
                " gradients of the inputs' shapes and "
                "device, contiguous in head_dim; got ",
                target.scalar_type(), " ", target.sizes(), " on ", target.device(), " for ",
                like.sizes(), " on ", like.device());
  }
  if (split)
    TORCH_CHECK(split_sums_supported(q.device()) && dq_low->scalar_type() == at::kShort &&
                    dq_low->sizes() == dq.sizes() && dq_low->strides() == dq.strides(),
                "cpattn: split dQ sums need int16 low halves of dq's shape and strides on a "
                "backend that adds into them");
  attention_bwd_add_unchecked(dq, dk, dv, dout, q, k, v, out, lse, softmax_scale, mask, score, dlse,
                              dq_low);
}

void attention_bwd_add_unchecked(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                 const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 double softmax_scale, const Mask& mask, const ScoreArgs& score,
                                 const std::optional<at::Tensor>& dlse,
                                 const std::optional<at::Tensor>& dq_low) {
  AttnShape s = attn_shape(q, k, v);
  s.fixed_order = score.fixed_order;
  const bool split = dq_low.has_value();
  const Backend& backend = backend_for(q.device());
  if (backend.bwd_add) {
    backend.bwd_add(dq, split ? *dq_low : at::Tensor(), dk, dv, dout, q, k, v, out, lse, dlse, s,
                    softmax_scale, mask, score);
    return;
  }
  const auto [dq_part, dk_part, dv_part] =
      backend.bwd(dout, q, k, v, out, lse, dlse, s, softmax_scale, mask, score, at::kFloat);
  for (const auto& [target, part] :
       {std::pair(dq, dq_part), std::pair(dk, dk_part), std::pair(dv, dv_part)})
    if (target.defined()) target.add_(part);
}

bool split_sums_supported(const c10::Device& device) {
  const Backend& backend = backend_for(device);
  return backend.bwd_add && backend.round_split;
}

void round_split_(const at::Tensor& high, const at::Tensor& low) {
  TORCH_CHECK(high.scalar_type() == at::kBFloat16 && low.scalar_type() == at::kShort &&
                  high.sizes() == low.sizes() && high.is_contiguous() && low.is_contiguous() &&
                  split_sums_supported(high.device()),
              "cpattn: round_split_ needs contiguous bf16 high and int16 low halves of one shape");
  backend_for(high.device()).round_split(high, low);
}

void merge_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                const at::Tensor& part_lse) {
  TORCH_CHECK(out.stride(3) == 1, "cpattn: merge out must be contiguous in head_dim");
  backend_for(out.device()).merge(out, lse, part_out, part_lse);
}

void apply_sinks_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kFloat &&
                  lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == out.size(0) &&
                  lse.size(1) == out.size(2) && lse.size(2) == out.size(1),
              "cpattn: apply_sinks_ needs out (B, S, H, Dv) and lse (B, H, S), float32, got ",
              out.sizes(), " ", out.scalar_type(), " and ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK(lse.device() == out.device(), "cpattn: apply_sinks_ needs lse on out's device (",
              out.device(), "), got ", lse.device());
  check_per_head("apply_sinks_", "sinks", sinks, out.size(2), out.device());
  backend_for(out.device()).apply_sinks(out, lse, sinks.to(at::kFloat).contiguous());
}

namespace {

// The gradient of the sink logits (H,), reduced over batch and rows (softmax_state.h sink_grad).
at::Tensor sink_bwd(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                    const at::Tensor& sinks, const std::optional<at::Tensor>& dlse) {
  check_bshd(dout, "dout");
  check_bshd(out, "out");
  TORCH_CHECK(dout.sizes() == out.sizes() && dout.device() == out.device(),
              "cpattn: dout must have out's shape ", out.sizes(), " and device ", out.device(),
              ", got ", dout.sizes(), " on ", dout.device());
  const int64_t batch = out.size(0), seqlen = out.size(1), heads = out.size(2);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == batch &&
                  lse.size(1) == heads && lse.size(2) == seqlen && lse.device() == out.device(),
              "cpattn: lse must be float32 of shape (batch, heads, seqlen) = (", batch, ", ", heads,
              ", ", seqlen, ") on ", out.device(), ", got ", lse.sizes(), " ", lse.scalar_type(),
              " on ", lse.device());
  check_per_head("sink_bwd", "sinks", sinks, heads, out.device());
  if (dlse && dlse->defined())
    TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->device() == out.device(),
                "cpattn: dlse must have lse's shape ", lse.sizes(), " and device ", out.device(),
                ", got ", dlse->sizes(), " on ", dlse->device());
  return backend_for(out.device())
      .sink_bwd(dout, out, lse, sinks.to(at::kFloat).contiguous(), dlse);
}

at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b) {
  check_bshd(a, "a");
  TORCH_CHECK(a.sizes() == b.sizes() && a.device() == b.device(),
              "cpattn: row_dot needs a and b of one shape and device, got ", a.sizes(), " on ",
              a.device(), " and ", b.sizes(), " on ", b.device());
  return backend_for(a.device()).row_dot(a, b);
}

}  // namespace

void impl_attention_ops(torch::Library& m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_bwd_in_dout", &attention_bwd_in_dout);
  m.impl("merge_state_", &merge_state_);
  m.impl("apply_sinks_", &apply_sinks_);
  m.impl("sink_bwd", &sink_bwd);
  m.impl("row_dot", &row_dot);
}

}  // namespace cpattn::ops
