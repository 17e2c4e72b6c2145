// The CPU backend (backend.h): tensors -> the plain parameter structs of cpattn/params.h, packed
// as the CPU kernels (csrc/cpu) read them, and the CPU registrations of the ops.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <tuple>

#include "cpattn/softmax_state.h"
#include "cpu/kernels.h"
#include "cpu/params.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"

namespace cpattn::ops {
namespace {

// (B, S, H, D) any dtype -> (B, H, S, Dp) contiguous in `dtype`, zero beyond D: one copy that
// converts and transposes together.
at::Tensor pack(const at::Tensor& t, int64_t dp, at::ScalarType dtype = at::kFloat) {
  const int64_t dim = t.size(3);
  at::Tensor p = at::empty({t.size(0), t.size(2), t.size(1), dp}, t.options().dtype(dtype));
  if (dp != dim) p.narrow(3, dim, dp - dim).zero_();
  p.narrow(3, 0, dim).copy_(t.transpose(1, 2));
  return p;
}

// An operand as the kernels read it in `dtype` (fp32, or bf16 for bf16 dot products), (B, S, H,
// Dp) by strides: the tensor itself when it is in that dtype with D = Dp and unit stride along
// D (no copy), else a packed copy viewed in that order.
bool read_in_place(const at::Tensor& t, int64_t dp, at::ScalarType dtype = at::kFloat) {
  return t.scalar_type() == dtype && t.size(3) == dp && t.stride(3) == 1;
}
at::Tensor operand(const at::Tensor& t, int64_t dp, at::ScalarType dtype = at::kFloat) {
  return read_in_place(t, dp, dtype) ? t : pack(t, dp, dtype).transpose(1, 2);
}

// (B, Sk, Hkv, D) any dtype -> (B, Hkv, ceil(Sk / 2), Dp, 2) bf16: keys 2j and 2j+1 side by
// side (a zero key past an odd end, zero beyond D), the layout bf16 dot products reduce over
// keys with. One copy.
at::Tensor pair_keys(const at::Tensor& t, int64_t dp) {
  const int64_t B = t.size(0), S = t.size(1), H = t.size(2), D = t.size(3), S2 = (S + 1) / 2;
  at::Tensor pairs = at::empty({B, H, S2, dp, 2}, t.options().dtype(at::kBFloat16));
  if (dp != D) pairs.narrow(3, D, dp - D).zero_();
  if (S % 2) pairs.select(4, 1).select(2, S2 - 1).zero_();
  // key 2j + i lands in pairs[b, h, j, d, i]
  const at::Tensor dst = pairs.narrow(3, 0, D).permute({0, 2, 4, 1, 3});  // (B, S2, 2, H, D)
  const int64_t even = S / 2;
  dst.narrow(1, 0, even).copy_(t.narrow(1, 0, 2 * even).unflatten(1, {even, 2}));
  if (S % 2) dst.select(1, even).select(1, 0).copy_(t.select(1, S - 1));
  return pairs;
}

// (B, Sk, Hkv, Dv) any dtype -> (B, Hkv, ceil(Sk / P), Dvp, P) in `dtype`, P = kValuePanelKeys:
// V transposed in panels of P keys (zero past Sk and beyond Dv), the A operand of the brgemm
// path's O^T += V^T P^T (cpu/params.h FwdParams::vt). One copy.
at::Tensor value_panels(const at::Tensor& t, int64_t dvp, at::ScalarType dtype) {
  constexpr int64_t P = kValuePanelKeys;
  const int64_t B = t.size(0), S = t.size(1), H = t.size(2), D = t.size(3);
  const int64_t full = S / P, tail = S % P;
  at::Tensor panels = at::empty({B, H, full + (tail ? 1 : 0), dvp, P}, t.options().dtype(dtype));
  if (dvp != D) panels.narrow(3, D, dvp - D).zero_();
  // key s = j P + c lands in panels[b, h, j, d, c]
  const at::Tensor dst = panels.narrow(3, 0, D).permute({0, 2, 4, 1, 3});  // (B, panels, P, H, D)
  if (full) dst.narrow(1, 0, full).copy_(t.narrow(1, 0, full * P).unflatten(1, {full, P}));
  if (tail) {
    const at::Tensor last = dst.select(1, full);  // (B, P, H, D)
    last.narrow(1, 0, tail).copy_(t.narrow(1, full * P, tail));
    last.narrow(1, tail, P - tail).zero_();
  }
  return panels;
}

// The CPU kernels write their outputs in the dtype asked for (no conversion pass afterwards).
BshdOutput output_of(const at::Tensor& t) {
  return {t.data_ptr(), strides_of(t), to_dtype(t.scalar_type())};
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

// The backward's delta = rowsum(dout * out), (B, H, Sq) fp32; 0 for an undefined out.
at::Tensor row_delta(const at::Tensor& dout, const at::Tensor& out, const AttnShape& s) {
  if (!out.defined())
    return at::zeros({s.batch, s.heads, s.seqlen_q}, dout.options().dtype(at::kFloat));
  const bool same = dout.scalar_type() == out.scalar_type();
  const at::Tensor x = (same ? dout : dout.to(at::kFloat)).contiguous();
  const at::Tensor y = (same ? out : out.to(at::kFloat)).contiguous();
  at::Tensor delta = at::empty({s.batch, s.heads, s.seqlen_q}, dout.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, x.scalar_type(), "cpattn_row_delta", [&] {
        rowwise_dot(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), s, delta.data_ptr<float>());
      });
  return delta;
}

// Every option of ScoreArgs and the mask runs on the CPU.
std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const AttnShape& s,
                                                     double softmax_scale, const Mask& mask,
                                                     const ScoreArgs& score, at::ScalarType dtype) {
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out =
      new_output({s.batch, s.seqlen_q, s.heads, s.head_dim_v}, q.options().dtype(dtype));
  at::Tensor lse = new_output({s.batch, s.heads, s.seqlen_q}, f32);

  FwdParams p;
  p.shape = s;
  at::Tensor qp, kp, vp;
  const bool bf16 = q.scalar_type() == at::kBFloat16 &&
                    cpu::active_isa_path().packing == cpu::OperandPacking::kBf16Pairs;
  const cpu::KernelPath& path =
      cpu::kernel_path(bf16 ? cpu::Operands::kBFloat16 : cpu::Operands::kFloat32, s.fixed_order);
  const bool panels = path.packing == cpu::Packing::kBrgemm;  // V^T in panels, else V rows
  if (bf16) {
    // bf16 dot products: operands stay bf16, Q is read in place; V gets its key pairs
    // interleaved (or is transposed in panels).
    kp = pack(k, s.head_dim_padded, at::kBFloat16);
    vp = panels ? value_panels(v, s.head_dim_v_padded, at::kBFloat16)
                : pair_keys(v, s.head_dim_v_padded);
    p.q16 = bf16_data(q);
    p.q16_strides = strides_of(q);
    p.k16 = bf16_data(kp);
    (panels ? p.vt16 : p.v16) = bf16_data(vp);
  } else {
    qp = pack(q, s.head_dim_padded);
    kp = pack(k, s.head_dim_padded);
    vp = panels ? value_panels(v, s.head_dim_v_padded, at::kFloat) : pack(v, s.head_dim_v_padded);
    p.q = qp.data_ptr<float>();
    p.k = kp.data_ptr<float>();
    (panels ? p.vt : p.v) = vp.data_ptr<float>();
  }
  p.out = output_of(out);
  p.lse = lse.data_ptr<float>();
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.mask = mask;
  at::Tensor slopes, sinks;  // kept alive for the kernel
  p.score = score_options(score, slopes, sinks);
  path.fwd(p);
  return {out, lse};
}

// The backward runs in groups of KV heads (with their query heads), one kernel call each, so
// that what it allocates beyond the gradients scales with a group, not with all the heads: the
// operands' packing (bf16: K's key pairs, and K and V unless read in place; fp32: copies of
// operands not read in place) and the kernel's dK / dV sums beyond the gradients (KeyGradSums:
// none for fp32 gradients, the low halves for bf16 ones, fp32 sums otherwise). A group holds
// as many KV heads as fit kBackwardGroupBytes (at least one); a function of the shape only, so
// the bits do not depend on the thread count. cpattn.plan's memory model reads it back through
// the op cpu_backward_sizes (plan_ops.cpp).
constexpr int64_t kBackwardGroupBytes = int64_t{8} << 20;
std::atomic<int64_t> backward_group_bytes{kBackwardGroupBytes};  // tests lower it

// Bytes one KV head (and its query heads) adds to a backward call beyond the gradients; the
// operands' "in place" as read_in_place says for all of them (an upper bound otherwise); K's
// key pairs where the kernel path takes them (bf16 micro-kernels).
int64_t backward_bytes_per_kv_head(const AttnShape& s, bool bf16, bool operands_in_place,
                                   bool key_pairs, at::ScalarType grad) {
  const int64_t dp = s.head_dim_padded, dvp = s.head_dim_v_padded, group = s.group_size();
  int64_t bytes = 0;
  if (bf16) {
    if (key_pairs) bytes += 2 * s.batch * 2 * ((s.seqlen_k + 1) / 2) * dp;
    if (!operands_in_place) bytes += 2 * s.batch * s.seqlen_k * (dp + dvp);
  } else if (!operands_in_place) {
    bytes += 4 * s.batch * (dp + dvp) * (group * s.seqlen_q + s.seqlen_k);
  }
  // KeyGradSums: bytes per summed value beyond the gradient
  const auto sums = [&](int64_t dim, int64_t padded) -> int64_t {
    if (dim != padded) return 4;
    return grad == at::kFloat ? 0 : grad == at::kBFloat16 ? 2 : 4;
  };
  bytes += s.batch * s.seqlen_k * (sums(s.head_dim, dp) * dp + sums(s.head_dim_v, dvp) * dvp);
  return bytes;
}

// The kernel path of a backward (kernels.h).
const cpu::KernelPath& backward_path(bool bf16, const AttnShape& s) {
  return cpu::kernel_path(bf16 ? cpu::Operands::kBFloat16 : cpu::Operands::kFloat32, s.fixed_order);
}

}  // namespace

