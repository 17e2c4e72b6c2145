#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <tuple>
#include <utility>

#include "cpattn/params.h"
#include "cpattn/softmax_state.h"
#include "cpu/kernels.h"
#include "ops/ops.h"

namespace cpattn::ops {
namespace {

constexpr int64_t kMaxHeadDim = 256;

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Tests set CPATTN_POISON=1: every output buffer is filled with NaN before the kernel runs, so an
// element the kernel forgets to write shows up as NaN instead of plausible leftover memory.
bool poison_outputs() {
  static const bool on = [] {
    const char* v = std::getenv("CPATTN_POISON");
    return v && v[0] == '1';
  }();
  return on;
}
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_outputs()) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "cpattn: ", name, " must have 4 dims (batch, seqlen, heads, head_dim), got ",
              t.dim(), " dims with shape ", t.sizes());
  TORCH_CHECK(is_float_type(t.scalar_type()), "cpattn: ", name,
              " must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, "cpattn: ", name,
              " must be contiguous in its last dim (head_dim), got stride ", t.stride(-1));
  TORCH_CHECK(t.numel() > 0, "cpattn: ", name, " is empty (shape ", t.sizes(), ")");
}

void check_mask_args(double softmax_scale, int64_t window_left, int64_t window_right) {
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "cpattn: window must be (left, right) with each >= 0 or -1 for unbounded, got (",
              window_left, ", ", window_right, ")");
  // the kernels use it as a float
  const float scale = static_cast<float>(softmax_scale);
  TORCH_CHECK(std::isfinite(scale) && scale > 0,
              "cpattn: softmax_scale must be finite and positive in float32, got ", softmax_scale);
}

