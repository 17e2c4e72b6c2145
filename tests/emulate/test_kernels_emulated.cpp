// The CUDA attention kernels themselves (csrc/cuda/*.cuh), run on the CPU through the emulation of
// cuda_emulation.h and compared with a float64 reference: forward (bf16 / fp16, fp32 or 16-bit
// out), preprocess, dK/dV with atomic dQ plus the conversion, and the deterministic dQ pass, over
// masks, offsets, GQA, odd lengths and the head dims' tile configurations.
//
// CPATTN_EMU_CASES=all runs the long list (minutes); the default is a representative subset.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/bwd_kernel.cuh"
#include "cuda/bwd_preprocess.cuh"
#include "cuda/fwd_kernel.cuh"
#include "host_elements.h"

namespace cpattn::cuda {
namespace {

struct Case {
  int batch, seqlen_q, seqlen_k, heads, kv_heads;
  bool causal;
  int64_t window_left, window_right, q_offset, k_offset;
  float scale;
};

// The score options of a case (cpattn/params.h ScoreOptions) and the prefix-LM end of its mask;
// the defaults change nothing.
struct Scores {
  float softcap = 0.f;
  std::vector<float> slopes;  // (H,) ALiBi slopes, or empty
  int64_t alibi_q_begin = 0, alibi_k_begin = 0, alibi_stride = 1;
  std::vector<float> sinks;  // (H,) sink logits, or empty
  int64_t prefix_end = -kUnbounded;

  ScoreOptions options() const {
    ScoreOptions o;
    o.softcap = softcap;
    o.alibi_slopes = slopes.empty() ? nullptr : slopes.data();
    o.alibi_q_begin = alibi_q_begin;
    o.alibi_k_begin = alibi_k_begin;
    o.alibi_stride = alibi_stride;
    o.sinks = sinks.empty() ? nullptr : sinks.data();
    return o;
  }
};

Mask mask_of(const Case& c, const Scores& sc = {}) {
  Mask m;
  m.prefix_end = sc.prefix_end;
  m.causal = c.causal;
  m.window_left = c.window_left;
  m.window_right = c.window_right;
  m.q_offset = c.q_offset;
  m.k_offset = c.k_offset;
  return m;
}

std::string name_of(const Case& c, int d) {
  std::ostringstream os;
  os << "B" << c.batch << " Sq" << c.seqlen_q << " Sk" << c.seqlen_k << " H" << c.heads << "/"
     << c.kv_heads << " D" << d << (c.causal ? " causal" : "") << " w(" << c.window_left << ","
     << c.window_right << ") off(" << c.q_offset << "," << c.k_offset << ")";
  return os.str();
}

double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / (den > 0 ? std::sqrt(den) : 1.0);
}

// Reference in float64 from the rounded inputs: out, lse and the gradients. The score options in
// docs/design.md's order, written out here independently of HeadScoring: s = scale q.k, softcap,
// minus slope * |pos_q - pos_k|, the mask (prefix included), softmax with exp(sink) in the
// denominator (the returned lse includes it).
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<char> empty;  // (B, H, Sq): the row sees no key (out 0; lse -inf, or the sink)
};

Reference reference(const Case& c, int d, const std::vector<double>& q,
                    const std::vector<double>& k, const std::vector<double>& v,
                    const std::vector<double>& dout, const Scores& sc = {}) {
  const Mask m = mask_of(c, sc);
  const int B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.kv_heads;
  const int group = H / Hk;
  Reference r;
  r.out.assign(size_t(B) * Sq * H * d, 0.0);
  r.lse.assign(size_t(B) * H * Sq, -INFINITY);
  r.empty.assign(r.lse.size(), 1);
  r.dq.assign(r.out.size(), 0.0);
  r.dk.assign(size_t(B) * Sk * Hk * d, 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  auto qi = [&](int b, int s, int h) { return ((size_t(b) * Sq + s) * H + h) * d; };
  auto ki = [&](int b, int s, int h) { return ((size_t(b) * Sk + s) * Hk + h) * d; };
  std::vector<double> p(Sk), dcap(Sk, 1.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / group;
      for (int i = 0; i < Sq; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j < Sk; ++j) {
          if (!m.visible(i, j)) {
            p[j] = -INFINITY;
            continue;
          }
          double s = 0;
          for (int e = 0; e < d; ++e) s += q[qi(b, i, h) + e] * k[ki(b, j, hk) + e];
          s *= c.scale;
          if (sc.softcap > 0) {
            const double th = std::tanh(s / sc.softcap);
            s = sc.softcap * th;
            dcap[j] = 1 - th * th;
          }
          if (!sc.slopes.empty())
            s -= sc.slopes[h] * std::abs(double(sc.alibi_q_begin + sc.alibi_stride * i) -
                                         double(sc.alibi_k_begin + sc.alibi_stride * j));
          p[j] = s;
          mx = std::max(mx, p[j]);
        }
        const double sink = sc.sinks.empty() ? -INFINITY : double(sc.sinks[h]);
        if (mx == -INFINITY) {  // empty row: out 0, lse -inf (the sink, if any), no gradient
          r.lse[(size_t(b) * H + h) * Sq + i] = sink;
          continue;
        }
        r.empty[(size_t(b) * H + h) * Sq + i] = 0;
        mx = std::max(mx, sink);
        double sum = sink == -INFINITY ? 0.0 : std::exp(sink - mx);
        for (int j = 0; j < Sk; ++j) sum += p[j] == -INFINITY ? 0.0 : std::exp(p[j] - mx);
        const double lse = mx + std::log(sum);
        r.lse[(size_t(b) * H + h) * Sq + i] = lse;
        for (int j = 0; j < Sk; ++j) p[j] = p[j] == -INFINITY ? 0.0 : std::exp(p[j] - lse);
        double delta = 0;
        for (int e = 0; e < d; ++e) {
          double o = 0;
          for (int j = 0; j < Sk; ++j) o += p[j] * v[ki(b, j, hk) + e];
          r.out[qi(b, i, h) + e] = o;
          delta += o * dout[qi(b, i, h) + e];
        }
        for (int j = 0; j < Sk; ++j) {
          if (p[j] == 0.0) continue;
          double x = 0;
          for (int e = 0; e < d; ++e) x += dout[qi(b, i, h) + e] * v[ki(b, j, hk) + e];
          const double ds = p[j] * (x - delta) * dcap[j];
          for (int e = 0; e < d; ++e) {
            r.dq[qi(b, i, h) + e] += c.scale * ds * k[ki(b, j, hk) + e];
            r.dk[ki(b, j, hk) + e] += c.scale * ds * q[qi(b, i, h) + e];
            r.dv[ki(b, j, hk) + e] += p[j] * dout[qi(b, i, h) + e];
          }
        }
      }
    }
  return r;
}

