// Argument checks of the op layer, one home for every backend: the device-generic ops
// (attention.cpp, ring.cpp, inference.cpp) run them before calling a backend's kernels
// (backend.h), so a CPU and a CUDA tensor get the same message for the same mistake.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "cpattn/layout.h"
#include "cpattn/params.h"

namespace cpattn::ops {

constexpr int64_t kMaxHeadDim = 256;

bool is_float_type(at::ScalarType t);

// A new output tensor; with CPATTN_POISON=1 (the tests) filled with NaN first, so an element a
// kernel forgets to write shows up as NaN instead of plausible leftover memory.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// t is (batch, seqlen, heads, head_dim), a float dtype, contiguous in head_dim, not empty.
void check_bshd(const at::Tensor& t, const char* name);

// q, k, v of one attention call (dims, dtypes, devices, head counts); their shape.
AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
// Their shape only, for tensors already checked (check_qkv) or runs of tokens of such tensors.
AttnShape attn_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// The window sides (>= 0, or -1 for unbounded) and softmax_scale (finite and > 0 in fp32).
void check_mask_args(double softmax_scale, int64_t window_left, int64_t window_right);

// The query and key positions of a call stay within +-kMaxPosition (mask.h).
void check_positions(int64_t q_offset, int64_t seqlen_q, int64_t k_offset, int64_t seqlen_k);

// prefix_len >= 0 (0: no prefix-LM rule); `fn` names the calling function.
void check_prefix_len(const char* fn, int64_t prefix_len);

// A per-head tensor argument `name` (alibi_slopes, sinks), when given: (heads,), a float dtype,
// on `device`.
void check_per_head(const char* fn, const char* name, const std::optional<at::Tensor>& t,
                    int64_t heads, at::Device device);

// dout, out, lse, dlse and grad_dtype of a backward call on q, k, v of shape s; out may be
// undefined (its rowsum term folded into dlse, attention_bwd's row_dot).
void check_bwd_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                    const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                    std::optional<at::ScalarType> grad_dtype, const AttnShape& s);

// out (B, S, H, D) fp32 and lse (B, H, S) fp32 written in place with part_out / part_lse.
void check_merge_args(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                      const at::Tensor& part_lse);

// A layout code of the ops (0 contiguous, 1 zigzag, 2 striped).
Layout checked_layout(int64_t layout);

// 0 <= rank < world.
void check_rank(int64_t rank, int64_t world);

}  // namespace cpattn::ops
