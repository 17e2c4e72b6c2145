// The ring ops over a torch process group (and their all-gathered variant): op arguments ->
// RingOptions, a transport for the group, the driver (ring.cpp). Also the ops on layouts and the
// ring's timing that take no tensor.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "comm/transport.h"
#include "cpattn/env.h"
#include "cpattn/layout.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ring.h"

namespace cpattn::ops {

// CUDA tensors shift over cpattn's own NCCL communicator (CPATTN_RING_TRANSPORT=c10d: through the
// process group instead); CPU tensors through the process group.
std::unique_ptr<comm::Transport> group_transport([[maybe_unused]] const at::Tensor& q,
                                                 c10::string_view group_name, double timeout_s) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
#ifdef CPATTN_WITH_CUDA
  if (q.is_cuda() && !env::ring_transport_c10d())
    return comm::make_nccl_transport(std::string(group_name), q.device(), timeout);
#endif
  return comm::make_process_group_transport(std::string(group_name), timeout);
}

namespace {

std::tuple<at::Tensor, at::Tensor> ring_fwd(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, c10::string_view group_name,
                                            int64_t layout, double timeout_s,
                                            const std::optional<at::Tensor>& doc_lengths,
                                            const std::optional<at::Tensor>& doc_prefix_lens,
                                            const std::optional<at::Tensor>& sinks,
                                            CPATTN_OPTION_PARAMS) {
  auto transport = group_transport(q, group_name, timeout_s);
  auto result =
      ring_forward(q, k, v, *transport,
                   make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, sinks));
  transport->finish();
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name, int64_t layout,
    double timeout_s, const std::optional<at::Tensor>& doc_lengths,
    const std::optional<at::Tensor>& doc_prefix_lens, const std::optional<at::Tensor>& dlse,
    CPATTN_OPTION_PARAMS) {
  auto transport = group_transport(q, group_name, timeout_s);
  auto result = ring_backward(
      dout, q, k, v, out, lse, dlse, *transport,
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, std::nullopt));
  transport->finish();
  return result;
}

std::tuple<at::Tensor, at::Tensor> gathered_fwd(const at::Tensor& q, const at::Tensor& k_all,
                                                const at::Tensor& v_all, int64_t rank,
                                                int64_t layout,
                                                const std::optional<at::Tensor>& doc_lengths,
                                                const std::optional<at::Tensor>& doc_prefix_lens,
                                                const std::optional<at::Tensor>& sinks,
                                                CPATTN_OPTION_PARAMS) {
  return gathered_forward(
      q, k_all, v_all, rank,
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, sinks));
}

std::tuple<at::Tensor, at::Tensor> gathered_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all,
    const at::Tensor& out, const at::Tensor& lse, int64_t rank, int64_t layout,
    const std::optional<at::Tensor>& doc_lengths, const std::optional<at::Tensor>& doc_prefix_lens,
    const std::optional<at::Tensor>& dlse, CPATTN_OPTION_PARAMS) {
  return gathered_backward(
      dout, q, k_all, v_all, out, lse, dlse, rank,
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, std::nullopt));
}

// Attention over packed documents held whole by this process (cpattn.attention_varlen): the
// gathered steps over one rank, whose one shard is the whole sequence (contiguous layout: no
// padding), k and v as they are.
std::tuple<at::Tensor, at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& doc_lengths,
                                              const std::optional<at::Tensor>& doc_prefix_lens,
                                              const std::optional<at::Tensor>& sinks,
                                              CPATTN_OPTION_PARAMS) {
  return gathered_forward(
      q, k.unsqueeze(0), v.unsqueeze(0), 0,
      make_ring_options(CPATTN_OPTIONS, static_cast<int64_t>(Layout::kContiguous), doc_lengths,
                        doc_prefix_lens, sinks));
}