template <typename T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return Host<T>::dec(x);
}

template <typename T>
std::vector<double> to_doubles(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = as_double(x[i]);
  return r;
}

template <typename T>
void expect_close(const std::string& what, const std::vector<T>& got,
                  const std::vector<double>& ref, double tol) {
  const std::vector<double> g = to_doubles(got);
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_TRUE(std::isfinite(g[i])) << what << ": non-finite element " << i;
  const double err = rel_err(g, ref);
  EXPECT_LE(err, tol) << what << ": relative error";
}

// Random q, dout (B, Sq, H, d) and k, v (B, Sk, Hkv, d) of case c in Elem, drawn in that order,
// and the exact values they hold (qd, kd, vd, dod) for the reference.
template <typename Elem>
struct RandomOperands {
  std::vector<double> qd, kd, vd, dod;
  std::vector<Elem> q, k, v, dout;
  RandomOperands(const Case& c, int d, std::mt19937& rng)
      : q(random_elems<Elem>(size_t(c.batch) * c.seqlen_q * c.heads * d, rng, &qd)),
        k(random_elems<Elem>(size_t(c.batch) * c.seqlen_k * c.kv_heads * d, rng, &kd)),
        v(random_elems<Elem>(size_t(c.batch) * c.seqlen_k * c.kv_heads * d, rng, &vd)),
        dout(random_elems<Elem>(size_t(c.batch) * c.seqlen_q * c.heads * d, rng, &dod)) {}
};

// A backward's operands in bp, dense (q, dout (B, Sq, H, d), k, v (B, Sk, Hkv, d)), with case
// c's shape, scale and mask and the score options sc.
template <typename Elem>
void set_dense_operands(BwdParamsCuda& bp, const Case& c, const Scores& sc, int d,
                        const std::vector<Elem>& q, const std::vector<Elem>& k,
                        const std::vector<Elem>& v, const std::vector<Elem>& dout) {
  const int B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.kv_heads;
  bp.softmax_scale = c.scale;
  bp.mask = mask_of(c, sc);
  bp.score = sc.options();
  bp.shape = ShapeCuda{B, H, Hk, Sq, Sk, d};
  bp.q = q.data();
  bp.k = k.data();
  bp.v = v.data();
  bp.dout = dout.data();
  bp.q_strides = bp.dout_strides = {int64_t(Sq) * H * d, int64_t(H) * d, d};
  bp.k_strides = bp.v_strides = {int64_t(Sk) * Hk * d, int64_t(Hk) * d, d};
}

// The forward's results a backward reads, set in bp (out: dense, `out_strides`; lse: natural
// log, (B, H, Sq)), and the preprocess's workspace it writes: lse in base 2 and delta, Sq rounded
// up to kBwdSeqRound rows per head, NaN-poisoned. bp.shape must be set first.
struct BwdWorkspace {
  int rounded;
  std::vector<float> lse_log2, delta;
  BwdWorkspace(BwdParamsCuda& bp, const void* out, const BshdStrides& out_strides, int d,
               const float* lse)
      : rounded((bp.shape.seqlen_q + kBwdSeqRound - 1) / kBwdSeqRound * kBwdSeqRound),
        lse_log2(size_t(bp.shape.batch) * bp.shape.heads * rounded, NAN),
        delta(lse_log2.size(), NAN) {
    const int H = bp.shape.heads, Sq = bp.shape.seqlen_q;
    bp.out = out;
    bp.out_strides = out_strides;
    bp.out_head_dim = d;
    bp.lse = lse;
    bp.lse_strides = {int64_t(H) * Sq, Sq, 1};
    bp.seqlen_q_rounded = rounded;
    bp.lse_log2 = lse_log2.data();
    bp.delta = delta.data();
  }
};

template <typename OutT>
struct Grads {
  std::vector<OutT> dq, dk, dv;
};

// The kernels of launch_bwd_kernels (bwd_kernel.cuh) on bp, in its order: preprocess (out in
// OutT), dK/dV with the atomic dQ (bp.dq_accum set) or not, the head-split reduction, then the dQ
// conversion or the deterministic dQ pass; the scored instantiations when bwd_needs_scoring says
// so. In accumulate mode (bp.accumulate, GradT fp32) the dK/dV kernel's accumulate instantiation
// and no conversion (its atomics add into dq itself).
template <int kHeadDim, typename Elem, typename OutT, typename GradT>
void emulate_bwd_launch(const BwdParamsCuda& bp) {
  using BCfg = BwdConfigFor<kHeadDim>;
  using QCfg = DqConfigFor<kHeadDim>;
  const bool scored = bwd_needs_scoring(bp), deterministic = bp.dq_accum == nullptr;
  launch(preprocess_launch(bp.shape, bp.seqlen_q_rounded),
         [&] { bwd_preprocess_kernel<OutT, Elem>(bp); });
  launch(dkdv_launch<BCfg>(bp.shape, bp.head_splits), [&] {
    if constexpr (std::is_same_v<GradT, float>) {
      if (bp.accumulate) {
        if (scored)
          attention_bwd_dkdv_kernel<BCfg, Elem, float, true, true>(bp);
        else
          attention_bwd_dkdv_kernel<BCfg, Elem, float, false, true>(bp);
        return;
      }
    }
    if (scored)
      attention_bwd_dkdv_kernel<BCfg, Elem, GradT, true>(bp);
    else
      attention_bwd_dkdv_kernel<BCfg, Elem, GradT, false>(bp);
  });
  if (bp.head_splits > 1)
    launch(pairs_launch(dkv_pairs(bp.shape)), [&] { dkv_reduce_kernel<kHeadDim, GradT>(bp); });
  if (deterministic)
    launch(dq_launch<QCfg>(bp.shape), [&] {
      if (scored)
        attention_bwd_dq_kernel<QCfg, Elem, GradT, true>(bp);
      else
        attention_bwd_dq_kernel<QCfg, Elem, GradT, false>(bp);
    });
  else if (!bp.accumulate)
    launch(pairs_launch(dq_pairs(bp.shape)), [&] { dq_convert_kernel<kHeadDim, GradT>(bp); });
}