void check_positions(int64_t q_offset, int64_t seqlen_q, int64_t k_offset, int64_t seqlen_k) {
  for (auto [name, offset, length] : {std::tuple{"q_offset", q_offset, seqlen_q},
                                      std::tuple{"k_offset", k_offset, seqlen_k}})
    TORCH_CHECK(offset >= -kMaxPosition && offset <= kMaxPosition - length, "cpattn: ", name,
                " = ", offset, " puts positions outside [-", kMaxPosition, ", ", kMaxPosition,
                "] (2^61 - 2) with ", length, " tokens");
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
  TORCH_CHECK(q.size(3) == k.size(3), "cpattn: q and k must have the same head_dim, got ", q.size(3),
              " and ", k.size(3));
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
#ifdef CPATTN_WITH_CUDA
  TORCH_CHECK(q.device().is_cpu() || q.device().is_cuda(), "cpattn: no kernel for device ",
              q.device(), " (CPU and CUDA tensors only)");
#else
  TORCH_CHECK(q.device().is_cpu(), "cpattn: no kernel for device ", q.device(),
              " in this build (CPU tensors only)");
#endif
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

// (H,) float tensor -> contiguous fp32 for the kernels.
at::Tensor per_head_f32(const std::optional<at::Tensor>& t) {
  return t->to(at::kFloat).contiguous();
}

// The kernels' ScoreOptions from ScoreArgs; slopes and sinks receive the fp32 copies the
// pointers point into (the caller keeps them alive).
ScoreOptions score_options(const ScoreArgs& a, at::Tensor& slopes, at::Tensor& sinks) {
  ScoreOptions o;
  o.softcap = static_cast<float>(a.softcap);
  if (a.alibi_slopes) {
    slopes = per_head_f32(a.alibi_slopes);
    o.alibi_slopes = slopes.data_ptr<float>();
  }
  if (a.sinks) {
    sinks = per_head_f32(a.sinks);
    o.sinks = sinks.data_ptr<float>();
  }
  o.alibi_q_begin = a.alibi_q_begin;
  o.alibi_k_begin = a.alibi_k_begin;
  o.alibi_stride = a.alibi_stride;
  return o;
}

// A mask with the prefix-LM rule on when prefix_len > 0.
Mask with_prefix(Mask m, int64_t prefix_len) {
  if (prefix_len > 0) m.prefix_end = prefix_len;
  return m;
}

#ifdef CPATTN_WITH_CUDA
// The options the CUDA kernels do not have yet raise on CUDA tensors (no silent drop).
void check_cuda_supports(const AttnShape& s, const Mask& mask, const ScoreArgs& score) {
  TORCH_CHECK(s.head_dim_v == s.head_dim,
              "cpattn: the CUDA kernels need v's head_dim equal to q's (got ", s.head_dim_v,
              " and ", s.head_dim, "); head_dim_v != head_dim runs on CPU tensors only");
  TORCH_CHECK(!mask.has_prefix(), "cpattn: prefix_len is not supported by the CUDA kernels yet "
              "(CPU tensors only)");
  TORCH_CHECK(score.softcap == 0.0 && !score.alibi_slopes && !score.sinks,
              "cpattn: softcap, alibi_slopes and sinks are not supported by the CUDA kernels "
              "yet (CPU tensors only)");
}
#endif



// (B, S, H, D) any dtype -> (B, H, S, Dp) contiguous in `dtype`, zero beyond D: one copy that
// converts and transposes together.
at::Tensor pack(const at::Tensor& t, int64_t dp, at::ScalarType dtype = at::kFloat) {
  const int64_t dim = t.size(3);
  at::Tensor p = at::empty({t.size(0), t.size(2), t.size(1), dp}, t.options().dtype(dtype));
  if (dp != dim) p.narrow(3, dim, dp - dim).zero_();
  p.narrow(3, 0, dim).copy_(t.transpose(1, 2));
  return p;
}

// (B, Hkv, Sk, Dp) -> (B, Hkv, ceil(Sk / 2), Dp, 2): keys 2j and 2j+1 side by side (a zero key
// past an odd end), the layout bf16 dot products reduce over keys with.
at::Tensor pair_keys(const at::Tensor& packed) {
  at::Tensor t = packed;
  if (t.size(2) % 2) t = at::constant_pad_nd(t, {0, 0, 0, 1}, 0.0);
  return t.view({t.size(0), t.size(1), t.size(2) / 2, 2, t.size(3)}).transpose(3, 4).contiguous();
}

Mask make_mask(bool causal, int64_t window_left, int64_t window_right, int64_t q_offset,
               int64_t k_offset) {
  Mask m;
  m.causal = causal;
  m.window_left = normalized_window(window_left);
  m.window_right = normalized_window(window_right);
  m.q_offset = q_offset;
  m.k_offset = k_offset;
  return m;
}

BshdStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The CPU kernels write their outputs in the dtype asked for (no conversion pass afterwards).
BshdOutput output_of(const at::Tensor& t) {
  const at::ScalarType dtype = t.scalar_type();
  return {t.data_ptr(), strides_of(t),
          dtype == at::kBFloat16 ? OutType::kBFloat16
          : dtype == at::kHalf   ? OutType::kFloat16
                                 : OutType::kFloat32};
}
const uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d] in fp32, for contiguous (B, S, H, D)
// operands: one pass over both (torch's fp32 product and sum(-1) took a tenth of a bf16
// backward).
template <typename T>
void rowwise_dot(const T* dout, const T* out, const AttnShape& s, float* delta) {
  constexpr int kPartials = 16;  // independent sums, so the loop vectorises
  const int64_t dim = s.head_dim_v;
  at::parallel_for(0, s.batch * s.seqlen_q, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row = b * Sq + i
      const int64_t b = row / s.seqlen_q, i = row % s.seqlen_q;
      for (int64_t h = 0; h < s.heads; ++h) {
        const T* x = dout + (row * s.heads + h) * dim;
        const T* y = out + (row * s.heads + h) * dim;
        float partial[kPartials] = {};
        int64_t d = 0;
        for (; d + kPartials <= dim; d += kPartials)
          for (int l = 0; l < kPartials; ++l)
            partial[l] += static_cast<float>(x[d + l]) * static_cast<float>(y[d + l]);
        float sum = 0.f;
        for (; d < dim; ++d) sum += static_cast<float>(x[d]) * static_cast<float>(y[d]);
        for (int l = 0; l < kPartials; ++l) sum += partial[l];
        delta[(b * s.heads + h) * s.seqlen_q + i] = sum;
      }
    }
  });
}

