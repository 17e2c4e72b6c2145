// Ring attention: the driver (transport-agnostic) and its ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include "comm/transport.h"
#include "cpattn/layout.h"

namespace cpattn::ops {

struct RingOptions {
  double softmax_scale;
  bool causal;
  int64_t window_left;
  int64_t window_right;
  Layout layout;
  // Empty: one sequence of W * S_local tokens. Otherwise packed documents of these real lengths,
  // each sharded by the layout on its own (plan_step_varlen in cpattn/schedule.h).
  std::vector<int64_t> doc_lengths;
  // dtype of the returned out (default: q's); float32 keeps a result that is merged further exact.
  std::optional<at::ScalarType> out_dtype = std::nullopt;
  // Score options (ops.h ScoreArgs): the ALiBi positions of each sub-problem come from its runs;
  // the sinks join once, after the last merge.
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;
  std::optional<at::Tensor> sinks;
  int64_t prefix_len = 0;  // keys at global positions < prefix_len (per document) seen by all
};
RingOptions make_ring_options(double softmax_scale, bool causal, int64_t window_left,
                              int64_t window_right, int64_t layout,
                              const std::optional<at::Tensor>& doc_lengths, double softcap = 0.0,
                              const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
                              const std::optional<at::Tensor>& sinks = std::nullopt,
                              int64_t prefix_len = 0);

// Called with each K/V shard the ring brings to this rank: its source rank, k and v
// (B, S_local, Hkv, D), own shard first. Lets a caller use every shard once (prefill stores the
// tokens it owns in its KV cache) without sending K/V again.
using ShardVisitor =
    std::function<void(int64_t source, const at::Tensor& k, const at::Tensor& v)>;

// q, k, v: this rank's shards (B, S_local, H | Hkv, D) in layout order. Returns this rank's out
// (options.out_dtype, default q's dtype) and lse (B, H, S_local) fp32.
std::tuple<at::Tensor, at::Tensor> ring_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, comm::Transport& transport,
                                                const RingOptions& options,
                                                const ShardVisitor& visit = {});
// Gradients of this rank's shards from the global out / lse of its queries (and the gradient
// dlse flowing into lse, if any).
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    comm::Transport& transport, const RingOptions& options);

std::tuple<at::Tensor, at::Tensor> ring_fwd(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, c10::string_view group_name,
                                            double softmax_scale, bool causal,
                                            int64_t window_left, int64_t window_right,
                                            int64_t layout, double timeout_s,
                                            const std::optional<at::Tensor>& doc_lengths,
                                            double softcap,
                                            const std::optional<at::Tensor>& alibi_slopes,
                                            const std::optional<at::Tensor>& sinks,
                                            int64_t prefix_len);
std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, int64_t layout,
    double timeout_s, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& doc_lengths, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t prefix_len);

// The ring's steps against K/V shards already gathered on this rank: kv_all is
// (W, 2, B, S_local, Hkv, D). The backward returns dq and this rank's fp32 contributions to every
// shard's dK/dV (W, 2, B, S_local, Hkv, D), to be reduce-scattered.
std::tuple<at::Tensor, at::Tensor> gathered_fwd(const at::Tensor& q, const at::Tensor& kv_all,
                                                int64_t rank, double softmax_scale, bool causal,
                                                int64_t window_left, int64_t window_right,
                                                int64_t layout,
                                                const std::optional<at::Tensor>& doc_lengths,
                                                double softcap,
                                                const std::optional<at::Tensor>& alibi_slopes,
                                                const std::optional<at::Tensor>& sinks,
                                                int64_t prefix_len);
std::tuple<at::Tensor, at::Tensor> gathered_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv_all, const at::Tensor& out,
    const at::Tensor& lse, int64_t rank, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, int64_t layout, const std::optional<at::Tensor>& doc_lengths,
    const std::optional<at::Tensor>& dlse, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t prefix_len);

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> ring_fwd_emulated(
    at::TensorList q, at::TensorList k, at::TensorList v, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, int64_t layout);
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
ring_bwd_emulated(at::TensorList dout, at::TensorList q, at::TensorList k, at::TensorList v,
                  at::TensorList out, at::TensorList lse, double softmax_scale, bool causal,
                  int64_t window_left, int64_t window_right, int64_t layout);

struct RingStats {
  double compute_s = 0;  // computing and merging sub-problems
  double wait_s = 0;     // blocked on shifts: communication that compute did not hide
};
// float64 (fwd compute, fwd wait, bwd compute, bwd wait) of the last ring calls on this thread.
at::Tensor ring_stats();

// Benchmark: seconds (forward, backward) of `rank`'s ring work with communication replaced by
// local copies (comm::make_loopback_transport).
at::Tensor ring_loopback_timing(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& dout, int64_t rank, int64_t world,
                                double softmax_scale, bool causal, int64_t window_left,
                                int64_t window_right, int64_t layout);

// The transport the ring ops use for tensors like q over the group `group_name`.
std::unique_ptr<comm::Transport> group_transport(const at::Tensor& q, c10::string_view group_name,
                                                 double timeout_s);

// One ring shift of `send` (to rank + 1, from rank - 1) through the transport the ring ops use
// for its device: a test of the transport itself (at W = 1, NCCL send / recv to self).
at::Tensor ring_shift(const at::Tensor& send, c10::string_view group_name, double timeout_s);

// Frees the ring's receive buffers and dK/dV accumulators kept between calls on CPU tensors
// (cpattn.release_buffers); returns their bytes.
int64_t release_buffers();

// Destroys the NCCL communicators the CUDA ring cached (one per process group and device);
// returns how many (0 in a CPU build).
int64_t destroy_communicators();

// Global positions (int64) of the local tokens of `rank`.
at::Tensor layout_positions(int64_t seqlen, int64_t world, int64_t rank, int64_t layout);

// (world, world, 3) int64: for each (rank, step) of the ring schedule, the visible pairs, the pairs
// in visited block_m x block_n tiles and the kernel calls (csrc/include/cpattn/work.h); per head
// and batch row. doc_lengths: packed documents (varlen) instead of one sequence of seqlen.
at::Tensor schedule_work(int64_t seqlen, int64_t world, int64_t layout, bool causal,
                         int64_t window_left, int64_t window_right, int64_t block_m,
                         int64_t block_n, const std::optional<at::Tensor>& doc_lengths);

}  // namespace cpattn::ops