// The backward kernels as the launcher runs them (launch_bwd_typed), from out and the natural-log
// lse of the forward: preprocess, dK/dV with atomic dQ plus the conversion or the deterministic
// dQ pass, the head-split reduction; the scored instantiations when bwd_needs_scoring says so.
// in holds the operands (q, k, v, dout and their strides), the scale, mask and score options;
// dq, dk, dv come back dense (B, S, H, D), every output and workspace poisoned first.
template <int kHeadDim, typename Elem, typename OutT>
Grads<OutT> run_backward(const BwdParamsCuda& in, const std::vector<OutT>& out,
                         const std::vector<float>& lse, bool deterministic, int head_splits) {
  constexpr int d = kHeadDim;
  const ShapeCuda& sh = in.shape;
  const int B = sh.batch, H = sh.heads, Sq = sh.seqlen_q;
  const size_t q_elems = size_t(B) * Sq * H * d,
               k_elems = size_t(B) * sh.seqlen_k * sh.kv_heads * d;
  const BshdStrides qs{int64_t(Sq) * H * d, int64_t(H) * d, d};
  const BshdStrides ks{int64_t(sh.seqlen_k) * sh.kv_heads * d, int64_t(sh.kv_heads) * d, d};
  BwdParamsCuda bp = in;
  const BwdWorkspace workspace(bp, out.data(), qs, d, lse.data());
  std::vector<float> dq_accum(deterministic ? 0 : size_t(B) * H * workspace.rounded * d, 0.f);
  const OutT nan_value = std::is_same_v<OutT, float> ? OutT(NAN) : OutT{0x7fff};
  // poisoned: an unwritten gradient fails
  Grads<OutT> g{std::vector<OutT>(q_elems, nan_value), std::vector<OutT>(k_elems, nan_value),
                std::vector<OutT>(k_elems, nan_value)};
  bp.dq_accum = deterministic ? nullptr : dq_accum.data();
  bp.dq = g.dq.data();
  bp.dk = g.dk.data();
  bp.dv = g.dv.data();
  bp.dq_strides = qs;
  bp.dk_strides = bp.dv_strides = ks;
  bp.scale_log2 = bp.softmax_scale * 1.4426950408889634f;
  std::vector<float> dkv_partial;
  if (head_splits > 1) {
    dkv_partial.assign(size_t(2) * head_splits * k_elems, NAN);  // poisoned too
    bp.head_splits = head_splits;
    bp.dkv_partial = dkv_partial.data();
  }
  emulate_bwd_launch<kHeadDim, Elem, OutT, OutT>(bp);
  return g;
}

// How the op layer may hand operands to the kernels (attention_cuda.cpp), and launch options.
struct Options {
  bool deterministic = false;  // the separate dQ pass instead of atomics
  int head_splits = 1;         // dK/dV: query heads of a kv head split over this many blocks
  int row_pad = 0;             // q, k, v, dout rows strided: each (token) row padded by this many
                               // elements (a view of a larger tensor, as a packed qkv)
  int real_dim = 0;            // > 0: a smaller head dim zero-padded up to the kernel's
  int real_dim_v = 0;          // > 0: v's (and dout's) own smaller head dim (Dv != D), likewise
  bool forward_only = false;   // stop after the forward's checks
};

// Zeroes columns [real_dim, d) of every row (the op layer's zero padding of the head dim).
template <typename Elem>
void zero_pad_columns(std::vector<Elem>* x, std::vector<double>* values, int d, int real_dim) {
  for (size_t i = 0; i < x->size(); ++i)
    if (static_cast<int>(i % d) >= real_dim) {
      (*x)[i] = Host<Elem>::enc(0.f);
      (*values)[i] = 0.0;
    }
}

// Copies the dense (rows, heads * d) tensor into rows of heads * d + pad elements, the pad NaN.
template <typename Elem>
std::vector<Elem> with_row_pad(const std::vector<Elem>& x, int row, int pad) {
  if (pad == 0) return x;
  const size_t rows = x.size() / row;
  std::vector<Elem> y(rows * (row + pad), Host<Elem>::enc(NAN));
  for (size_t r = 0; r < rows; ++r)
    std::copy(x.begin() + r * row, x.begin() + (r + 1) * row, y.begin() + r * (row + pad));
  return y;
}

