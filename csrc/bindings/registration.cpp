// Op schemas (one place) and their CPU / CUDA implementations.
#include <torch/library.h>

#include "ops/ops.h"

TORCH_LIBRARY(cpattn, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
      "int window_left, int window_right, int q_offset, int k_offset, "
      "ScalarType? out_dtype=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "float softmax_scale, bool causal, int window_left, int window_right, int q_offset, "
      "int k_offset, ScalarType? grad_dtype=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("merge_state_(Tensor(a!) out, Tensor(b!) lse, Tensor part_out, Tensor part_lse) -> ()");
}

TORCH_LIBRARY_IMPL(cpattn, CPU, m) {
  m.impl("attention_fwd", &cpattn::ops::attention_fwd);
  m.impl("attention_bwd", &cpattn::ops::attention_bwd);
  m.impl("merge_state_", &cpattn::ops::merge_state_);
}

#ifdef CPATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(cpattn, CUDA, m) { m.impl("merge_state_", &cpattn::ops::merge_state_cuda_); }
#endif
