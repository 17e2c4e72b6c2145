// The op layer: the only code that sees at::Tensor. Checks arguments (checks.h), packs operands,
// fills the plain parameter structs of cpattn/params.h and calls the kernels of the tensors'
// device (backend.h). What the drivers (ring.cpp, inference.cpp) call.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cpattn/params.h"
#include "ops/options.h"

namespace cpattn::ops {

// Local attention on global positions, the ring drivers' sub-problems: query row r at
// mask.q_offset + r, key column c at mask.k_offset + c. Returns out (B, Sq, H, Dv) in out_dtype
// (default q's dtype) and lse (B, H, Sq) fp32. Score options in docs/design.md's order; the sinks,
// when given, join each row's denominator (the LSE returned includes them).
std::tuple<at::Tensor, at::Tensor> attention_fwd_scored(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, double softmax_scale,
                                                        const Mask& mask, const ScoreArgs& score,
                                                        std::optional<at::ScalarType> out_dtype);
// Gradients of q, k, v from the global out and lse of the query rows; grad_dtype defaults to the
// inputs' dtypes (fp32 is what a ring accumulates in). dlse (B, H, Sq), when given, is the
// gradient flowing into lse: d lse_i / d s_ij = p_ij, so it enters as delta - dlse. lse includes
// the sinks of the forward (they need nothing else here: the op sink_bwd gives their gradient).
// An undefined out: no rowsum(dout * out) term (the caller folded it into dlse).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_scored(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Mask& mask,
    const ScoreArgs& score, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& dlse);

// attention_bwd_scored with dq (of q's dtype) written over dout, which must have q's shape and
// dtype and must not overlap q, k or v: returns dk, dv; dq is dout afterwards. For a caller that
// owns dout and needs it no more (Ulysses: dout by heads, received from the all-to-all).
std::tuple<at::Tensor, at::Tensor> attention_bwd_in_dout_scored(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Mask& mask,
    const ScoreArgs& score, const std::optional<at::Tensor>& dlse);

// attention_bwd_scored adding the gradients (fp32) into dq, dk, dv, fp32 tensors of q's, k's and
// v's shapes with head_dim contiguous, instead of returning new ones: the ring's accumulators
// take a sub-problem's gradients without a temporary. With dq_low, dq holds split fp32 sums: dq
// bf16 their high halves, dq_low (int16, dq's shape and strides) their low halves (only where
// split_sums_supported). An undefined dq, or dk and dv: not wanted (their products skipped).
// Under score.fixed_order (CPU only) the fp32 dq, dk and dv are running sums, unscaled, that the
// call continues in its fixed order, nothing scaled: calls over consecutive parts of the keys
// (dq) or queries (dk, dv) starting at multiples of kInvariantRowBand give one call's sums
// (cpu/attention_kernel.h backward_row_bands; invariant mode's streamed backward).
void attention_bwd_add_scored(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                              const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                              double softmax_scale, const Mask& mask, const ScoreArgs& score,
                              const std::optional<at::Tensor>& dlse,
                              const std::optional<at::Tensor>& dq_low = std::nullopt);
// attention_fwd_scored and attention_bwd_add_scored without their checks, for a driver that
// checked its whole call once before (ring.cpp: check_ring_args and check_kernel_args;
// invariant.cpp: check_tile_args): its sub-problems are runs of tokens of those tensors at
// positions within the checked sequence, so every check would pass again. The checks run once per
// call, not once per sub-problem.
std::tuple<at::Tensor, at::Tensor> attention_fwd_unchecked(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v,
                                                           double softmax_scale, const Mask& mask,
                                                           const ScoreArgs& score,
                                                           at::ScalarType out_dtype);
void attention_bwd_add_unchecked(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                                 const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 double softmax_scale, const Mask& mask, const ScoreArgs& score,
                                 const std::optional<at::Tensor>& dlse,
                                 const std::optional<at::Tensor>& dq_low);
// The checks of one local attention call, of both passes (what attention_fwd_scored and the
// backward entries check first); the shape of q, k, v. A driver that checks its whole call once
// (invariant.cpp) calls it at its entry, then the unchecked entries per sub-problem.
AttnShape check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               double softmax_scale, const Mask& mask, const ScoreArgs& score);
// How many times the checks of one local attention call (check_attention_args) have run in this
// process: the test that the ring's sub-problems skip them reads it (cpattn_testing).
int64_t attention_checks_run();
// Whether the backend of `device` adds into split sums and rounds them (round_split_).
bool split_sums_supported(const c10::Device& device);
// Rounds split fp32 sums to the nearest bf16, in place in `high` (bf16); low int16, both
// contiguous and of one shape.
void round_split_(const at::Tensor& high, const at::Tensor& low);

// Adds the sinks (H,) to merged results in place, once (softmax_state.h add_sink): out
// (B, S, H, Dv) fp32, lse (B, H, S) fp32, any strides.
void apply_sinks_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks);

// Merges a partial result (part_out, part_lse) into the running (out, lse), in place, on any
// strides (the ring driver merges into views); the op merge_state_ checks its arguments first.
// out (B, S, H, D) fp32, lse (B, H, S) fp32; part_out any float dtype of out's shape.
void merge_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                const at::Tensor& part_lse);

}  // namespace cpattn::ops