template <int kHeadDim, typename Elem, typename OutT>
void run_case(const Case& c, uint64_t seed, const Options& opt = {}, const Scores& sc = {}) {
  using FCfg = FwdConfigFor<kHeadDim>;
  constexpr int d = kHeadDim;
  const bool deterministic = opt.deterministic;
  const std::string what = name_of(c, d) + " splits " + std::to_string(opt.head_splits) + " pad " +
                           std::to_string(opt.row_pad) + " dim " + std::to_string(opt.real_dim) +
                           " dim_v " + std::to_string(opt.real_dim_v) + " softcap " +
                           std::to_string(sc.softcap) + (sc.slopes.empty() ? "" : " alibi") +
                           (sc.sinks.empty() ? "" : " sinks") + " prefix " +
                           std::to_string(sc.prefix_end);
  SCOPED_TRACE(what);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.kv_heads;
  auto [qd, kd, vd, dod, q, k, v, dout] = RandomOperands<Elem>(c, d, rng);
  const int real_dim_v = opt.real_dim_v > 0 ? opt.real_dim_v : opt.real_dim;
  if (opt.real_dim > 0) {
    zero_pad_columns(&q, &qd, d, opt.real_dim);
    zero_pad_columns(&k, &kd, d, opt.real_dim);
  }
  if (real_dim_v > 0) {
    zero_pad_columns(&v, &vd, d, real_dim_v);
    zero_pad_columns(&dout, &dod, d, real_dim_v);
  }
  const Reference ref = reference(c, d, qd, kd, vd, dod, sc);
  // The kernels' view of the inputs: rows of (heads * d + row_pad) elements.
  const int pad = opt.row_pad;
  const auto q_in = with_row_pad(q, H * d, pad), k_in = with_row_pad(k, Hk * d, pad),
             v_in = with_row_pad(v, Hk * d, pad), dout_in = with_row_pad(dout, H * d, pad);
  const BshdStrides qs_in{int64_t(Sq) * (H * d + pad), int64_t(H) * d + pad, d};
  const BshdStrides ks_in{int64_t(Sk) * (Hk * d + pad), int64_t(Hk) * d + pad, d};

  const Mask m = mask_of(c, sc);
  const BshdStrides qs{int64_t(Sq) * H * d, int64_t(H) * d, d};
  ShapeCuda shape{B, H, Hk, Sq, Sk, d};

  // ---- forward
  std::vector<OutT> out(q.size());
  std::vector<float> lse(size_t(B) * H * Sq, std::numeric_limits<float>::quiet_NaN());
  if constexpr (std::is_same_v<OutT, float>)
    std::fill(out.begin(), out.end(), std::numeric_limits<float>::quiet_NaN());
  else
    std::fill(out.begin(), out.end(), OutT{0x7fff});  // NaN pattern
  FwdParamsCuda fp;
  fp.shape = shape;
  fp.q = q_in.data();
  fp.k = k_in.data();
  fp.v = v_in.data();
  fp.q_strides = qs_in;
  fp.k_strides = ks_in;
  fp.v_strides = ks_in;
  fp.out = out.data();
  fp.out_strides = qs;
  fp.lse = lse.data();
  fp.softmax_scale = c.scale;
  fp.scale_log2 = c.scale * 1.4426950408889634f;
  fp.mask = m;
  fp.score = sc.options();
  using SCfg = ScoredFwdConfig<FCfg>;  // as launch_fwd_config picks
  if (fwd_needs_scoring(fp))
    launch(fwd_launch<SCfg>(fp.shape), [&] { attention_fwd_kernel<SCfg, Elem, OutT, true>(fp); });
  else
    launch(fwd_launch<FCfg>(fp.shape), [&] { attention_fwd_kernel<FCfg, Elem, OutT, false>(fp); });
  expect_close("out", out, ref.out,
               std::is_same_v<OutT, float> ? Host<Elem>::kOutTol / 2 : Host<Elem>::kOutTol);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {  // an empty row without a sink
      ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "lse " << i << " should be -inf";
    } else {
      ASSERT_NEAR(lse[i], ref.lse[i], 2e-3) << "lse " << i;
    }
  }
  for (int b = 0; b < B; ++b)
    for (int s = 0; s < Sq; ++s)
      for (int h = 0; h < H; ++h) {
        if (!ref.empty[(size_t(b) * H + h) * Sq + s]) continue;
        for (int e = 0; e < d; ++e) {
          ASSERT_EQ(as_double(out[((size_t(b) * Sq + s) * H + h) * d + e]), 0.0)
              << "empty row " << s << " must be 0";
        }
      }

  if (real_dim_v > 0) {  // v's padded columns give exactly 0 in out (sliced off later)
    for (size_t i = 0; i < out.size(); ++i) {
      if (static_cast<int>(i % d) >= real_dim_v) {
        ASSERT_EQ(as_double(out[i]), 0.0) << "padded column of out " << i;
      }
    }
  }
  if (opt.forward_only) return;

  // ---- backward from the kernel's own out (as the op layer) and lse
  BwdParamsCuda in;
  static_cast<AttnScoring&>(in) = fp;  // scale, mask and score options as in the forward
  in.shape = shape;
  in.q = q_in.data();
  in.k = k_in.data();
  in.v = v_in.data();
  in.dout = dout_in.data();
  in.q_strides = in.dout_strides = qs_in;
  in.k_strides = in.v_strides = ks_in;
  const auto [dq, dk, dv] =
      run_backward<kHeadDim, Elem, OutT>(in, out, lse, deterministic, opt.head_splits);
  const double gt = Host<Elem>::kGradTol;
  expect_close("dq", dq, ref.dq, gt);
  expect_close("dk", dk, ref.dk, gt);
  expect_close("dv", dv, ref.dv, gt);
  if (opt.real_dim > 0) {  // the padded columns of dq are exactly 0 (sliced off later; out's above)
    for (size_t i = 0; i < dq.size(); ++i) {
      if (static_cast<int>(i % d) < opt.real_dim) continue;
      ASSERT_TRUE(as_double(dq[i]) == 0.0) << "padded column " << i;
    }
  }
}

std::vector<Case> cases(bool all) {
  std::vector<Case> c = {
      {1, 1, 1, 1, 1, false, -1, -1, 0, 0, 0.125f},
      {1, 37, 37, 2, 2, true, -1, -1, 0, 0, 0.125f},       // odd, causal, one block
      {1, 130, 200, 4, 2, true, -1, -1, 70, 0, 0.1f},      // GQA, bottom-right, several blocks
      {2, 70, 150, 2, 1, false, 40, 9, 0, 0, 0.09f},       // MQA, window, batch 2
      {1, 100, 130, 2, 1, true, -1, -1, 0, 256, 0.125f},   // keys in the future: all empty
      {1, 150, 260, 2, 2, true, 200, -1, 256, 0, 0.125f},  // ring step with a window
  };
  if (all) {
    c.push_back({1, 200, 129, 4, 2, false, -1, -1, 0, 0, 0.125f});
    c.push_back({1, 33, 47, 2, 1, false, 2, 2, -5, 3, 0.3f});
    c.push_back({3, 17, 5, 6, 2, true, -1, -1, -12, 0, 0.2f});
    c.push_back({1, 300, 300, 2, 1, true, 0, 0, 0, 0, 0.125f});
  }
  return c;
}

bool all_cases() {
  const char* v = std::getenv("CPATTN_EMU_CASES");
  return v && std::string(v) == "all";
}

TEST(EmulatedKernels, Bf16HeadDim64) {
  uint64_t seed = 1;
  for (const Case& c : cases(all_cases())) run_case<64, __nv_bfloat16, __nv_bfloat16>(c, seed++);
}
TEST(EmulatedKernels, Bf16HeadDim128Fp32Out) {
  uint64_t seed = 100;
  for (const Case& c : cases(all_cases())) run_case<128, __nv_bfloat16, float>(c, seed++);
}
TEST(EmulatedKernels, Fp16HeadDim64Deterministic) {
  uint64_t seed = 200;
  for (const Case& c : cases(all_cases())) run_case<64, __half, __half>(c, seed++, Options{true});
}
TEST(EmulatedKernels, Bf16HeadDim128Deterministic) {
  uint64_t seed = 300;
  const auto cs = cases(all_cases());
  for (size_t i = 0; i < cs.size(); i += 2)
    run_case<128, __nv_bfloat16, __nv_bfloat16>(cs[i], seed++, Options{true});
}

