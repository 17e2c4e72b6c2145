// The kernels of one device type behind the device-generic ops, extension-cpp style: each backend
// file (attention_cpu.cpp, attention_cuda.cpp) registers its kernels here and its ops with
// TORCH_LIBRARY_IMPL for its dispatch key; the ops check their arguments (checks.h) and call
// backend_for(device). The checks run once per call: the ring driver checks its call
// (check_ring_args, check_kernel_args), then every sub-problem of every step goes through
// attention_fwd_unchecked or attention_bwd_add_unchecked (ops.h), which do not check again. No
// device branches in the ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <tuple>
#include <vector>

#include "cpattn/kv_cache.h"
#include "cpattn/params.h"
#include "ops/ops.h"

namespace torch {
class Library;
}

namespace cpattn::ops {

struct Backend {
  // attention_fwd_scored / attention_bwd_scored with their arguments checked.
  std::tuple<at::Tensor, at::Tensor> (*fwd)(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const AttnShape& s,
                                            double softmax_scale, const Mask& mask,
                                            const ScoreArgs& score, at::ScalarType out_dtype);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*bwd)(
      const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
      const AttnShape& s, double softmax_scale, const Mask& mask, const ScoreArgs& score,
      std::optional<at::ScalarType> grad_dtype);
  // attention_bwd_add_scored (ops.h) with its arguments checked (dq_low undefined unless dq is
  // split sums), and round_split_ (ops.h). Both nullptr on a backend without them: then
  // attention.cpp runs bwd and adds, and dQ is never split.
  void (*bwd_add)(const at::Tensor& dq, const at::Tensor& dq_low, const at::Tensor& dk,
                  const at::Tensor& dv, const at::Tensor& dout, const at::Tensor& q,
                  const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                  const at::Tensor& lse, const std::optional<at::Tensor>& dlse, const AttnShape& s,
                  double softmax_scale, const Mask& mask, const ScoreArgs& score);
  void (*round_split)(const at::Tensor& high, const at::Tensor& low);
  // attention_bwd_in_dout_scored (ops.h) with its arguments checked; nullptr on a backend whose
  // kernel reads dO after writing dQ: then attention.cpp runs bwd and copies dQ over dout.
  std::tuple<at::Tensor, at::Tensor> (*bwd_in_dout)(const at::Tensor& dout, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& out, const at::Tensor& lse,
                                                    const std::optional<at::Tensor>& dlse,
                                                    const AttnShape& s, double softmax_scale,
                                                    const Mask& mask, const ScoreArgs& score);
  // merge_into (ops.h) on this device.
  void (*merge)(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& part_out,
                const at::Tensor& part_lse);
  // The ops apply_sinks_ and sink_bwd (attention.cpp) with their arguments checked; sinks (H,)
  // fp32 contiguous, lse (B, H, S) fp32.
  void (*apply_sinks)(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks);
  at::Tensor (*sink_bwd)(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                         const at::Tensor& sinks, const std::optional<at::Tensor>& dlse);
  // The op row_dot (attention.cpp) with its arguments checked.
  at::Tensor (*row_dot)(const at::Tensor& a, const at::Tensor& b);
  // cache_attention_fwd (inference.cpp) with its arguments checked, for every sequence at once:
  // q (B, Sq, H, D) over the slots `rank` stores of each sequence's first lens[b] positions,
  // query row i at position q_start[b] + i; `rule` the global mask (offsets 0), `score` on
  // global positions (no sinks). Returns out (B, Sq, H, D) and lse (B, H, Sq) in fp32, or
  // nothing when it has no kernel for the case (then the op runs the forward span by span).
  // nullptr on a backend without such a kernel.
  std::optional<std::tuple<at::Tensor, at::Tensor>> (*cache_decode)(
      const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
      const std::vector<int64_t>& lens, const std::vector<int64_t>& q_start,
      const CacheSharding& sharding, int64_t rank, double softmax_scale, const Mask& rule,
      const ScoreArgs& score);
};

// The kernels' name of a float dtype (float32, bfloat16, float16).
inline DType to_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? DType::kBFloat16 : t == at::kHalf ? DType::kFloat16 : DType::kFloat32;
}

// Strides of a (batch, seqlen, heads, head_dim) tensor, head_dim contiguous.
inline BshdStrides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// The CPU backward's byte budget per kernel call (attention_cpu.cpp, kBackwardGroupBytes): sets
// it, returns the previous one. For tests, which lower it to run every head group's path.
int64_t exchange_cpu_backward_group_bytes(int64_t bytes);

// Whether the CPU backward takes these bf16 operands through bf16 dot products (packed in bf16;
// otherwise in fp32).
bool cpu_backward_takes_bf16(const at::Tensor& q, const at::Tensor& dout);

// KV heads per kernel call of the CPU backward (attention_cpu.cpp backward_cpu) on these operands
// (their dtypes and strides decide its packing; meta tensors will do) with gradients dk, dv in
// `grad`: as many as fit the byte budget above, at least one.
int64_t cpu_backward_kv_heads_per_call(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const AttnShape& s, at::ScalarType grad);

// Called once per device type at load time (a static initialiser in the backend's file).
bool register_backend(c10::DeviceType type, const Backend& backend);

// The kernels for tensors on `device`; raises when this build has none.
const Backend& backend_for(const c10::Device& device);

// The ops every backend serves, device-generic (attention.cpp, ring.cpp, inference.cpp):
// each backend's TORCH_LIBRARY_IMPL block calls these for its dispatch key.
void impl_attention_ops(torch::Library& m);
void impl_ring_ops(torch::Library& m);
void impl_invariant_ops(torch::Library& m);  // CPU only
void impl_inference_ops(torch::Library& m);

}  // namespace cpattn::ops
