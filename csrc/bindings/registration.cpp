// Op schemas (one place) and their CPU / CUDA implementations.
#include <torch/library.h>

#include "ops/ops.h"
#include "ops/ring.h"

TORCH_LIBRARY(cpattn, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "int window_left, int window_right, int q_offset, int k_offset, "
      "ScalarType? out_dtype=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, int window_left, int window_right, int q_offset, "
      "int k_offset, ScalarType? grad_dtype=None, Tensor? dlse=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("merge_state_(Tensor(a!) out, Tensor(b!) lse, Tensor part_out, Tensor part_lse) -> ()");
  // Ring attention over the process group registered as group_name; layout: 0 contiguous,
  // 1 zigzag, 2 striped.
  m.def(
      "ring_fwd(Tensor q, Tensor k, Tensor v, str group_name, float softmax_scale, bool causal, "
      "int window_left, int window_right, int layout, float timeout_s) -> (Tensor out, Tensor lse)");
  m.def(
      "ring_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, str group_name, "
      "float softmax_scale, bool causal, int window_left, int window_right, int layout, "
      "float timeout_s, Tensor? dlse=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // The same driver over W ranks emulated in this process (one list entry per rank).
  m.def(
      "ring_fwd_emulated(Tensor[] q, Tensor[] k, Tensor[] v, float softmax_scale, bool causal, "
      "int window_left, int window_right, int layout) -> (Tensor[] out, Tensor[] lse)");
  m.def(
      "ring_bwd_emulated(Tensor[] dout, Tensor[] q, Tensor[] k, Tensor[] v, Tensor[] out, "
      "Tensor[] lse, float softmax_scale, bool causal, int window_left, int window_right, "
      "int layout) -> (Tensor[] dq, Tensor[] dk, Tensor[] dv)");
  m.def("layout_positions(int seqlen, int world, int rank, int layout) -> Tensor");
  m.def("ring_stats() -> Tensor");
  m.def("destroy_communicators() -> int");
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
  m.impl("ring_fwd", &cpattn::ops::ring_fwd);
  m.impl("ring_bwd", &cpattn::ops::ring_bwd);
  m.impl("ring_fwd_emulated", &cpattn::ops::ring_fwd_emulated);
  m.impl("ring_bwd_emulated", &cpattn::ops::ring_bwd_emulated);
  m.impl("ring_loopback_timing", &cpattn::ops::ring_loopback_timing);
  m.impl("ring_shift", &cpattn::ops::ring_shift);
}

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("layout_positions", &cpattn::ops::layout_positions);
  m.impl("ring_stats", &cpattn::ops::ring_stats);
  m.impl("destroy_communicators", &cpattn::ops::destroy_communicators);
}

#ifdef CPATTN_WITH_CUDA
// The attention and ring functions route CUDA tensors to the CUDA kernels and transports.
TORCH_LIBRARY_IMPL(cpattn, CUDA, m) {
  m.impl("attention_fwd", &cpattn::ops::attention_fwd);
  m.impl("attention_bwd", &cpattn::ops::attention_bwd);
  m.impl("merge_state_", &cpattn::ops::merge_state_cuda_);
  m.impl("ring_fwd", &cpattn::ops::ring_fwd);
  m.impl("ring_bwd", &cpattn::ops::ring_bwd);
  m.impl("ring_fwd_emulated", &cpattn::ops::ring_fwd_emulated);
  m.impl("ring_bwd_emulated", &cpattn::ops::ring_bwd_emulated);
  m.impl("ring_loopback_timing", &cpattn::ops::ring_loopback_timing);
  m.impl("ring_shift", &cpattn::ops::ring_shift);
}
#endif