// Every other head dim's tile configuration (kernel_config.h), on two cases each.
TEST(EmulatedKernels, OtherHeadDims) {
  const Case a{1, 70, 90, 2, 1, true, -1, -1, 20, 0, 0.1f};
  const Case b{2, 33, 140, 4, 2, false, 50, 3, 0, 0, 0.07f};
  run_case<32, __nv_bfloat16, __nv_bfloat16>(a, 401);
  run_case<32, __half, float>(b, 402, Options{true});
  run_case<96, __nv_bfloat16, float>(a, 403, Options{true});
  run_case<96, __nv_bfloat16, __nv_bfloat16>(b, 404);
  run_case<160, __nv_bfloat16, __nv_bfloat16>(a, 405);
  run_case<192, __half, __half>(b, 406, Options{true});
  run_case<256, __nv_bfloat16, float>(a, 407);
  run_case<256, __nv_bfloat16, __nv_bfloat16>(b, 408, Options{true});
}

// GQA / MQA with the query heads of a kv head split over blocks (head_splits), atomic and
// deterministic dQ, and with the head dim's own split (256).
TEST(EmulatedKernels, HeadSplitGqaMqa) {
  const Case mqa{1, 90, 130, 4, 1, true, -1, -1, 40, 0, 0.1f};
  const Case gqa{2, 70, 70, 8, 2, false, 30, 5, 0, 0, 0.09f};
  run_case<64, __nv_bfloat16, __nv_bfloat16>(mqa, 501, Options{false, 4});
  run_case<64, __nv_bfloat16, float>(mqa, 502, Options{true, 2});
  run_case<128, __half, __half>(gqa, 503, Options{false, 2});
  run_case<128, __nv_bfloat16, __nv_bfloat16>(gqa, 504, Options{true, 4});
  run_case<256, __nv_bfloat16, float>(mqa, 505, Options{false, 2});
}

// What the op layer hands the kernels: rows strided inside a larger tensor, and a head dim
// zero-padded up to the kernel's (40 -> 64, 80 -> 96, 130 -> 160).
TEST(EmulatedKernels, OpLayerOperands) {
  const Case a{1, 70, 90, 2, 1, true, -1, -1, 20, 0, 0.1f};
  const Case b{2, 33, 140, 4, 2, false, 50, 3, 0, 0, 0.07f};
  run_case<64, __nv_bfloat16, __nv_bfloat16>(a, 601, Options{false, 1, 8, 0});
  run_case<64, __half, float>(b, 602, Options{true, 1, 24, 40});
  run_case<96, __nv_bfloat16, __nv_bfloat16>(a, 603, Options{false, 1, 0, 80});
  run_case<160, __nv_bfloat16, float>(b, 604, Options{false, 2, 8, 130});
}

// The op layer's rule for reading an operand in place (cuda::operand_readable, the same function
// it calls): what it accepts the kernel reads (above, rows padded by 8 or 24), and what it rejects
// really cannot be read by cp.async: the emulation's alignment check throws, so the copy the op
// layer then makes is needed.
TEST(EmulatedKernels, OperandReadableRule) {
  alignas(16) static uint16_t buf[4096];
  const int64_t sizes[3] = {1, 8, 2};
  EXPECT_TRUE(operand_readable(buf, sizes, {8 * 136, 136, 64}));       // rows padded by 8
  EXPECT_FALSE(operand_readable(buf, sizes, {8 * 132, 132, 64}));      // rows padded by 4
  EXPECT_FALSE(operand_readable(buf + 1, sizes, {8 * 128, 128, 64}));  // base off by 2 bytes
  EXPECT_FALSE(operand_readable(buf, sizes, {8 * 128, 128, 60}));      // head stride not 8k
  const int64_t one_row[3] = {1, 1, 1};
  EXPECT_TRUE(operand_readable(buf, one_row, {3, 5, 7}));  // size-1 dims: strides unused
  const Case c{1, 16, 16, 1, 1, false, -1, -1, 0, 0, 0.125f};
  EXPECT_THROW((run_case<64, __nv_bfloat16, __nv_bfloat16>(c, 801, Options{false, 1, 4, 0})),
               std::runtime_error);
}

// ---- The score options (forward): softcap, ALiBi, prefix-LM, sinks, alone and combined, through
// the scored instantiation, against the float64 reference.

std::vector<float> per_head(int heads, float first, float ratio) {
  std::vector<float> x(heads);
  for (int h = 0; h < heads; ++h) x[h] = first * std::pow(ratio, float(h));
  return x;
}

struct ScoredCase {
  Case c;
  Scores sc;
};

std::vector<ScoredCase> scored_cases() {
  std::vector<ScoredCase> v;
  auto add = [&](const Case& c, auto&& set) {
    Scores sc;
    set(sc);
    v.push_back({c, sc});
  };
  // softcap + causal, odd length over several blocks
  add({1, 131, 131, 2, 2, true, -1, -1, 0, 0, 0.25f}, [](Scores& s) { s.softcap = 1.5f; });
  // ALiBi on a ring step: the global positions of the mask's offsets, GQA
  add({1, 100, 150, 4, 2, true, -1, -1, 256, 64, 0.1f}, [](Scores& s) {
    s.slopes = per_head(4, 0.5f, 0.5f);
    s.alibi_q_begin = 256;
    s.alibi_k_begin = 64;
  });
  // ALiBi in the striped layout: positions W apart (W = 3), bidirectional
  add({2, 45, 70, 2, 1, false, -1, -1, 0, 0, 0.125f}, [](Scores& s) {
    s.slopes = per_head(2, 0.3f, 0.25f);
    s.alibi_q_begin = 1;
    s.alibi_k_begin = 2;
    s.alibi_stride = 3;
  });
  // prefix-LM with offsets: queries 50.. see keys < 100 beyond the causal rule
  add({1, 90, 140, 2, 1, true, -1, -1, 50, 0, 0.125f}, [](Scores& s) { s.prefix_end = 100; });
  // prefix + sliding window: key blocks between the prefix and the window are skipped
  add({1, 80, 260, 2, 2, true, 16, -1, 180, 0, 0.125f}, [](Scores& s) { s.prefix_end = 40; });
  // keys in the future of every query: only the prefix (key columns 0..9) is visible
  add({1, 70, 130, 2, 1, true, -1, -1, 0, 100, 0.125f}, [](Scores& s) { s.prefix_end = 110; });
  // sinks, MQA, window, batch 2
  add({2, 70, 90, 2, 1, false, 40, 9, 0, 0, 0.09f}, [](Scores& s) { s.sinks = {0.5f, -1.f}; });
  // sinks where every row is empty (whole blocks skipped): out 0, lse the sink
  add({1, 100, 130, 2, 1, true, -1, -1, 0, 256, 0.125f}, [](Scores& s) { s.sinks = {1.f, 2.f}; });
  // sinks where rows 0..4 are empty inside a visited block
  add({1, 40, 50, 2, 1, true, -1, -1, -5, 0, 0.125f}, [](Scores& s) { s.sinks = {3.f, -2.f}; });
  // softcap + ALiBi + window, GQA
  add({1, 130, 200, 4, 2, true, 30, -1, 70, 0, 0.1f}, [](Scores& s) {
    s.softcap = 2.f;
    s.slopes = per_head(4, 0.25f, 0.5f);
    s.alibi_q_begin = 70;
  });
  // everything at once, odd lengths, GQA
  add({1, 77, 163, 4, 2, true, 60, -1, 90, 3, 0.2f}, [](Scores& s) {
    s.softcap = 3.f;
    s.slopes = per_head(4, 0.1f, 0.5f);
    s.alibi_q_begin = 90;
    s.alibi_k_begin = 3;
    s.prefix_end = 20;
    s.sinks = {0.f, 1.f, -1.f, 2.f};
  });
  return v;
}