bool cpu_backward_takes_bf16(const at::Tensor& q, const at::Tensor& dout) {
  return q.scalar_type() == at::kBFloat16 && dout.scalar_type() == at::kBFloat16 &&
         cpu::active_isa_path().packing == cpu::OperandPacking::kBf16Pairs;
}

int64_t cpu_backward_kv_heads_per_call(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const AttnShape& s, at::ScalarType grad) {
  const int64_t dp = s.head_dim_padded, dvp = s.head_dim_v_padded;
  const bool bf16 = cpu_backward_takes_bf16(q, dout);
  const bool in_place =
      bf16 ? read_in_place(k, dp, at::kBFloat16) && read_in_place(v, dvp, at::kBFloat16)
           : read_in_place(q, dp) && read_in_place(k, dp) && read_in_place(v, dvp) &&
                 read_in_place(dout, dvp);
  const bool key_pairs = backward_path(bf16, s).packing == cpu::Packing::kMicro;
  const int64_t per_head = backward_bytes_per_kv_head(s, bf16, in_place, key_pairs, grad);
  return per_head == 0 ? s.kv_heads
                       : std::clamp<int64_t>(backward_group_bytes.load() / per_head, 1, s.kv_heads);
}

namespace {

// The backward into dq, dk, dv (B, S, H, D by strides): written, or with `accumulate` (fp32, or
// for dq split sums with dq_low: BwdParams) added to what they hold.
void backward_cpu(const at::Tensor& dq, const at::Tensor& dq_low, const at::Tensor& dk,
                  const at::Tensor& dv, bool accumulate, const at::Tensor& dout,
                  const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse,
                  const std::optional<at::Tensor>& dlse, const AttnShape& s, double softmax_scale,
                  const Mask& mask, const ScoreArgs& score) {
  const int64_t dp = s.head_dim_padded, dvp = s.head_dim_v_padded;
  // delta = rowsum(dout * out) per query row, over the global output.
  at::Tensor delta = row_delta(dout, out, s);
  if (dlse && dlse->defined()) delta.sub_(dlse->to(at::kFloat));
  const bool bf16 = cpu_backward_takes_bf16(q, dout);
  // dk and dv: fp32 where dq is split sums
  // undefined dq, or dk and dv: not wanted (the kernels skip their products)
  const at::ScalarType grad_type = (dk.defined() ? dk : dq).scalar_type();
  const int64_t kv_per_call = cpu_backward_kv_heads_per_call(q, k, v, dout, s, grad_type);
  at::Tensor slopes, sinks;
  const ScoreOptions all_heads = score_options(score, slopes, sinks);
  const cpu::KernelPath& path = backward_path(bf16, s);
  const bool key_pairs = path.packing == cpu::Packing::kMicro && dq.defined();  // for dQ = dS K

  for (int64_t kh0 = 0; kh0 < s.kv_heads; kh0 += kv_per_call) {
    AttnShape g = s;  // this group's heads
    g.kv_heads = std::min(kv_per_call, s.kv_heads - kh0);
    g.heads = g.kv_heads * s.group_size();
    const int64_t h0 = kh0 * s.group_size();
    const auto q_heads = [&](const at::Tensor& t) { return t.narrow(2, h0, g.heads); };
    const auto kv_heads = [&](const at::Tensor& t) { return t.narrow(2, kh0, g.kv_heads); };
    const auto rows = [&](const at::Tensor& t) { return t.narrow(1, h0, g.heads).contiguous(); };
    BwdParams p;
    p.shape = g;
    at::Tensor qp, kp, vp, dop, k_pairs;
    const at::Tensor q_g = q_heads(q), dout_g = q_heads(dout);
    if (bf16) {
      // Q and dO are read in place (the kernel packs its query blocks itself), K and V too
      // when D = Dp.
      kp = operand(kv_heads(k), dp, at::kBFloat16);
      vp = operand(kv_heads(v), dvp, at::kBFloat16);
      if (key_pairs) k_pairs = pair_keys(kv_heads(k), dp);
      p.q16 = bf16_data(q_g);
      p.q16_strides = strides_of(q_g);
      p.dout16 = bf16_data(dout_g);
      p.dout16_strides = strides_of(dout_g);
      p.k16 = bf16_data(kp);
      p.v16 = bf16_data(vp);
      p.k16_strides = strides_of(kp);
      p.v16_strides = strides_of(vp);
      p.k16_pairs = key_pairs ? bf16_data(k_pairs) : nullptr;
    } else {
      qp = operand(q_g, dp);
      kp = operand(kv_heads(k), dp);
      vp = operand(kv_heads(v), dvp);
      dop = operand(dout_g, dvp);
      p.q = qp.data_ptr<float>();
      p.k = kp.data_ptr<float>();
      p.v = vp.data_ptr<float>();
      p.dout = dop.data_ptr<float>();
      p.q_strides = strides_of(qp);
      p.k_strides = strides_of(kp);
      p.v_strides = strides_of(vp);
      p.dout_strides = strides_of(dop);
    }
    const at::Tensor lse_g = rows(lse), delta_g = rows(delta);  // (B, heads, Sq) contiguous
    p.lse = lse_g.data_ptr<float>();
    p.delta = delta_g.data_ptr<float>();
    if (dq.defined()) p.dq = output_of(q_heads(dq));
    if (dk.defined()) p.dk = output_of(kv_heads(dk));
    if (dv.defined()) p.dv = output_of(kv_heads(dv));
    p.accumulate = accumulate;
    if (dq_low.defined())  // the group's heads, at dq's offsets
      p.dq_low = reinterpret_cast<uint16_t*>(q_heads(dq_low).data_ptr<int16_t>());
    p.softmax_scale = static_cast<float>(softmax_scale);
    p.mask = mask;
    p.score = all_heads;
    if (p.score.alibi_slopes) p.score.alibi_slopes += h0;
    p.score.sinks = nullptr;  // already in lse
    path.bwd(p);
  }
}

// New dk, dv (B, Sk, Hkv, D / Dv) of q's options in dtype `grad`.
std::tuple<at::Tensor, at::Tensor> new_key_grads(const at::Tensor& q, const AttnShape& s,
                                                 at::ScalarType grad) {
  const auto options = q.options().dtype(grad);
  return {new_output({s.batch, s.seqlen_k, s.kv_heads, s.head_dim}, options),
          new_output({s.batch, s.seqlen_k, s.kv_heads, s.head_dim_v}, options)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const AttnShape& s, double softmax_scale, const Mask& mask, const ScoreArgs& score,
    std::optional<at::ScalarType> grad_dtype) {
  const at::ScalarType grad = grad_dtype.value_or(q.scalar_type());
  at::Tensor dq = new_output({s.batch, s.seqlen_q, s.heads, s.head_dim}, q.options().dtype(grad));
  auto [dk, dv] = new_key_grads(q, s, grad);
  backward_cpu(dq, at::Tensor(), dk, dv, false, dout, q, k, v, out, lse, dlse, s, softmax_scale,
               mask, score);
  return {dq, dk, dv};
}

// dQ over dout: backward_row_bands reads a band's dO rows (packing them) before it writes the
// band's dQ rows, and never again; the fp32 path's copy of dO, where it makes one, is read only.
std::tuple<at::Tensor, at::Tensor> attention_bwd_in_dout_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const AttnShape& s, double softmax_scale, const Mask& mask, const ScoreArgs& score) {
  auto [dk, dv] = new_key_grads(q, s, q.scalar_type());
  backward_cpu(dout, at::Tensor(), dk, dv, false, dout, q, k, v, out, lse, dlse, s, softmax_scale,
               mask, score);
  return {dk, dv};
}

void attention_bwd_add_cpu(const at::Tensor& dq, const at::Tensor& dq_low, const at::Tensor& dk,
                           const at::Tensor& dv, const at::Tensor& dout, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                           const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                           const AttnShape& s, double softmax_scale, const Mask& mask,
                           const ScoreArgs& score) {
  backward_cpu(dq, dq_low, dk, dv, true, dout, q, k, v, out, lse, dlse, s, softmax_scale, mask,
               score);
}

void round_split_cpu(const at::Tensor& high, const at::Tensor& low) {
  cpu::round_split_sums(reinterpret_cast<uint16_t*>(high.data_ptr<at::BFloat16>()),
                        reinterpret_cast<const uint16_t*>(low.data_ptr<int16_t>()), high.numel());
}

}  // namespace

