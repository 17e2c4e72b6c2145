#include "ops/checks.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cpattn/env.h"
#include "ops/backend.h"

namespace cpattn::ops {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  static const bool poison = env::poison_outputs();
  at::Tensor t = at::empty(sizes, options);
  if (poison) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "cpattn: ", name,
              " must have 4 dims (batch, seqlen, heads, head_dim), got ", t.dim(),
              " dims with shape ", t.sizes());
  TORCH_CHECK(is_float_type(t.scalar_type()), "cpattn: ", name,
              " must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, "cpattn: ", name,
              " must be contiguous in its last dim (head_dim), got stride ", t.stride(-1));
  TORCH_CHECK(t.numel() > 0, "cpattn: ", name, " is empty (shape ", t.sizes(), ")");
}

AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_bshd(q, "q");
  check_bshd(k, "k");
  check_bshd(v, "v");
  TORCH_CHECK(k.sizes().slice(0, 3) == v.sizes().slice(0, 3),
              "cpattn: k and v must have the same (batch, seqlen, kv_heads), got k ", k.sizes(),
              " and v ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0), "cpattn: q and k must have the same batch size, got ",
              q.size(0), " and ", k.size(0));
  TORCH_CHECK(q.size(3) == k.size(3), "cpattn: q and k must have the same head_dim, got ",
              q.size(3), " and ", k.size(3));
  TORCH_CHECK(q.size(3) <= kMaxHeadDim, "cpattn: unsupported head_dim ", q.size(3),
              " (supported: 1 to ", kMaxHeadDim, ")");
  TORCH_CHECK(v.size(3) <= kMaxHeadDim, "cpattn: unsupported head_dim of v ", v.size(3),
              " (supported: 1 to ", kMaxHeadDim, ")");
  TORCH_CHECK(q.size(2) % k.size(2) == 0, "cpattn: the number of query heads (", q.size(2),
              ") must be a multiple of the number of key/value heads (", k.size(2), ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "cpattn: q, k and v must have the same dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(),
              "cpattn: q, k and v must be on the same device, got ", q.device(), ", ", k.device(),
              " and ", v.device());
  backend_for(q.device());  // raises for a device without kernels in this build
  return attn_shape(q, k, v);
}

AttnShape attn_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  AttnShape s;
  s.batch = q.size(0);
  s.seqlen_q = q.size(1);
  s.heads = q.size(2);
  s.head_dim = q.size(3);
  s.seqlen_k = k.size(1);
  s.kv_heads = k.size(2);
  s.head_dim_padded = (s.head_dim + 15) / 16 * 16;
  s.head_dim_v = v.size(3);
  s.head_dim_v_padded = (s.head_dim_v + 15) / 16 * 16;
  return s;
}

void check_mask_args(double softmax_scale, int64_t window_left, int64_t window_right) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "cpattn: window must be (left, right) with each >= 0 or -1 for unbounded, got (",
              window_left, ", ", window_right, ")");
  // the kernels use it as a float
  const float scale = static_cast<float>(softmax_scale);
  TORCH_CHECK(std::isfinite(scale) && scale > 0,
              "cpattn: softmax_scale must be finite and positive in float32, got ", softmax_scale,
              softmax_scale == 0 ? " (the ops have no default scale: pass it)" : "");
}

void check_positions(int64_t q_offset, int64_t seqlen_q, int64_t k_offset, int64_t seqlen_k) {
  for (auto [name, offset, length] :
       {std::tuple{"q_offset", q_offset, seqlen_q}, std::tuple{"k_offset", k_offset, seqlen_k}})
    TORCH_CHECK(offset >= -kMaxPosition && offset <= kMaxPosition - length, "cpattn: ", name, " = ",
                offset, " puts positions outside [-", kMaxPosition, ", ", kMaxPosition,
                "] (2^61 - 2) with ", length, " tokens");
}

void check_prefix_len(const char* fn, int64_t prefix_len) {
  TORCH_CHECK(prefix_len >= 0, "cpattn.", fn, ": prefix_len must be >= 0 (0: none), got ",
              prefix_len);
}

void check_per_head(const char* fn, const char* name, const std::optional<at::Tensor>& t,
                    int64_t heads, at::Device device) {
  if (!t.has_value()) return;
  const at::Tensor& x = *t;
  TORCH_CHECK(x.dim() == 1 && x.size(0) == heads, "cpattn.", fn, ": ", name,
              " must have shape (heads,) = (", heads, ",), got ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), "cpattn.", fn, ": ", name,
              " must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.device() == device, "cpattn.", fn, ": ", name, " must be on q's device ", device,
              ", got ", x.device());
}