// Its backward: dq, dk, dv in the inputs' dtypes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& doc_lengths,
    const std::optional<at::Tensor>& doc_prefix_lens, const std::optional<at::Tensor>& dlse,
    CPATTN_OPTION_PARAMS) {
  auto [dq, dkv] =
      gathered_backward(dout, q, k.unsqueeze(0), v.unsqueeze(0), out, lse, dlse, 0,
                        make_ring_options(CPATTN_OPTIONS, static_cast<int64_t>(Layout::kContiguous),
                                          doc_lengths, doc_prefix_lens, std::nullopt));
  const int64_t d = k.size(3);
  return {dq, dkv[0].narrow(-1, 0, d).to(k.scalar_type()).contiguous(),
          dkv[0].narrow(-1, d, dkv.size(-1) - d).to(v.scalar_type()).contiguous()};
}

// float64 (fwd compute, fwd wait, bwd compute, bwd wait) of the last ring calls on this thread.
at::Tensor ring_stats() {
  const RingStats* s = last_ring_stats();
  return at::tensor({s[0].compute_s, s[0].wait_s, s[1].compute_s, s[1].wait_s}, at::kDouble);
}

// Destroys the NCCL communicators the CUDA ring cached (one per process group and device);
// returns how many (0 in a CPU build).
int64_t destroy_communicators() {
#ifdef CPATTN_WITH_CUDA
  return comm::destroy_nccl_communicators();
#else
  return 0;
#endif
}

// Global positions (int64) of the local tokens of `rank`.
at::Tensor layout_positions(int64_t seqlen, int64_t world, int64_t rank, int64_t layout) {
  const Layout l = checked_layout(layout);
  check_rank(rank, world);
  const int64_t g = layout_granularity(l, world);
  TORCH_CHECK(seqlen > 0 && seqlen % g == 0, "cpattn: the global sequence length (", seqlen,
              ") must be a positive multiple of ", g, " for the ",
              l == Layout::kZigzag ? "zigzag" : (l == Layout::kStriped ? "striped" : "contiguous"),
              " layout over ", world, " ranks");
  const int64_t local = seqlen / world;
  at::Tensor pos = at::empty({local}, at::kLong);
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < local; ++i) p[i] = global_position(l, seqlen, world, rank, i);
  return pos;
}

// (D, 3) int64: each document's padded length, its start in the padded packed sequence and in
// every rank's shard (cpattn/layout.h document_shard, the one home of the rule).
at::Tensor document_shards(at::IntArrayRef lengths, int64_t world, int64_t layout) {
  const Layout l = checked_layout(layout);
  TORCH_CHECK(world >= 1, "cpattn: world must be >= 1, got ", world);
  const int64_t docs = static_cast<int64_t>(lengths.size());
  at::Tensor result = at::empty({docs, 3}, at::kLong);
  int64_t* row = result.data_ptr<int64_t>();
  int64_t global_begin = 0;
  for (int64_t d = 0; d < docs; ++d, row += 3) {
    TORCH_CHECK(lengths[d] >= 0, "cpattn: document lengths must be >= 0, got ", lengths[d]);
    const DocumentShard doc = document_shard(l, lengths[d], world, 0, global_begin);
    row[0] = doc.padded;
    row[1] = doc.global_begin;
    row[2] = doc.local_begin;
    global_begin += doc.padded;
  }
  return result;
}

double group_timeout(c10::string_view group_name) {
  return comm::group_timeout_seconds(std::string(group_name));
}

}  // namespace

void impl_ring_ops(torch::Library& m) {
  m.impl("ring_fwd", &ring_fwd);
  m.impl("ring_bwd", &ring_bwd);
  m.impl("gathered_fwd", &gathered_fwd);
  m.impl("gathered_bwd", &gathered_bwd);
  m.impl("attention_varlen_fwd", &varlen_fwd);
  m.impl("attention_varlen_bwd", &varlen_bwd);
}

}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("layout_positions", &cpattn::ops::layout_positions);
  m.impl("document_shards", &cpattn::ops::document_shards);
  m.impl("ring_stats", &cpattn::ops::ring_stats);
  m.impl("destroy_communicators", &cpattn::ops::destroy_communicators);
  m.impl("release_buffers", &cpattn::ops::release_buffers);
  m.impl("group_timeout", &cpattn::ops::group_timeout);
}