Options forward_only(int real_dim = 0, int real_dim_v = 0) {
  Options o;
  o.forward_only = true;
  o.real_dim = real_dim;
  o.real_dim_v = real_dim_v;
  return o;
}

TEST(EmulatedKernels, ScoredForwardBackwardBf16HeadDim64) {
  uint64_t seed = 900;
  for (const ScoredCase& s : scored_cases())
    run_case<64, __nv_bfloat16, __nv_bfloat16>(s.c, seed++, Options{}, s.sc);
}
TEST(EmulatedKernels, ScoredForwardBackwardFp16HeadDim128Fp32Out) {
  uint64_t seed = 950;
  for (const ScoredCase& s : scored_cases())
    run_case<128, __half, float>(s.c, seed++, Options{}, s.sc);
}

// The other head dims' tile configurations, and d_v != d_qk as the op layer runs it: q, k and v
// zero-padded to one kernel head dim >= max(D, Dv) (D 40 / Dv 64, D 96 / Dv 64, D 192 / Dv 128).
TEST(EmulatedKernels, ScoredForwardHeadDimsAndDv) {
  const auto cs = scored_cases();
  const ScoredCase& all = cs.back();
  run_case<32, __nv_bfloat16, float>(cs[1].c, 1001, forward_only(), cs[1].sc);
  run_case<96, __half, __half>(cs[3].c, 1002, forward_only(), cs[3].sc);
  run_case<256, __nv_bfloat16, __nv_bfloat16>(all.c, 1003, forward_only(), all.sc);
  run_case<64, __nv_bfloat16, float>(all.c, 1004, forward_only(40, 64), all.sc);
  run_case<96, __nv_bfloat16, __nv_bfloat16>(cs[0].c, 1005, forward_only(96, 64), cs[0].sc);
  run_case<192, __half, float>(cs[6].c, 1006, forward_only(192, 128), cs[6].sc);
}

// A NaN in one query row: that row's out and lse are NaN (as on the CPU, softmax_state.h), every
// other row is unaffected.
template <int kHeadDim, typename Elem>
void nan_row_case(uint64_t seed) {
  using FCfg = FwdConfigFor<kHeadDim>;
  constexpr int d = kHeadDim;
  const int Sq = 40, Sk = 50, H = 2, nan_row = 7, nan_head = 1;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<double> qd, kd, vd;
  auto q = random_elems<Elem>(size_t(Sq) * H * d, rng, &qd);
  auto k = random_elems<Elem>(size_t(Sk) * H * d, rng, &kd);
  auto v = random_elems<Elem>(size_t(Sk) * H * d, rng, &vd);
  q[(size_t(nan_row) * H + nan_head) * d + 3] = Host<Elem>::enc(NAN);
  std::vector<float> out(q.size(), 12345.f), lse(size_t(H) * Sq, 12345.f);
  FwdParamsCuda fp;
  fp.shape = ShapeCuda{1, H, H, Sq, Sk, d};
  fp.q = q.data();
  fp.k = k.data();
  fp.v = v.data();
  fp.q_strides = {int64_t(Sq) * H * d, int64_t(H) * d, d};
  fp.k_strides = fp.v_strides = {int64_t(Sk) * H * d, int64_t(H) * d, d};
  fp.out_dtype = DType::kFloat32;
  fp.out = out.data();
  fp.out_strides = fp.q_strides;
  fp.lse = lse.data();
  fp.softmax_scale = 0.125f;
  fp.scale_log2 = 0.125f * 1.4426950408889634f;
  fp.mask.causal = true;
  launch(fwd_launch<FCfg>(fp.shape), [&] { attention_fwd_kernel<FCfg, Elem, float, false>(fp); });
  for (int i = 0; i < Sq; ++i)
    for (int h = 0; h < H; ++h) {
      const bool nan = i == nan_row && h == nan_head;
      EXPECT_EQ(std::isnan(lse[size_t(h) * Sq + i]), nan) << "lse row " << i << " head " << h;
      for (int e = 0; e < d; ++e)
        ASSERT_EQ(std::isnan(out[(size_t(i) * H + h) * d + e]), nan)
            << "out row " << i << " head " << h << " col " << e;
    }
}

TEST(EmulatedKernels, NanRowPropagates) {
  nan_row_case<64, __nv_bfloat16>(701);
  nan_row_case<128, __half>(702);
}

// ---- The score options (backward): softcap, ALiBi, prefix-LM and sinks through the scored
// instantiations of the dK/dV and dQ kernels, from the reference's own out and lse (rounded as the
// forward returns them; the sinks enter through the lse alone), against the float64 reference
// gradients: each option, combinations, GQA / MQA, odd lengths, both dQ paths, head splits.

template <typename T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, float>)
    return static_cast<float>(x);
  else
    return Host<T>::enc(static_cast<float>(x));
}