// The backward's delta = rowsum(dout * out), (B, H, Sq) fp32.
at::Tensor row_delta(const at::Tensor& dout, const at::Tensor& out, const AttnShape& s) {
  const bool same = dout.scalar_type() == out.scalar_type();
  const at::Tensor x = (same ? dout : dout.to(at::kFloat)).contiguous();
  const at::Tensor y = (same ? out : out.to(at::kFloat)).contiguous();
  at::Tensor delta = at::empty({s.batch, s.heads, s.seqlen_q}, dout.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "cpattn_row_delta",
                                  [&] {
                                    rowwise_dot(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), s,
                                                delta.data_ptr<float>());
                                  });
  return delta;
}

}  // namespace

void check_score_args(const char* fn, double softcap,
                      const std::optional<at::Tensor>& alibi_slopes,
                      const std::optional<at::Tensor>& sinks, int64_t heads, at::Device device) {
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, "cpattn.", fn,
              ": softcap must be a finite number >= 0 (0: no softcap), got ", softcap);
  const std::pair<const char*, const std::optional<at::Tensor>*> per_head[] = {
      {"alibi_slopes", &alibi_slopes}, {"sinks", &sinks}};
  for (const auto& [name, t] : per_head) {
    if (!t->has_value()) continue;
    const at::Tensor& x = **t;
    TORCH_CHECK(x.dim() == 1 && x.size(0) == heads, "cpattn.", fn, ": ", name,
                " must have shape (heads,) = (", heads, ",), got ", x.sizes());
    TORCH_CHECK(is_float_type(x.scalar_type()), "cpattn.", fn, ": ", name,
                " must be float32, bfloat16 or float16, got ", x.scalar_type());
    TORCH_CHECK(x.device() == device, "cpattn.", fn, ": ", name, " must be on q's device ",
                device, ", got ", x.device());
  }
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_scored(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, double softmax_scale,
                                                        const Mask& mask, const ScoreArgs& score,
                                                        std::optional<at::ScalarType> out_dtype) {
  const AttnShape s = check_qkv(q, k, v);
  check_mask_args(softmax_scale, mask.window_left, mask.window_right);
  check_positions(mask.q_offset, s.seqlen_q, mask.k_offset, s.seqlen_k);
  check_score_args("attention", score.softcap, score.alibi_slopes, score.sinks, s.heads,
                   q.device());
  const at::ScalarType dtype = out_dtype.value_or(q.scalar_type());
  TORCH_CHECK(is_float_type(dtype), "cpattn: out_dtype must be float32, bfloat16 or float16, got ",
              dtype);
#ifdef CPATTN_WITH_CUDA
  if (q.is_cuda()) {
    check_cuda_supports(s, mask, score);
    return attention_fwd_cuda(q, k, v, s, softmax_scale, mask, dtype);
  }
#endif

  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out =
      new_output({s.batch, s.seqlen_q, s.heads, s.head_dim_v}, q.options().dtype(dtype));
  at::Tensor lse = new_output({s.batch, s.heads, s.seqlen_q}, f32);

  FwdParams p;
  p.shape = s;
  at::Tensor qp, kp, vp;
  if (q.scalar_type() == at::kBFloat16 && cpu::has_bf16_dot()) {
    // bf16 dot products: operands stay bf16, Q is read in place; V gets its key pairs
    // interleaved.
    kp = pack(k, s.head_dim_padded, at::kBFloat16);
    vp = pair_keys(pack(v, s.head_dim_v_padded, at::kBFloat16));
    p.q16 = bf16_data(q);
    p.q16_strides = strides_of(q);
    p.k16 = bf16_data(kp);
    p.v16 = bf16_data(vp);
  } else {
    qp = pack(q, s.head_dim_padded);
    kp = pack(k, s.head_dim_padded);
    vp = pack(v, s.head_dim_v_padded);
    p.q = qp.data_ptr<float>();
    p.k = kp.data_ptr<float>();
    p.v = vp.data_ptr<float>();
  }
  p.out = output_of(out);
  p.lse = lse.data_ptr<float>();
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.mask = mask;
  at::Tensor slopes, sinks;  // kept alive for the kernel
  p.score = score_options(score, slopes, sinks);
  cpu::attention_fwd(p);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale,
    bool causal, int64_t window_left, int64_t window_right, int64_t q_offset, int64_t k_offset,
    std::optional<at::ScalarType> out_dtype, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    int64_t prefix_len) {
  TORCH_CHECK(prefix_len >= 0, "cpattn.attention: prefix_len must be >= 0 (0: none), got ",
              prefix_len);
  ScoreArgs score;
  score.softcap = softcap;
  score.alibi_slopes = alibi_slopes;
  score.sinks = sinks;
  score.alibi_q_begin = q_offset;
  score.alibi_k_begin = k_offset;
  return attention_fwd_scored(
      q, k, v, softmax_scale,
      with_prefix(make_mask(causal, window_left, window_right, q_offset, k_offset), prefix_len),
      score, out_dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_scored(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Mask& mask,
    const ScoreArgs& score, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& dlse) {
  const AttnShape s = check_qkv(q, k, v);
  check_mask_args(softmax_scale, mask.window_left, mask.window_right);
  check_positions(mask.q_offset, s.seqlen_q, mask.k_offset, s.seqlen_k);
  check_score_args("attention", score.softcap, score.alibi_slopes, score.sinks, s.heads,
                   q.device());
  check_bshd(dout, "dout");
  check_bshd(out, "out");
  const std::vector<int64_t> out_shape{s.batch, s.seqlen_q, s.heads, s.head_dim_v};
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(out_shape),
              "cpattn: dout must have q's shape with v's head_dim ", at::IntArrayRef(out_shape),
              ", got ", dout.sizes());
  TORCH_CHECK(out.sizes() == at::IntArrayRef(out_shape),
              "cpattn: out must have q's shape with v's head_dim ", at::IntArrayRef(out_shape),
              ", got ", out.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == s.batch && lse.size(1) == s.heads &&
                  lse.size(2) == s.seqlen_q,
              "cpattn: lse must have shape (batch, heads, seqlen_q) = (", s.batch, ", ", s.heads,
              ", ", s.seqlen_q, "), got ", lse.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "cpattn: lse must be float32, got ",
              lse.scalar_type());
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "cpattn: dout, out and lse must be on q's device ", q.device());
  if (grad_dtype)
    TORCH_CHECK(is_float_type(*grad_dtype),
                "cpattn: grad_dtype must be float32, bfloat16 or float16, got ", *grad_dtype);
  if (dlse && dlse->defined())
    TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->device() == lse.device(),
                "cpattn: dlse must have lse's shape ", lse.sizes(), " and device, got ",
                dlse->sizes(), " on ", dlse->device());
