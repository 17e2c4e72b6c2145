// The op layer: the only code that sees at::Tensor. Checks arguments, packs operands, fills the
// plain parameter structs of cpattn/params.h and calls the kernels of the tensors' device.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cpattn/params.h"

namespace cpattn::ops {

// Local attention on global positions: query row r at q_offset + r, key column c at k_offset + c.
// Returns out (B, Sq, H, D) in out_dtype (default q's dtype) and lse (B, H, Sq) fp32.
std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, double softmax_scale,
                                                 bool causal, int64_t window_left,
                                                 int64_t window_right, int64_t q_offset,
                                                 int64_t k_offset,
                                                 std::optional<at::ScalarType> out_dtype);

// Gradients of q, k, v from the global out and lse of the query rows; grad_dtype defaults to the
// inputs' dtypes (fp32 is what a ring accumulates in). dlse (B, H, Sq), when given, is the
// gradient flowing into lse: d lse_i / d s_ij = p_ij, so it enters as delta - dlse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, int64_t q_offset, int64_t k_offset,
    std::optional<at::ScalarType> grad_dtype, const std::optional<at::Tensor>& dlse);

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