void check_bwd_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                    const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                    std::optional<at::ScalarType> grad_dtype, const AttnShape& s) {
  check_bshd(dout, "dout");
  const std::vector<int64_t> out_shape{s.batch, s.seqlen_q, s.heads, s.head_dim_v};
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(out_shape),
              "cpattn: dout must have q's shape with v's head_dim ", at::IntArrayRef(out_shape),
              ", got ", dout.sizes());
  const at::Tensor& o = out.defined() ? out : dout;  // undefined: delta is -dlse (row_dot)
  check_bshd(o, "out");
  TORCH_CHECK(o.sizes() == at::IntArrayRef(out_shape),
              "cpattn: out must have q's shape with v's head_dim ", at::IntArrayRef(out_shape),
              ", got ", o.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == s.batch && lse.size(1) == s.heads &&
                  lse.size(2) == s.seqlen_q,
              "cpattn: lse must have shape (batch, heads, seqlen_q) = (", s.batch, ", ", s.heads,
              ", ", s.seqlen_q, "), got ", lse.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "cpattn: lse must be float32, got ",
              lse.scalar_type());
  TORCH_CHECK(dout.device() == q.device() && o.device() == q.device() && lse.device() == q.device(),
              "cpattn: dout, out and lse must be on q's device ", q.device());
  if (grad_dtype)
    TORCH_CHECK(is_float_type(*grad_dtype),
                "cpattn: grad_dtype must be float32, bfloat16 or float16, got ", *grad_dtype);
  if (dlse && dlse->defined())
    TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->device() == lse.device(),
                "cpattn: dlse must have lse's shape ", lse.sizes(), " and device, got ",
                dlse->sizes(), " on ", dlse->device());
}

void check_merge_args(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                      const at::Tensor& part_lse) {
  TORCH_CHECK(out.dim() == 4, "cpattn: merge out must be (batch, seqlen, heads, head_dim), got ",
              out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
                  part_lse.scalar_type() == at::kFloat,
              "cpattn: merge out, lse and part_lse must be float32, got ", out.scalar_type(), ", ",
              lse.scalar_type(), ", ", part_lse.scalar_type());
  TORCH_CHECK(is_float_type(part_out.scalar_type()),
              "cpattn: merge part_out must be float32, bfloat16 or float16, got ",
              part_out.scalar_type());
  TORCH_CHECK(part_out.sizes() == out.sizes(), "cpattn: merge part_out must have out's shape ",
              out.sizes(), ", got ", part_out.sizes());
  const std::vector<int64_t> lse_shape{out.size(0), out.size(2), out.size(1)};
  TORCH_CHECK(
      lse.sizes() == at::IntArrayRef(lse_shape) && part_lse.sizes() == at::IntArrayRef(lse_shape),
      "cpattn: merge lse and part_lse must have shape (batch, heads, seqlen) = ",
      at::IntArrayRef(lse_shape), ", got ", lse.sizes(), " and ", part_lse.sizes());
  TORCH_CHECK(out.stride(3) == 1,
              "cpattn: merge out must be contiguous in its last dim "
              "(head_dim), got stride ",
              out.stride(3));
  // Written in place: as torch's in-place ops, refuse elements that share memory (an expanded
  // out would get every merge written through one element).
  for (auto [name, t] : {std::pair{"out", &out}, std::pair{"lse", &lse}})
    TORCH_CHECK(at::has_internal_overlap(*t) != at::MemOverlap::Yes, "cpattn: merge_state_ ", name,
                " (shape ", t->sizes(), ", strides ", t->strides(),
                ") has elements that share memory (e.g. an expanded tensor); it is written in "
                "place, so pass a tensor with distinct elements (.contiguous())");
  TORCH_CHECK(lse.device() == out.device() && part_out.device() == out.device() &&
                  part_lse.device() == out.device(),
              "cpattn: merge tensors must be on one device, got ", out.device(), ", ", lse.device(),
              ", ", part_out.device(), ", ", part_lse.device());
}

Layout checked_layout(int64_t layout) {
  TORCH_CHECK(layout >= 0 && layout <= 2,
              "cpattn: layout code must be 0 (contiguous), 1 (zigzag) "
              "or 2 (striped), got ",
              layout);
  return static_cast<Layout>(layout);
}

void check_rank(int64_t rank, int64_t world) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "cpattn: rank ", rank,
              " is not in a group of ", world);
}

}  // namespace cpattn::ops