#ifdef CPATTN_WITH_CUDA
  if (q.is_cuda()) {
    check_cuda_supports(s, mask, score);
    return attention_bwd_cuda(dout, q, k, v, out, lse, dlse, s, softmax_scale, mask, grad_dtype);
  }
#endif

  const int64_t dp = s.head_dim_padded, dvp = s.head_dim_v_padded;
  // delta = rowsum(dout * out) per query row, over the global output.
  at::Tensor delta = row_delta(dout, out, s);
  if (dlse && dlse->defined()) delta.sub_(dlse->to(at::kFloat));
  const at::Tensor lse_c = lse.contiguous();
  const at::ScalarType grad = grad_dtype.value_or(q.scalar_type());
  const auto grad_options = q.options().dtype(grad);
  at::Tensor dq = new_output({s.batch, s.seqlen_q, s.heads, s.head_dim}, grad_options);
  at::Tensor dk = new_output({s.batch, s.seqlen_k, s.kv_heads, s.head_dim}, grad_options);
  at::Tensor dv = new_output({s.batch, s.seqlen_k, s.kv_heads, s.head_dim_v}, grad_options);

  BwdParams p;
  p.shape = s;
  at::Tensor qp, kp, vp, dop, k_pairs;
  if (q.scalar_type() == at::kBFloat16 && dout.scalar_type() == at::kBFloat16 &&
      cpu::has_bf16_dot()) {
    // Q and dO are read in place (the kernel packs its query blocks itself).
    kp = pack(k, dp, at::kBFloat16);
    vp = pack(v, dvp, at::kBFloat16);
    k_pairs = pair_keys(kp);
    p.q16 = bf16_data(q);
    p.q16_strides = strides_of(q);
    p.dout16 = bf16_data(dout);
    p.dout16_strides = strides_of(dout);
    p.k16 = bf16_data(kp);
    p.v16 = bf16_data(vp);
    p.k16_pairs = bf16_data(k_pairs);
  } else {
    qp = pack(q, dp);
    kp = pack(k, dp);
    vp = pack(v, dvp);
    dop = pack(dout, dvp);
    p.q = qp.data_ptr<float>();
    p.k = kp.data_ptr<float>();
    p.v = vp.data_ptr<float>();
    p.dout = dop.data_ptr<float>();
  }
  p.lse = lse_c.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq = output_of(dq);
  p.dk = output_of(dk);
  p.dv = output_of(dv);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.mask = mask;
  at::Tensor slopes, sinks;
  p.score = score_options(score, slopes, sinks);
  p.score.sinks = nullptr;  // already in lse
  cpu::attention_bwd(p);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, int64_t q_offset, int64_t k_offset,
    std::optional<at::ScalarType> grad_dtype, const std::optional<at::Tensor>& dlse,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, int64_t prefix_len) {
  TORCH_CHECK(prefix_len >= 0, "cpattn.attention: prefix_len must be >= 0 (0: none), got ",
              prefix_len);
  ScoreArgs score;
  score.softcap = softcap;
  score.alibi_slopes = alibi_slopes;
  score.alibi_q_begin = q_offset;
  score.alibi_k_begin = k_offset;
  return attention_bwd_scored(
      dout, q, k, v, out, lse, softmax_scale,
      with_prefix(make_mask(causal, window_left, window_right, q_offset, k_offset), prefix_len),
      score, grad_dtype, dlse);
}

