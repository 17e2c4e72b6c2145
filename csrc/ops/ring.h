// Ring attention: the driver, written once against comm::Transport, and its ops over a process
// group (ring.cpp); the test-only ops (emulated ranks, loopback) are in testing_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include "comm/transport.h"
#include "cpattn/layout.h"
#include "ops/options.h"

namespace cpattn::ops {

// The attention options (normalized windows) and what a ring call adds to them.
struct RingOptions : AttentionOptions {
  Layout layout = Layout::kContiguous;
  // Empty: one sequence of W * S_local tokens. Otherwise packed documents of these real lengths,
  // each sharded by the layout on its own (schedule_step_varlen in cpattn/schedule.h).
  std::vector<int64_t> doc_lengths;
  // Packed documents only: each document's own prefix length (0: none), in place of prefix_len.
  std::vector<int64_t> doc_prefix_lens;
  // dtype of the returned out (default: q's); float32 keeps a result that is merged further exact.
  std::optional<at::ScalarType> out_dtype = std::nullopt;
  // (H,) float, or none: they join once, after the last merge (the ALiBi positions of each
  // sub-problem come from its runs).
  std::optional<at::Tensor> sinks;
};
// doc_lengths: (D,) int64 document lengths; doc_prefix_lens: (D,) int64 each document's prefix-LM
// length (a prefix per document, ring_attention_varlen), or none.
RingOptions make_ring_options(const AttentionOptions& options, int64_t layout,
                              const std::optional<at::Tensor>& doc_lengths,
                              const std::optional<at::Tensor>& doc_prefix_lens,
                              const std::optional<at::Tensor>& sinks);

// Called with each K/V shard the ring brings to this rank: its source rank, k and v
// (B, S_local, Hkv, D), own shard first. Lets a caller use every shard once (prefill stores the
// tokens it owns in its KV cache) without sending K/V again.
using ShardVisitor = std::function<void(int64_t source, const at::Tensor& k, const at::Tensor& v)>;

// q, k: this rank's shards (B, S_local, H | Hkv, D) in layout order, v (B, S_local, Hkv, Dv).
// Returns this rank's out (B, S_local, H, Dv) (options.out_dtype, default q's dtype) and lse
// (B, H, S_local) fp32.
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

// The ring's steps against K/V shards already gathered on this rank: k_all (W, B, S_local, Hkv,
// D) and v_all (W, B, S_local, Hkv, Dv), every rank's k and v in rank order (views of one
// gathered buffer are fine: only the head dim must be contiguous), rank this rank's index. The
// backward returns dq and this rank's fp32 contributions to every shard's dK/dV, as one tensor
// (W, B, S_local, Hkv, D + Dv) (dK then dV along the head dim) to be reduce-scattered at once.
std::tuple<at::Tensor, at::Tensor> gathered_forward(const at::Tensor& q, const at::Tensor& k_all,
                                                    const at::Tensor& v_all, int64_t rank,
                                                    const RingOptions& options);
std::tuple<at::Tensor, at::Tensor> gathered_backward(const at::Tensor& dout, const at::Tensor& q,
                                                     const at::Tensor& k_all,
                                                     const at::Tensor& v_all, const at::Tensor& out,
                                                     const at::Tensor& lse,
                                                     const std::optional<at::Tensor>& dlse,
                                                     int64_t rank, const RingOptions& options);

struct RingStats {
  double compute_s = 0;  // computing and merging sub-problems
  double wait_s = 0;     // blocked on shifts: communication that compute did not hide
};
// Where the time of the last ring_forward ([0]) and ring_backward ([1]) on this thread went.
const RingStats* last_ring_stats();

// The transport the ring ops use for tensors like q over the group `group_name`.
std::unique_ptr<comm::Transport> group_transport(const at::Tensor& q, c10::string_view group_name,
                                                 double timeout_s);

// Frees the ring's receive buffers and dK/dV accumulators kept between calls on CPU tensors
// (cpattn.release_buffers); returns their bytes.
int64_t release_buffers();

}  // namespace cpattn::ops
