// Op schemas (one place) and their CPU / CUDA implementations.
#include <torch/library.h>

#include "ops/inference.h"
#include "ops/ops.h"
#include "ops/ring.h"

TORCH_LIBRARY(cpattn, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "int window_left, int window_right, int q_offset, int k_offset, "
      "ScalarType? out_dtype=None, float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? sinks=None, int prefix_len=0) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, int window_left, int window_right, int q_offset, "
      "int k_offset, ScalarType? grad_dtype=None, Tensor? dlse=None, float softcap=0., "
      "Tensor? alibi_slopes=None, int prefix_len=0) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Attention sinks (softmax_state.h add_sink): added once to merged results, and their gradient.
  m.def("apply_sinks_(Tensor(a!) out, Tensor(b!) lse, Tensor sinks) -> ()");
  m.def("sink_bwd(Tensor dout, Tensor out, Tensor lse, Tensor sinks, Tensor? dlse=None) -> Tensor");
  m.def("merge_state_(Tensor(a!) out, Tensor(b!) lse, Tensor part_out, Tensor part_lse) -> ()");
  // Ring attention over the process group registered as group_name; layout: 0 contiguous,
  // 1 zigzag, 2 striped.
  m.def(
      "ring_fwd(Tensor q, Tensor k, Tensor v, str group_name, float softmax_scale, bool causal, "
      "int window_left, int window_right, int layout, float timeout_s, Tensor? doc_lengths=None, "
      "float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, int prefix_len=0) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "ring_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, str group_name, "
      "float softmax_scale, bool causal, int window_left, int window_right, int layout, "
      "float timeout_s, Tensor? dlse=None, Tensor? doc_lengths=None, float softcap=0., "
      "Tensor? alibi_slopes=None, int prefix_len=0) -> (Tensor dq, Tensor dk, Tensor dv)");
  // The same steps against K/V already all-gathered: kv_all (W, 2, B, S_local, Hkv, D).
  m.def(
      "gathered_fwd(Tensor q, Tensor kv_all, int rank, float softmax_scale, bool causal, "
      "int window_left, int window_right, int layout, Tensor? doc_lengths=None, "
      "float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, int prefix_len=0) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "gathered_bwd(Tensor dout, Tensor q, Tensor kv_all, Tensor out, Tensor lse, int rank, "
      "float softmax_scale, bool causal, int window_left, int window_right, int layout, "
      "Tensor? doc_lengths=None, Tensor? dlse=None, float softcap=0., Tensor? alibi_slopes=None, "
      "int prefix_len=0) -> (Tensor dq, Tensor dkv_all)");
  // The same driver over W ranks emulated in this process (one list entry per rank).
  m.def(
      "ring_fwd_emulated(Tensor[] q, Tensor[] k, Tensor[] v, float softmax_scale, bool causal, "
      "int window_left, int window_right, int layout) -> (Tensor[] out, Tensor[] lse)");
  m.def(
      "ring_bwd_emulated(Tensor[] dout, Tensor[] q, Tensor[] k, Tensor[] v, Tensor[] out, "
      "Tensor[] lse, float softmax_scale, bool causal, int window_left, int window_right, "
      "int layout) -> (Tensor[] dq, Tensor[] dk, Tensor[] dv)");
  m.def("layout_positions(int seqlen, int world, int rank, int layout) -> Tensor");
  // The cost model's view of the schedule: (world, world, 3) work per (rank, step).
  m.def(
      "schedule_work(int seqlen, int world, int layout, bool causal, int window_left, "
      "int window_right, int block_m, int block_n, Tensor? doc_lengths=None) -> Tensor");
  m.def("ring_stats() -> Tensor");
  m.def("destroy_communicators() -> int");
  m.def("release_buffers() -> int");
  // Test of the ring transport: one shift of `send` over the group (NCCL for CUDA tensors).
  m.def("ring_shift(Tensor send, str group_name, float timeout_s) -> Tensor");
  // Benchmark only: (forward s, backward s) of one rank's ring work without communication.
  m.def(
      "ring_loopback_timing(Tensor q, Tensor k, Tensor v, Tensor dout, int rank, int world, "
      "float softmax_scale, bool causal, int window_left, int window_right, int layout) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpattn, CPU, m) {
  m.impl("attention_fwd", &cpattn::ops::attention_fwd);
  m.impl("attention_bwd", &cpattn::ops::attention_bwd);
  m.impl("merge_state_", &cpattn::ops::merge_state_);
  m.impl("apply_sinks_", &cpattn::ops::apply_sinks_);
  m.impl("sink_bwd", &cpattn::ops::sink_bwd);
  m.impl("ring_fwd", &cpattn::ops::ring_fwd);
  m.impl("ring_bwd", &cpattn::ops::ring_bwd);
  m.impl("gathered_fwd", &cpattn::ops::gathered_fwd);
  m.impl("gathered_bwd", &cpattn::ops::gathered_bwd);
  m.impl("ring_fwd_emulated", &cpattn::ops::ring_fwd_emulated);
  m.impl("ring_bwd_emulated", &cpattn::ops::ring_bwd_emulated);
  m.impl("ring_loopback_timing", &cpattn::ops::ring_loopback_timing);
  m.impl("ring_shift", &cpattn::ops::ring_shift);
}

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("layout_positions", &cpattn::ops::layout_positions);
  m.impl("schedule_work", &cpattn::ops::schedule_work);
  m.impl("ring_stats", &cpattn::ops::ring_stats);
  m.impl("destroy_communicators", &cpattn::ops::destroy_communicators);
  m.impl("release_buffers", &cpattn::ops::release_buffers);
}

#ifdef CPATTN_WITH_CUDA
// The attention and ring functions route CUDA tensors to the CUDA kernels and transports.
TORCH_LIBRARY_IMPL(cpattn, CUDA, m) {
  m.impl("attention_fwd", &cpattn::ops::attention_fwd);
  m.impl("attention_bwd", &cpattn::ops::attention_bwd);
  m.impl("merge_state_", &cpattn::ops::merge_state_cuda_);
  m.impl("ring_fwd", &cpattn::ops::ring_fwd);
  m.impl("ring_bwd", &cpattn::ops::ring_bwd);
  m.impl("gathered_fwd", &cpattn::ops::gathered_fwd);
  m.impl("gathered_bwd", &cpattn::ops::gathered_bwd);
  m.impl("ring_fwd_emulated", &cpattn::ops::ring_fwd_emulated);
  m.impl("ring_bwd_emulated", &cpattn::ops::ring_bwd_emulated);
  m.impl("ring_loopback_timing", &cpattn::ops::ring_loopback_timing);
  m.impl("ring_shift", &cpattn::ops::ring_shift);
}
#endif

// Inference over a KV cache sharded across ranks (ops/inference.h).
TORCH_LIBRARY_FRAGMENT(cpattn, m) {
  m.def(
      "merge_attention_states(Tensor outs, Tensor lses, ScalarType? out_dtype=None) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "merge_attention_states_bwd(Tensor dout, Tensor? dlse, Tensor outs, Tensor lses, "
      "Tensor lse) -> (Tensor douts, Tensor dlses)");
  m.def(
      "cache_store_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor start, "
      "int rank, int world, int interleave) -> ()");
  m.def(
      "cache_attention_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, "
      "Tensor q_start, int rank, int world, int interleave, float softmax_scale, bool causal, "
      "ScalarType? out_dtype=None) -> (Tensor out, Tensor lse)");
  m.def(
      "prefill_fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor cache_lens, str group_name, float softmax_scale, int layout, int interleave, "
      "float timeout_s) -> (Tensor out, Tensor lse)");
  m.def("cache_local_count(int n, int rank, int world, int interleave) -> int");
  m.def("cache_positions(int n, int rank, int world, int interleave) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpattn, CPU, m) {
  m.impl("merge_attention_states", &cpattn::ops::merge_attention_states);
  m.impl("merge_attention_states_bwd", &cpattn::ops::merge_attention_states_bwd);
  m.impl("cache_store_", &cpattn::ops::cache_store_);
  m.impl("cache_attention_fwd", &cpattn::ops::cache_attention_fwd);
  m.impl("prefill_fwd", &cpattn::ops::prefill_fwd);
}

#ifdef CPATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(cpattn, CUDA, m) {
  m.impl("merge_attention_states", &cpattn::ops::merge_attention_states);
  m.impl("merge_attention_states_bwd", &cpattn::ops::merge_attention_states_bwd);
  m.impl("cache_store_", &cpattn::ops::cache_store_);
  m.impl("cache_attention_fwd", &cpattn::ops::cache_attention_fwd);
  m.impl("prefill_fwd", &cpattn::ops::prefill_fwd);
}
#endif

TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("cache_local_count", &cpattn::ops::cache_local_count);
  m.impl("cache_positions", &cpattn::ops::cache_positions);
}