void apply_sinks_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  TORCH_CHECK(out.dim() == 4 && out.scalar_type() == at::kFloat &&
                  lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                  lse.size(0) == out.size(0) && lse.size(1) == out.size(2) &&
                  lse.size(2) == out.size(1),
              "cpattn: apply_sinks_ needs out (B, S, H, Dv) and lse (B, H, S), float32, got ",
              out.sizes(), " ", out.scalar_type(), " and ", lse.sizes(), " ", lse.scalar_type());
  check_score_args("apply_sinks_", 0.0, std::nullopt, sinks, out.size(2), out.device());
  TORCH_CHECK(out.device().is_cpu(), "cpattn: apply_sinks_ runs on CPU tensors only, got ",
              out.device());
  const at::Tensor sk = sinks.to(at::kFloat).contiguous();
  const float* sink = sk.data_ptr<float>();
  const int64_t B = out.size(0), S = out.size(1), H = out.size(2), D = out.size(3);
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  at::parallel_for(0, B * S * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row = (b * S + s) * H + h
      const int64_t h = row % H, i = (row / H) % S, b = row / (H * S);
      float& lse_ref = l[b * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)];
      const SinkNormalisation n = add_sink(lse_ref, sink[h]);
      float* dst = o + b * out.stride(0) + i * out.stride(1) + h * out.stride(2);
      for (int64_t d = 0; d < D; ++d) dst[d * out.stride(3)] *= n.out_factor;
      lse_ref = n.lse;
    }
  });
}

