// The op layer: the only code that sees at::Tensor. Checks arguments, packs operands, fills the
// plain parameter structs of cpattn/params.h and calls the kernels of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cpattn/params.h"

namespace cpattn::ops {

// The score options of a call (ScoreOptions, params.h) with tensors: softcap (0: none),
// alibi_slopes and sinks ((H,) float, or none), the ALiBi positions of local query 0 / key 0 and
// their stride. sinks are applied by a forward given them; a driver that merges partial results
// passes none per step and applies them once at the end (apply_sinks_).
struct ScoreArgs {
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
  std::optional<at::Tensor> sinks;
  int64_t alibi_q_begin = 0;
  int64_t alibi_k_begin = 0;
  int64_t alibi_stride = 1;
};

// Checks softcap, alibi_slopes and sinks for `heads` query heads on `device`; `fn` names the
// calling function in the messages.
void check_score_args(const char* fn, double softcap,
                      const std::optional<at::Tensor>& alibi_slopes,
                      const std::optional<at::Tensor>& sinks, int64_t heads, at::Device device);

// Local attention on global positions: query row r at q_offset + r, key column c at k_offset + c.
// Returns out (B, Sq, H, Dv) in out_dtype (default q's dtype) and lse (B, H, Sq) fp32. Options
// (DESIGN.md order): softcap > 0, alibi_slopes (H,), keys below prefix_len (> 0) seen by every
// query, sinks (H,) in each row's denominator (the LSE returned includes them).
std::tuple<at::Tensor, at::Tensor> attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, int64_t q_offset, int64_t k_offset,
    std::optional<at::ScalarType> out_dtype, double softcap = 0.0,
    const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
    const std::optional<at::Tensor>& sinks = std::nullopt, int64_t prefix_len = 0);

// Gradients of q, k, v from the global out and lse of the query rows; grad_dtype defaults to the
// inputs' dtypes (fp32 is what a ring accumulates in). dlse (B, H, Sq), when given, is the
// gradient flowing into lse: d lse_i / d s_ij = p_ij, so it enters as delta - dlse. lse includes
// the sinks of the forward (they need nothing else here: sink_bwd gives their gradient).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, int64_t q_offset, int64_t k_offset,
    std::optional<at::ScalarType> grad_dtype, const std::optional<at::Tensor>& dlse,
    double softcap = 0.0, const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
    int64_t prefix_len = 0);

// The same two on a Mask and ScoreArgs (the ring drivers' sub-problems).
std::tuple<at::Tensor, at::Tensor> attention_fwd_scored(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, double softmax_scale,
                                                        const Mask& mask, const ScoreArgs& score,
                                                        std::optional<at::ScalarType> out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_scored(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Mask& mask,
    const ScoreArgs& score, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& dlse);

// Adds the sinks (H,) to merged results in place, once (softmax_state.h add_sink): out
// (B, S, H, Dv) fp32, lse (B, H, S) fp32, any strides.
void apply_sinks_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks);

// Gradient of the sinks (H,), fp32, from the rows of (dout, out, lse) (lse with the sinks):
// sum over rows of -exp(sink_h - lse) (rowsum(dout * out) - dlse). Under context parallelism each
// rank gets its own rows' share, like any parameter gradient.
at::Tensor sink_bwd(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                    const at::Tensor& sinks, const std::optional<at::Tensor>& dlse);

// Merges a partial result (part_out, part_lse) into the running (out, lse), in place.
// out (B, S, H, D) fp32, lse (B, H, S) fp32; part_out any float dtype of out's shape.
void merge_state_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                  const at::Tensor& part_lse);

// merge_state_ without the argument checks, on any strides (the ring driver merges into views).
void merge_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                const at::Tensor& part_lse);

// Checks shared by every backend's merge_state_.
void check_merge_args(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                      const at::Tensor& part_lse);

#ifdef CPATTN_WITH_CUDA
void merge_state_cuda_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                       const at::Tensor& part_lse);
void merge_into_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse);

// The CUDA kernels behind attention_fwd / attention_bwd (csrc/ops/attention_cuda.cpp), called
// with arguments already checked by them (shape s, the mask on local indices).
std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const AttnShape& s,
                                                      double softmax_scale, const Mask& mask,
                                                      at::ScalarType out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const AttnShape& s, double softmax_scale, const Mask& mask,
    std::optional<at::ScalarType> grad_dtype);
#endif

}  // namespace cpattn::ops