template <int kHeadDim, typename Elem, typename OutT>
void run_scored_backward(const Case& c, const Scores& sc, uint64_t seed, bool deterministic,
                         int head_splits = 1) {
  constexpr int d = kHeadDim;
  SCOPED_TRACE(name_of(c, d) + (deterministic ? " deterministic" : " atomic") + " splits " +
               std::to_string(head_splits) + " softcap " + std::to_string(sc.softcap) +
               (sc.slopes.empty() ? "" : " alibi") + (sc.sinks.empty() ? "" : " sinks") +
               " prefix " + std::to_string(sc.prefix_end));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.kv_heads;
  std::vector<double> qd, kd, vd, dod;
  const auto q = random_elems<Elem>(size_t(B) * Sq * H * d, rng, &qd);
  const auto k = random_elems<Elem>(size_t(B) * Sk * Hk * d, rng, &kd);
  const auto v = random_elems<Elem>(size_t(B) * Sk * Hk * d, rng, &vd);
  const auto dout = random_elems<Elem>(size_t(B) * Sq * H * d, rng, &dod);
  const Reference ref = reference(c, d, qd, kd, vd, dod, sc);
  std::vector<OutT> out(ref.out.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = from_double<OutT>(ref.out[i]);
  const std::vector<float> lse(ref.lse.begin(), ref.lse.end());

  BwdParamsCuda in;
  set_dense_operands(in, c, sc, d, q, k, v, dout);
  const auto [dq, dk, dv] =
      run_backward<kHeadDim, Elem, OutT>(in, out, lse, deterministic, head_splits);
  const double gt = Host<Elem>::kGradTol;
  expect_close("dq", dq, ref.dq, gt);
  expect_close("dk", dk, ref.dk, gt);
  expect_close("dv", dv, ref.dv, gt);
}

// The backward from the reference's out / lse, over the forward's scored cases (scored_cases).
TEST(EmulatedKernels, ScoredBackwardBf16HeadDim64Atomic) {
  uint64_t seed = 1100;
  for (const ScoredCase& s : scored_cases())
    run_scored_backward<64, __nv_bfloat16, __nv_bfloat16>(s.c, s.sc, seed++, false);
}
TEST(EmulatedKernels, ScoredBackwardFp16HeadDim128Deterministic) {
  uint64_t seed = 1200;
  for (const ScoredCase& s : scored_cases())
    run_scored_backward<128, __half, float>(s.c, s.sc, seed++, true);
}

// The other head dims' tile configurations (incl. 256's head-dim split in the dK/dV pass), both
// dQ paths, and the query heads of a kv head split over blocks (GQA / MQA head_splits).
TEST(EmulatedKernels, ScoredBackwardHeadDimsAndSplits) {
  const auto cs = scored_cases();
  const ScoredCase &softcap = cs[0], &alibi = cs[1], &striped = cs[2], &prefix = cs[3];
  const ScoredCase &combo = cs[9], &all = cs.back();  // combo: softcap + ALiBi + window
  run_scored_backward<32, __nv_bfloat16, float>(alibi.c, alibi.sc, 1301, true);
  run_scored_backward<96, __half, __half>(prefix.c, prefix.sc, 1302, false);
  run_scored_backward<160, __nv_bfloat16, __nv_bfloat16>(softcap.c, softcap.sc, 1303, true);
  run_scored_backward<192, __half, float>(striped.c, striped.sc, 1304, false);
  run_scored_backward<256, __nv_bfloat16, __nv_bfloat16>(all.c, all.sc, 1305, false);
  run_scored_backward<256, __nv_bfloat16, float>(combo.c, combo.sc, 1306, true);
  run_scored_backward<64, __nv_bfloat16, __nv_bfloat16>(all.c, all.sc, 1307, false, 2);
  run_scored_backward<128, __half, __half>(combo.c, combo.sc, 1308, true, 2);
  run_scored_backward<64, __nv_bfloat16, float>(striped.c, striped.sc, 1309, true, 2);
  run_scored_backward<256, __nv_bfloat16, float>(alibi.c, alibi.sc, 1310, false, 2);
}

// ---- Accumulate mode (BwdParamsCuda::accumulate, the ring's bwd_add): the kernels add into fp32
// accumulators that start from random non-zero values, laid out as the op layer may hand them:
// the real head dims (dq_cols, dk_cols, dv_cols) when the operands are zero-padded up to the
// kernel's, and rows strided by an odd pad (no pair is 8-byte aligned). The added part (got -
// start) is compared with the float64 reference gradient; each pad element must keep its value.

struct AddCase {
  Case c;
  Scores sc;
  bool deterministic = false;
  int head_splits = 1;
  int real_dim = 0, real_dim_v = 0;  // > 0: the real head dims of q, k (and dq, dk) and v, dout
};

constexpr int kAccPad = 3;      // elements after each (token) row of an accumulator
constexpr int kAccGuard = 256;  // and after its last row: a write past the end fails cleanly
constexpr float kAccPadValue = 777.f;

// A (B, S, heads, cols) fp32 accumulator with rows of heads * cols + kAccPad elements.
struct Accumulator {
  int B, S, heads, cols;
  std::vector<float> data, start;

  Accumulator(int B_, int S_, int heads_, int cols_, std::mt19937& rng)
      : B(B_), S(S_), heads(heads_), cols(cols_) {
    std::normal_distribution<float> nd;
    data.assign(size_t(B) * S * row() + kAccGuard, kAccPadValue);
    for (int b = 0; b < B; ++b)
      for (int s = 0; s < S; ++s)
        for (int h = 0; h < heads; ++h)
          for (int e = 0; e < cols; ++e) data[at(b, s, h, e)] = nd(rng) + 0.5f;
    start = data;
  }
  int64_t row() const { return int64_t(heads) * cols + kAccPad; }
  BshdStrides strides() const { return {int64_t(S) * row(), row(), cols}; }
  // Points one gradient of a backward's params (its data, strides and column count) here.
  void attach(void** grad, BshdStrides* grad_strides, int* grad_cols) {
    *grad = data.data();
    *grad_strides = strides();
    *grad_cols = cols;
  }
  size_t at(int b, int s, int h, int e) const {
    return size_t((int64_t(b) * S + s) * row() + int64_t(h) * cols + e);
  }

  // got - start against ref (B, S, heads, d) in the real columns; the pads unchanged.
  void expect_added(const std::string& what, const std::vector<double>& ref, int d,
                    double tol) const {
    std::vector<double> added, want;
    for (int b = 0; b < B; ++b)
      for (int s = 0; s < S; ++s) {
        for (int h = 0; h < heads; ++h)
          for (int e = 0; e < cols; ++e) {
            const size_t i = at(b, s, h, e);
            ASSERT_TRUE(std::isfinite(data[i])) << what << ": non-finite element " << i;
            added.push_back(double(data[i]) - double(start[i]));
            want.push_back(ref[((size_t(b) * S + s) * heads + h) * d + e]);
          }
        for (int e = 0; e < kAccPad; ++e)
          ASSERT_EQ(data[at(b, s, 0, 0) + heads * cols + e], kAccPadValue)
              << what << ": pad written, row " << s;
      }
    for (size_t i = data.size() - kAccGuard; i < data.size(); ++i)
      ASSERT_EQ(data[i], kAccPadValue) << what << ": written past the end, element " << i;
    EXPECT_LE(rel_err(added, want), tol) << what << ": relative error of the added part";
  }
};

template <int kHeadDim, typename Elem>
void run_backward_add(const AddCase& a, uint64_t seed) {
  constexpr int d = kHeadDim;
  const Case& c = a.c;
  const int dim = a.real_dim > 0 ? a.real_dim : d;
  const int dim_v = a.real_dim_v > 0 ? a.real_dim_v : dim;
  SCOPED_TRACE(name_of(c, d) + " accumulate" + (a.deterministic ? " deterministic" : " atomic") +
               " splits " + std::to_string(a.head_splits) + " dims " + std::to_string(dim) + "/" +
               std::to_string(dim_v) + " softcap " + std::to_string(a.sc.softcap) +
               (a.sc.slopes.empty() ? "" : " alibi") + " prefix " +
               std::to_string(a.sc.prefix_end));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int B = c.batch, Sq = c.seqlen_q, Sk = c.seqlen_k, H = c.heads, Hk = c.kv_heads;
  auto [qd, kd, vd, dod, q, k, v, dout] = RandomOperands<Elem>(c, d, rng);
  // The op layer zero-pads every operand up to the kernel's head dim. Here the padded columns of
  // dout and of q or k (by seed; the scores stay those of the real columns) keep random values,
  // so that the padded columns of dv and of dk or dq hold non-zero gradients: they must not land
  // anywhere (the accumulators have no such columns).
  zero_pad_columns(seed % 2 ? &k : &q, seed % 2 ? &kd : &qd, d, dim);
  zero_pad_columns(&v, &vd, d, dim_v);
  const Reference ref = reference(c, d, qd, kd, vd, dod, a.sc);
  const std::vector<float> out(ref.out.begin(), ref.out.end());
  const std::vector<float> lse(ref.lse.begin(), ref.lse.end());
  Accumulator dq(B, Sq, H, dim, rng), dk(B, Sk, Hk, dim, rng), dv(B, Sk, Hk, dim_v, rng);

  std::vector<float> dkv_partial(a.head_splits > 1 ? size_t(2) * a.head_splits * k.size() : 0, NAN);
  BwdParamsCuda bp;
  set_dense_operands(bp, c, a.sc, d, q, k, v, dout);
  bp.scale_log2 = c.scale * 1.4426950408889634f;
  bp.out_dtype = DType::kFloat32;
  const BwdWorkspace workspace(bp, out.data(), bp.q_strides, d, lse.data());
  bp.head_splits = a.head_splits;
  bp.dkv_partial = a.head_splits > 1 ? dkv_partial.data() : nullptr;
  bp.grad_dtype = DType::kFloat32;
  bp.accumulate = true;
  dq.attach(&bp.dq, &bp.dq_strides, &bp.dq_cols);
  dk.attach(&bp.dk, &bp.dk_strides, &bp.dk_cols);
  dv.attach(&bp.dv, &bp.dv_strides, &bp.dv_cols);
  bp.dq_accum = a.deterministic ? nullptr : dq.data.data();  // the atomics' target: dq itself
  emulate_bwd_launch<d, Elem, float, float>(bp);
  const double gt = Host<Elem>::kGradTol;
  dq.expect_added("dq", ref.dq, d, gt);
  dk.expect_added("dk", ref.dk, d, gt);
  dv.expect_added("dv", ref.dv, d, gt);
}

// Atomic dQ into dq and the deterministic pass, causal or not, odd lengths, a ring step's
// offsets, a window, and rows that see no key (nothing added).
TEST(EmulatedKernels, AccumulateBf16HeadDim64Atomic) {
  uint64_t seed = 1400;
  for (const Case& c : cases(all_cases())) run_backward_add<64, __nv_bfloat16>({c, {}}, seed++);
}
TEST(EmulatedKernels, AccumulateFp16HeadDim128Deterministic) {
  uint64_t seed = 1450;
  for (const Case& c : cases(all_cases()))
    run_backward_add<128, __half>({c, {}, /*deterministic=*/true}, seed++);
}

// GQA / MQA head splits (the reduction adds), the head dim's own split (256: slices of dK / dV
// / dQ columns), zero-padded head dims (odd ones too: no aligned pairs) with D != Dv, and the
// scored instantiations.
TEST(EmulatedKernels, AccumulateSplitsPaddingScored) {
  const Case mqa{1, 90, 130, 4, 1, true, -1, -1, 40, 0, 0.1f};
  const Case gqa{2, 70, 70, 8, 2, false, 30, 5, 0, 0, 0.09f};
  const Case odd{1, 77, 53, 4, 2, true, -1, -1, 0, 0, 0.125f};
  run_backward_add<64, __nv_bfloat16>({gqa, {}, false, 2}, 1501);
  run_backward_add<128, __half>({gqa, {}, true, 4}, 1502);
  run_backward_add<64, __nv_bfloat16>({mqa, {}, false, 4}, 1503);
  run_backward_add<64, __nv_bfloat16>({odd, {}, false, 1, 40, 64}, 1504);
  run_backward_add<64, __half>({odd, {}, true, 2, 33, 33}, 1505);
  run_backward_add<96, __nv_bfloat16>({mqa, {}, false, 2, 80, 80}, 1506);
  run_backward_add<256, __nv_bfloat16>({mqa, {}, false, 2, 200, 136}, 1507);
  run_backward_add<256, __half>({odd, {}, true, 1, 256, 130}, 1508);
  const auto sc = scored_cases();
  const ScoredCase &combo = sc[9], &all = sc.back();
  run_backward_add<64, __nv_bfloat16>({combo.c, combo.sc, false, 2}, 1509);
  run_backward_add<128, __half>({all.c, all.sc, true, 1, 96, 128}, 1510);
}

}  // namespace
}  // namespace cpattn::cuda