int64_t exchange_cpu_backward_group_bytes(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "cpattn: the backward's group budget must be positive, got ", bytes);
  return backward_group_bytes.exchange(bytes);
}

namespace {

void merge_into_cpu(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                    const at::Tensor& part_lse) {
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

// sink_bwd's reduction (softmax_state.h sink_grad) in a fixed order: the same bits with any
// thread count.
at::Tensor sink_bwd_cpu(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                        const at::Tensor& sinks, const std::optional<at::Tensor>& dlse) {
  AttnShape s;
  s.batch = out.size(0);
  s.seqlen_q = out.size(1);
  s.heads = out.size(2);
  s.head_dim_v = out.size(3);
  at::Tensor delta = row_delta(dout, out, s);
  if (dlse && dlse->defined()) delta.sub_(dlse->to(at::kFloat));
  const at::Tensor l = lse.contiguous();
  at::Tensor grad = at::empty({s.heads}, out.options().dtype(at::kFloat));
  const float* lp = l.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* sp = sinks.data_ptr<float>();
  float* gp = grad.data_ptr<float>();
  for (int64_t h = 0; h < s.heads; ++h) {
    double sum = 0.0;
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t i = 0; i < s.seqlen_q; ++i) {
        const int64_t row = (b * s.heads + h) * s.seqlen_q + i;
        sum += sink_grad(sp[h], lp[row], dp[row]);
      }
    gp[h] = static_cast<float>(sum);
  }
  return grad;
}

// add_sink (softmax_state.h) on every row, in place.
void apply_sinks_cpu(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  const float* sink = sinks.data_ptr<float>();
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

at::Tensor row_dot_cpu(const at::Tensor& a, const at::Tensor& b) {
  AttnShape s;
  s.batch = a.size(0);
  s.seqlen_q = a.size(1);
  s.heads = a.size(2);
  s.head_dim_v = a.size(3);
  return row_delta(a, b, s);
}

[[maybe_unused]] const bool registered = register_backend(
    c10::DeviceType::CPU,
    {&attention_fwd_cpu, &attention_bwd_cpu, &attention_bwd_add_cpu, &round_split_cpu,
     &attention_bwd_in_dout_cpu, &merge_into_cpu, &apply_sinks_cpu, &sink_bwd_cpu, &row_dot_cpu,
     /*cache_decode=*/nullptr});

}  // namespace
}  // namespace cpattn::ops

TORCH_LIBRARY_IMPL(cpattn, CPU, m) {
  cpattn::ops::impl_attention_ops(m);
  cpattn::ops::impl_ring_ops(m);
  cpattn::ops::impl_invariant_ops(m);
  cpattn::ops::impl_inference_ops(m);
}