at::Tensor sink_bwd(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                    const at::Tensor& sinks, const std::optional<at::Tensor>& dlse) {
  check_bshd(dout, "dout");
  check_bshd(out, "out");
  TORCH_CHECK(dout.sizes() == out.sizes(), "cpattn: dout must have out's shape ", out.sizes(),
              ", got ", dout.sizes());
  AttnShape s;
  s.batch = out.size(0);
  s.seqlen_q = out.size(1);
  s.heads = out.size(2);
  s.head_dim_v = out.size(3);
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == s.batch &&
                  lse.size(1) == s.heads && lse.size(2) == s.seqlen_q,
              "cpattn: lse must be float32 of shape (batch, heads, seqlen) = (", s.batch, ", ",
              s.heads, ", ", s.seqlen_q, "), got ", lse.sizes(), " ", lse.scalar_type());
  check_score_args("sink_bwd", 0.0, std::nullopt, sinks, s.heads, out.device());
  TORCH_CHECK(out.device().is_cpu(), "cpattn: sink_bwd runs on CPU tensors only, got ",
              out.device());
  at::Tensor delta = row_delta(dout, out, s);
  if (dlse && dlse->defined()) {
    TORCH_CHECK(dlse->sizes() == lse.sizes(), "cpattn: dlse must have lse's shape ", lse.sizes(),
                ", got ", dlse->sizes());
    delta.sub_(dlse->to(at::kFloat));
  }
  const at::Tensor l = lse.contiguous(), sk = sinks.to(at::kFloat).contiguous();
  at::Tensor grad = at::empty({s.heads}, out.options().dtype(at::kFloat));
  const float* lp = l.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* sp = sk.data_ptr<float>();
  float* gp = grad.data_ptr<float>();
  for (int64_t h = 0; h < s.heads; ++h) {
    double sum = 0.0;  // a fixed order: the same bits with any thread count
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t row = (b * s.heads + h) * s.seqlen_q + i;
        sum += sink_grad(sp[h], lp[row], dp[row]);
      }
    gp[h] = static_cast<float>(sum);
  }
  return grad;
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
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(lse_shape) &&
                  part_lse.sizes() == at::IntArrayRef(lse_shape),
              "cpattn: merge lse and part_lse must have shape (batch, heads, seqlen) = ",
              at::IntArrayRef(lse_shape), ", got ", lse.sizes(), " and ", part_lse.sizes());
  TORCH_CHECK(out.stride(3) == 1, "cpattn: merge out must be contiguous in its last dim "
              "(head_dim), got stride ", out.stride(3));
  // Written in place: as torch's in-place ops, refuse elements that share memory (an expanded
  // out would get every merge written through one element).
  for (auto [name, t] : {std::pair{"out", &out}, std::pair{"lse", &lse}})
    TORCH_CHECK(at::has_internal_overlap(*t) != at::MemOverlap::Yes, "cpattn: merge_state_ ",
                name, " (shape ", t->sizes(), ", strides ", t->strides(),
                ") has elements that share memory (e.g. an expanded tensor); it is written in "
                "place, so pass a tensor with distinct elements (.contiguous())");
  TORCH_CHECK(lse.device() == out.device() && part_out.device() == out.device() &&
                  part_lse.device() == out.device(),
              "cpattn: merge tensors must be on one device, got ", out.device(), ", ", lse.device(),
              ", ", part_out.device(), ", ", part_lse.device());
}

void merge_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                const at::Tensor& part_lse) {
#ifdef CPATTN_WITH_CUDA
  if (out.is_cuda()) return merge_into_cuda(out, lse, part_out, part_lse);
#endif
  TORCH_CHECK(out.stride(3) == 1, "cpattn: merge out must be contiguous in head_dim");
  const at::Tensor po = part_out.to(at::kFloat).contiguous();
  const at::Tensor pl = part_lse.contiguous();
  const int64_t B = out.size(0), S = out.size(1), H = out.size(2), D = out.size(3);
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const float* po_ = po.data_ptr<float>();
  const float* pl_ = pl.data_ptr<float>();
  at::parallel_for(0, B * S * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {  // row = (b * S + s) * H + h
      const int64_t h = row % H, s = (row / H) % S, b = row / (H * S);
      float& lse_ref = l[b * lse.stride(0) + h * lse.stride(1) + s * lse.stride(2)];
      const MergeWeights w = merge_weights(lse_ref, pl_[(b * H + h) * S + s]);
      float* dst = o + b * out.stride(0) + s * out.stride(1) + h * out.stride(2);
      const float* src = po_ + row * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = w.weight_a * dst[d] + w.weight_b * src[d];
      lse_ref = w.lse;
    }
  });
}

void merge_state_(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                  const at::Tensor& part_lse) {
  check_merge_args(out, lse, part_out, part_lse);
  TORCH_CHECK(out.device().is_cpu(), "cpattn: no merge_state_ kernel for device ", out.device());
  merge_into(out, lse, part_out, part_lse);
}

}  // namespace cpattn::ops
