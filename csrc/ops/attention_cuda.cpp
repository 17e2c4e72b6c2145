// The CUDA backend (backend.h): tensors -> cuda::FwdParamsCuda / BwdParamsCuda on the current
// stream of the tensors' device, the merge kernel, and the CUDA registrations of the ops. The
// kernels read the user's (B, S, H, D) bf16 / fp16 tensors in place; an operand is copied only
// when its head dim has no compiled kernel (zero-padded up to the next one), when v's head dim
// differs from q's (q, k, v zero-padded to one kernel head dim >= both; out and the gradients
// sliced back, or added into the accumulators' real columns by bwd_add), or its strides /
// alignment do not suit cp.async.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "cpattn/env.h"
#include "cpattn/kv_cache.h"
#include "cpattn/softmax_state.h"
#include "cpattn/tiling.h"
#include "cuda/merge_state.h"
#include "cuda/params.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"

namespace cpattn::ops {
namespace {

void check_half_inputs(const at::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "cpattn: the CUDA kernels take bfloat16 or float16 q, k, v, got ", q.scalar_type(),
              " (cast with .to(torch.bfloat16); float32 attention runs on the CPU only)");
}

// The kernels write their results (out, or the gradients) in float32 or in q's dtype.
void check_result_dtype(const char* name, at::ScalarType dtype, const at::Tensor& q) {
  TORCH_CHECK(dtype == at::kFloat || dtype == q.scalar_type(), "cpattn: CUDA ", name,
              " must be float32 or q's dtype (", q.scalar_type(), "), got ", dtype);
}

std::string compiled_list() {
  int n = 0;
  const int* dims = cuda::compiled_head_dims(&n);
  std::ostringstream os;
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << dims[i];
  return os.str();
}

int kernel_head_dim(int64_t d) {
  int n = 0;
  const int* dims = cuda::compiled_head_dims(&n);
  const int kd = pick_kernel_head_dim(static_cast<int>(d), dims, n);
  TORCH_CHECK(kd > 0, "cpattn: no CUDA kernel for head_dim ", d,
              " in this build (compiled head "
              "dims: ",
              compiled_list(),
              "; smaller ones are zero-padded up); rebuild with "
              "CPATTN_CUDA_HEAD_DIMS including a head dim >= ",
              d);
  return kd;
}

bool kernel_readable(const at::Tensor& t) {  // the rule: cuda::operand_readable
  const int64_t sizes[3] = {t.size(0), t.size(1), t.size(2)};
  return cuda::operand_readable(t.data_ptr(), sizes, {t.stride(0), t.stride(1), t.stride(2)});
}

// The operand as the kernels read it: head dim kd (zero-padded) and kernel_readable.
at::Tensor kernel_operand(const at::Tensor& t, int64_t kd) {
  if (t.size(3) != kd) return at::constant_pad_nd(t, {0, kd - t.size(3)}, 0.0).contiguous();
  if (kernel_readable(t)) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// The inverse of kernel_operand's padding: t (a kernel output, head dim kd) cut to head dim d.
at::Tensor unpadded(const at::Tensor& t, int64_t d) {
  return t.size(3) == d ? t : t.narrow(3, 0, d).contiguous();
}

// Points a kernel operand (its data pointer and (B, S, H, D) strides) at t.
template <typename Ptr>
void bind(Ptr& data, BshdStrides& strides, const at::Tensor& t) {
  data = t.data_ptr();
  strides = strides_of(t);
}

BhsStrides lse_strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

cuda::ShapeCuda shape_of(const AttnShape& s, int kd) {
  TORCH_CHECK(s.seqlen_q < (int64_t(1) << 31) - 256 && s.seqlen_k < (int64_t(1) << 31) - 256,
              "cpattn: CUDA sequence lengths must be below 2^31, got ", s.seqlen_q, " and ",
              s.seqlen_k);
  TORCH_CHECK(s.batch <= 65535 && s.heads <= 65535,
              "cpattn: the CUDA kernels take at most 65535 batch entries and heads, got batch ",
              s.batch, " and ", s.heads, " heads");
  cuda::ShapeCuda c;
  c.batch = static_cast<int>(s.batch);
  c.heads = static_cast<int>(s.heads);
  c.kv_heads = static_cast<int>(s.kv_heads);
  c.seqlen_q = static_cast<int>(s.seqlen_q);
  c.seqlen_k = static_cast<int>(s.seqlen_k);
  c.head_dim = kd;
  return c;
}

void check_launch(int err, const char* what) {
  if (err == 0) return;
  TORCH_CHECK(err != cuda::kErrNoKernel,
              "cpattn: no CUDA kernel compiled for this dtype and head "
              "dim (",
              what, "; compiled head dims: ", compiled_list(), ")");
  TORCH_CHECK(false, "cpattn: CUDA ", what,
              " kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// torch.use_deterministic_algorithms(True), CPATTN_DETERMINISTIC=1 or the invariant mode's fixed
// order: dQ by a separate pass instead of fp32 atomics (bitwise reproducible, some
// recomputation; in that pass each row sums its key blocks in order from key 0).
bool deterministic_backward(const AttnShape& s) {
  static const bool env = env::deterministic();
  return env || s.fixed_order || at::globalContext().deterministicAlgorithms();
}

// How many thread blocks share the query heads of one kv head in the dK/dV pass: with few kv
// heads (MQA, small GQA groups) and short keys, (key blocks x kv heads x batch) blocks would leave
// most SMs idle. Splits the group (a divisor of it) until there are about two blocks per SM.
// CPATTN_BWD_HEAD_SPLITS=n forces n (tests; rounded down to a divisor of the group). The
// invariant mode's fixed order: 1, whatever the shape (a key's sum over the query heads and blocks
// must not depend on how many keys or SMs there are; tests/emulate/test_invariant_emulated.cpp).
int bwd_head_splits(const AttnShape& s, int kd) {
  const int64_t group = s.heads / s.kv_heads;
  int64_t want = 1;
  if (s.fixed_order) {
    want = 1;
  } else if (const auto forced = env::bwd_head_splits()) {
    want = std::max<int64_t>(1, *forced);
  } else {
    const int64_t blocks =
        int64_t(cuda::bwd_dkdv_blocks(kd, static_cast<int>(s.seqlen_k))) * s.kv_heads * s.batch;
    const int64_t target = 2 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    want = (target + blocks - 1) / std::max<int64_t>(blocks, 1);
  }
  int64_t splits = std::min(want, group);
  while (group % splits != 0) --splits;
  TORCH_CHECK(s.kv_heads * splits <= 65535, "cpattn: too many kv heads for the CUDA backward (",
              s.kv_heads, ")");
  return static_cast<int>(splits);
}

// The kernels' one head dim for q, k (D) and v (Dv): the compiled one serving max(D, Dv).
int kernel_head_dim(const AttnShape& s) {
  return kernel_head_dim(std::max(s.head_dim, s.head_dim_v));
}

// What the parameters of both passes share: shape, q, k, v (as the kernels read them), scale,
// mask, score options (slopes / sinks receive the fp32 tensors the pointers point into).
template <typename Params>
void fill_inputs(Params& p, const AttnShape& s, int kd, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, double softmax_scale, const Mask& mask,
                 const ScoreArgs& score, at::Tensor& slopes, at::Tensor& sinks) {
  p.shape = shape_of(s, kd);
  p.dtype = to_dtype(q.scalar_type());
  bind(p.q, p.q_strides, q);
  bind(p.k, p.k_strides, k);
  bind(p.v, p.v_strides, v);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  p.mask = mask;
  p.score = score_options(score, slopes, sinks);
}

// Every option of ScoreArgs and the mask runs on CUDA (the head dim is checked by
// kernel_head_dim).
std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const AttnShape& s,
                                                      double softmax_scale, const Mask& mask,
                                                      const ScoreArgs& score,
                                                      at::ScalarType out_dtype) {
  check_half_inputs(q);
  check_result_dtype("out_dtype", out_dtype, q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int kd = kernel_head_dim(s);
  const at::Tensor qk = kernel_operand(q, kd), kk = kernel_operand(k, kd),
                   vk = kernel_operand(v, kd);
  const at::Tensor out =
      new_output({s.batch, s.seqlen_q, s.heads, kd}, q.options().dtype(out_dtype));
  at::Tensor lse = new_output({s.batch, s.heads, s.seqlen_q}, q.options().dtype(at::kFloat));

  cuda::FwdParamsCuda p;
  at::Tensor slopes, sinks;  // kept alive until the kernel has run (stream-ordered frees)
  fill_inputs(p, s, kd, qk, kk, vk, softmax_scale, mask, score, slopes, sinks);
  p.out_dtype = to_dtype(out_dtype);
  bind(p.out, p.out_strides, out);
  p.lse = lse.data_ptr<float>();
  check_launch(cuda::run_fwd(p, at::cuda::getCurrentCUDAStream().stream()), "forward");
  return {unpadded(out, s.head_dim_v), lse};
}

void check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q) {
  check_half_inputs(q);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), "cpattn: CUDA dout must have q's dtype (",
              q.scalar_type(), "), got ", dout.scalar_type());
}

// The backward's kernel parameters and the tensors they point into (kept alive until the kernels
// have run: stream-ordered frees): the operands as the kernels read them, the preprocess's
// workspace and the head-split parts. The caller adds dq_accum and the gradients.
struct BwdCall {
  cuda::BwdParamsCuda p;
  at::Tensor qk, kk, vk, dok, dlse_f, lse_log2, delta, dkv_partial, slopes, sinks;
};

void prepare_bwd(BwdCall& c, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                 const std::optional<at::Tensor>& dlse, const AttnShape& s, int kd,
                 double softmax_scale, const Mask& mask, const ScoreArgs& score) {
  c.qk = kernel_operand(q, kd);
  c.kk = kernel_operand(k, kd);
  c.vk = kernel_operand(v, kd);
  c.dok = kernel_operand(dout, kd);
  if (dlse && dlse->defined()) c.dlse_f = dlse->to(at::kFloat);
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t rounded =
      (s.seqlen_q + cuda::kBwdSeqRound - 1) / cuda::kBwdSeqRound * cuda::kBwdSeqRound;
  c.lse_log2 = at::empty({s.batch, s.heads, rounded}, f32);
  c.delta = at::empty({s.batch, s.heads, rounded}, f32);
  const int head_splits = bwd_head_splits(s, kd);
  if (head_splits > 1)  // every element written by the dK/dV pass
    c.dkv_partial = at::empty({2, head_splits, s.batch, s.seqlen_k, s.kv_heads, kd}, f32);

  cuda::BwdParamsCuda& p = c.p;
  fill_inputs(p, s, kd, c.qk, c.kk, c.vk, softmax_scale, mask, score, c.slopes, c.sinks);
  p.score.sinks = nullptr;  // already in lse (the forward's, or apply_sinks_ after a merge)
  bind(p.dout, p.dout_strides, c.dok);
  if (out.defined()) {  // else no rowsum(dout * out) term: delta = -dlse
    p.out_dtype = to_dtype(out.scalar_type());
    bind(p.out, p.out_strides, out);
  } else {
    p.out_dtype = to_dtype(dout.scalar_type());
  }
  p.out_head_dim = static_cast<int>(s.head_dim_v);
  p.lse = lse.data_ptr<float>();
  p.lse_strides = lse_strides_of(lse);
  if (c.dlse_f.defined()) {
    p.dlse = c.dlse_f.data_ptr<float>();
    p.dlse_strides = lse_strides_of(c.dlse_f);
  }
  p.seqlen_q_rounded = static_cast<int>(rounded);
  p.lse_log2 = c.lse_log2.data_ptr<float>();
  p.delta = c.delta.data_ptr<float>();
  p.head_splits = head_splits;
  p.dkv_partial = c.dkv_partial.defined() ? c.dkv_partial.data_ptr<float>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const AttnShape& s, double softmax_scale, const Mask& mask, const ScoreArgs& score,
    std::optional<at::ScalarType> grad_dtype) {
  check_bwd_inputs(dout, q);
  const at::ScalarType gd = grad_dtype.value_or(q.scalar_type());
  check_result_dtype("grad_dtype", gd, q);
  const c10::cuda::CUDAGuard guard(q.device());
  const int kd = kernel_head_dim(s);
  BwdCall c;
  prepare_bwd(c, dout, q, k, v, out, lse, dlse, s, kd, softmax_scale, mask, score);
  at::Tensor dq_accum;
  if (!deterministic_backward(s))
    dq_accum =
        at::zeros({s.batch, s.heads, c.p.seqlen_q_rounded, kd}, q.options().dtype(at::kFloat));
  const at::Tensor dq = new_output({s.batch, s.seqlen_q, s.heads, kd}, q.options().dtype(gd));
  const at::Tensor dk = new_output({s.batch, s.seqlen_k, s.kv_heads, kd}, q.options().dtype(gd));
  const at::Tensor dv = new_output({s.batch, s.seqlen_k, s.kv_heads, kd}, q.options().dtype(gd));
  cuda::BwdParamsCuda& p = c.p;
  p.dq_accum = dq_accum.defined() ? dq_accum.data_ptr<float>() : nullptr;
  p.grad_dtype = to_dtype(gd);
  bind(p.dq, p.dq_strides, dq);
  bind(p.dk, p.dk_strides, dk);
  bind(p.dv, p.dv_strides, dv);
  check_launch(cuda::run_bwd(p, at::cuda::getCurrentCUDAStream().stream()), "backward");
  return {unpadded(dq, s.head_dim), unpadded(dk, s.head_dim), unpadded(dv, s.head_dim_v)};
}

// The backward adding into the fp32 accumulators dq, dk, dv (attention.cpp has checked their
// dtype, shapes and unit head-dim stride), in place: no fp32 gradient of the sub-problem is
// allocated, and dQ's atomics (unless deterministic) go straight into dq, so no dq_accum either.
// A zero-padded head dim needs no fallback: the kernels add only into the accumulators' real
// columns (dq_cols, ...), and any strides do. dq_low is always undefined: the CUDA backend has no
// round_split, so split dQ sums stay CPU-only.
void attention_bwd_add_cuda(const at::Tensor& dq, const at::Tensor& dq_low, const at::Tensor& dk,
                            const at::Tensor& dv, const at::Tensor& dout, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                            const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                            const AttnShape& s, double softmax_scale, const Mask& mask,
                            const ScoreArgs& score) {
  TORCH_CHECK(!dq_low.defined(), "cpattn: the CUDA backward has no split dQ sums");
  check_bwd_inputs(dout, q);
  for (const at::Tensor* t : {&dq, &dk, &dv})
    if (at::has_internal_overlap(*t) == at::MemOverlap::Yes) {
      // An accumulator whose elements alias (a zero stride): in-place adds from several threads
      // would race, so compute, then let add_ decide (it raises, as torch does for such targets).
      const auto [dq_part, dk_part, dv_part] = attention_bwd_cuda(
          dout, q, k, v, out, lse, dlse, s, softmax_scale, mask, score, at::kFloat);
      dq.add_(dq_part);
      dk.add_(dk_part);
      dv.add_(dv_part);
      return;
    }
  const c10::cuda::CUDAGuard guard(q.device());
  const int kd = kernel_head_dim(s);
  BwdCall c;
  prepare_bwd(c, dout, q, k, v, out, lse, dlse, s, kd, softmax_scale, mask, score);
  cuda::BwdParamsCuda& p = c.p;
  p.accumulate = true;
  p.grad_dtype = DType::kFloat32;
  bind(p.dq, p.dq_strides, dq);
  bind(p.dk, p.dk_strides, dk);
  bind(p.dv, p.dv_strides, dv);
  p.dq_cols = static_cast<int>(s.head_dim);
  p.dk_cols = static_cast<int>(s.head_dim);
  p.dv_cols = static_cast<int>(s.head_dim_v);
  p.dq_accum = deterministic_backward(s) ? nullptr : dq.data_ptr<float>();
  check_launch(cuda::run_bwd(p, at::cuda::getCurrentCUDAStream().stream()), "backward (add)");
}

void merge_into_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                     const at::Tensor& part_lse) {
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor po = part_out.to(at::kFloat).contiguous();
  const at::Tensor pl = part_lse.to(at::kFloat).contiguous();
  const cuda::MergeStrides st{out.stride(0), out.stride(1), out.stride(2),
                              lse.stride(0), lse.stride(1), lse.stride(2)};
  const int err = cuda::merge_state(
      out.data_ptr<float>(), lse.data_ptr<float>(), po.data_ptr<float>(), pl.data_ptr<float>(),
      out.size(0), out.size(1), out.size(2), out.size(3), st, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "cpattn: merge_state_ CUDA kernel failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// add_sink (softmax_state.h) on whole tensors, in place: lse' = log(exp(lse) + exp(sink)),
// out *= exp(lse - lse'), an empty row (lse -inf) gets out 0 and lse' = sink.
void apply_sinks_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor merged = at::logaddexp(lse, sinks.view({1, -1, 1}));
  const at::Tensor factor = at::exp(lse - merged).masked_fill(lse == neg_inf(), 0.0);
  out.mul_(factor.permute({0, 2, 1}).unsqueeze(3));
  lse.copy_(merged);
}

// sink_grad (softmax_state.h) per row, reduced over batch and rows in float64.
at::Tensor sink_bwd_cuda(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                         const at::Tensor& sinks, const std::optional<at::Tensor>& dlse) {
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(3).permute({0, 2, 1});
  if (dlse && dlse->defined()) delta = delta - dlse->to(at::kFloat);
  const at::Tensor grad =
      (-at::exp(sinks.view({1, -1, 1}) - lse) * delta).masked_fill(lse == neg_inf(), 0.0);
  return grad.to(at::kDouble).sum(at::IntArrayRef{0, 2}).to(at::kFloat);
}

at::Tensor row_dot_cuda(const at::Tensor& a, const at::Tensor& b) {
  const c10::cuda::CUDAGuard guard(a.device());
  return (a.to(at::kFloat) * b.to(at::kFloat)).sum(3).permute({0, 2, 1}).contiguous();
}

// The batched split-KV decode (cuda/decode_kernel.cuh) for the cases it serves: a compiled head
// dim (the cache is never padded or copied), a kernel_readable cache, few query rows per kv head
// (decode_grid). lens and q_start go to the device in one pinned, non-blocking copy (no sync);
// the number of splits comes from the shapes and the SM count only.
std::optional<std::tuple<at::Tensor, at::Tensor>> cache_decode_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::vector<int64_t>& lens, const std::vector<int64_t>& q_start,
    const CacheSharding& sharding, int64_t rank, double softmax_scale, const Mask& rule,
    const ScoreArgs& score) {
  check_half_inputs(q_in);
  const int64_t B = q_in.size(0), Sq = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_cache.size(2), slots = k_cache.size(1);
  int n = 0;
  const int* dims = cuda::compiled_head_dims(&n);
  const bool compiled = std::find(dims, dims + n, D) != dims + n;
  const bool global_scores = !score.sinks && score.alibi_q_begin == 0 && score.alibi_k_begin == 0 &&
                             score.alibi_stride == 1;
  if (!compiled || !global_scores || k_cache.stride(3) != 1 || v_cache.stride(3) != 1 ||
      !kernel_readable(k_cache) || !kernel_readable(v_cache) || B > 65535 || Sq > 65535 ||
      H > 65535)
    return std::nullopt;
  const c10::cuda::CUDAGuard guard(q_in.device());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const cuda::DecodeGrid grid =
      cuda::decode_grid(static_cast<int>(D), static_cast<int>(B), static_cast<int>(Hkv),
                        static_cast<int>((H / Hkv) * Sq), slots, 4 * sms);
  if (grid.splits == 0 || Hkv * grid.row_groups > 65535) return std::nullopt;

  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor host = at::empty({2, B}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(lens.begin(), lens.end(), host.data_ptr<int64_t>());
  std::copy(q_start.begin(), q_start.end(), host.data_ptr<int64_t>() + B);
  // The caching host allocator keeps `host` until the copy has run (it records the stream).
  const at::Tensor positions = at::empty({2, B}, q.options().dtype(at::kLong));
  positions.copy_(host, /*non_blocking=*/true);
  const at::Tensor part_out = at::empty({grid.splits, B, Sq, H, D}, f32);
  const at::Tensor part_lse = at::empty({grid.splits, B, H, Sq}, f32);
  const at::Tensor out = at::empty({B, Sq, H, D}, f32);
  const at::Tensor lse = at::empty({B, H, Sq}, f32);

  cuda::DecodeParamsCuda p;
  at::Tensor slopes, sinks;  // kept alive until the kernels have run (stream-ordered frees)
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  p.mask = rule;
  p.score = score_options(score, slopes, sinks);
  p.batch = static_cast<int>(B);
  p.heads = static_cast<int>(H);
  p.kv_heads = static_cast<int>(Hkv);
  p.seqlen_q = static_cast<int>(Sq);
  p.head_dim = static_cast<int>(D);
  p.dtype = to_dtype(q.scalar_type());
  bind(p.q, p.q_strides, q);
  bind(p.k_cache, p.k_strides, k_cache);
  bind(p.v_cache, p.v_strides, v_cache);
  p.cache_lens = positions.data_ptr<int64_t>();
  p.q_start = p.cache_lens + B;
  p.sharding = sharding;
  p.rank = rank;
  p.splits = grid.splits;
  p.split_slots = grid.split_slots;
  p.row_groups = grid.row_groups;
  p.part_out = part_out.data_ptr<float>();
  p.part_lse = part_lse.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.out_strides = strides_of(out);
  p.lse = lse.data_ptr<float>();
  check_launch(cuda::run_decode(p, at::cuda::getCurrentCUDAStream().stream()), "decode");
  return std::make_tuple(out, lse);
}

[[maybe_unused]] const bool registered = register_backend(
    c10::DeviceType::CUDA, {&attention_fwd_cuda, &attention_bwd_cuda, &attention_bwd_add_cuda,
                            /*round_split=*/nullptr, /*bwd_in_dout=*/nullptr, &merge_into_cuda,
                            &apply_sinks_cuda, &sink_bwd_cuda, &row_dot_cuda, &cache_decode_cuda});

}  // namespace
}  // namespace cpattn::ops

TORCH_LIBRARY_IMPL(cpattn, CUDA, m) {
  cpattn::ops::impl_attention_ops(m);
  cpattn::ops::impl_ring_ops(m);
  cpattn::ops::impl_inference_ops(m);
}
