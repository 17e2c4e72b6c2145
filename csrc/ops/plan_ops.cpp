// What the cost model (python/cpattn/plan) asks the library: the ring schedule's work per (rank,
// step), and the sizes the CPU backward chooses for a shape; and what the mask rule (mask.h) says
// per query position: how many keys it sees (the planner), which keys (the max-logits pass).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "cpattn/layout.h"
#include "cpattn/mask.h"
#include "cpattn/work.h"
#include "cpu/kernels.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/options.h"

namespace cpattn::ops {
namespace {

// (world, world, 3) int64: for each (rank, step) of the ring schedule, the visible pairs, the pairs
// in visited block_m x block_n tiles and the kernel calls (csrc/include/cpattn/work.h); per head
// and batch row. doc_lengths: packed documents (varlen) instead of one sequence of seqlen.
at::Tensor schedule_work(int64_t seqlen, int64_t world, int64_t layout, bool causal,
                         int64_t window_left, int64_t window_right, int64_t block_m,
                         int64_t block_n, const std::optional<at::Tensor>& doc_lengths) {
  TORCH_CHECK(layout >= 0 && layout <= 2,
              "cpattn.schedule_work: layout code must be 0, 1 or 2, "
              "got ",
              layout);
  TORCH_CHECK(world >= 1, "cpattn.schedule_work: world must be >= 1, got ", world);
  TORCH_CHECK(block_m >= 1 && block_n >= 1,
              "cpattn.schedule_work: block sizes must be >= 1, "
              "got ",
              block_m, " x ", block_n);
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "cpattn.schedule_work: window must be "
              ">= -1, got (",
              window_left, ", ", window_right, ")");
  const Layout l = static_cast<Layout>(layout);
  std::vector<int64_t> docs;
  if (doc_lengths && doc_lengths->defined()) {
    const at::Tensor t = doc_lengths->to(at::kLong).cpu().contiguous();
    docs.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
    for (int64_t n : docs)
      TORCH_CHECK(n >= 0, "cpattn.schedule_work: document lengths must be >= 0, got ", n);
  } else {
    TORCH_CHECK(seqlen > 0 && seqlen % layout_granularity(l, world) == 0,
                "cpattn.schedule_work: seqlen (", seqlen, ") must be a positive multiple of ",
                layout_granularity(l, world), " for this layout over ", world, " ranks");
  }
  Mask global;
  global.causal = causal;
  global.window_left = window_left;
  global.window_right = window_right;
  at::Tensor out = at::zeros({world, world, 3}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t rank = 0; rank < world; ++rank)
    for (int64_t step = 0; step < world; ++step) {
      const Work w =
          step_work(l, seqlen, docs.data(), static_cast<int64_t>(docs.size()), world, rank, step,
                    global, static_cast<int>(block_m), static_cast<int>(block_n));
      int64_t* cell = p + (rank * world + step) * 3;
      cell[0] = w.pairs;
      cell[1] = w.tile_pairs;
      cell[2] = w.calls;
    }
  return out;
}

// (N,) int64: how many keys of a document of num_keys tokens each query at positions (N,) int64
// (positions within the document) sees, by the mask rule of cpattn/mask.h.
at::Tensor visible_keys(const at::Tensor& positions, int64_t num_keys, bool causal,
                        int64_t window_left, int64_t window_right, int64_t prefix_len) {
  TORCH_CHECK(positions.dim() == 1 && positions.device().is_cpu(),
              "cpattn.visible_keys: positions must be a 1-D CPU tensor, got ", positions.sizes(),
              " on ", positions.device());
  TORCH_CHECK(window_left >= -1 && window_right >= -1 && prefix_len >= 0 && num_keys >= 0,
              "cpattn.visible_keys: window sides must be >= -1 and prefix_len, num_keys >= 0");
  const Mask m = global_mask(AttentionOptions{.causal = causal,
                                              .window_left = window_left,
                                              .window_right = window_right,
                                              .prefix_len = prefix_len});
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  at::Tensor count = at::empty({pos.size(0)}, at::kLong);
  const int64_t* p = pos.data_ptr<int64_t>();
  int64_t* c = count.data_ptr<int64_t>();
  for (int64_t r = 0; r < pos.size(0); ++r) c[r] = m.visible_key_count(p[r], num_keys);
  return count;
}

// (N, 3) int64: for each query at positions (N,) int64 (-1: padding), the keys it sees by the mask
// rule of cpattn/mask.h, as [first, last, prefix_end]: the key positions in [first, last] (its
// causal / window interval) and those below prefix_end (the prefix). Unbounded ends are
// +-kUnbounded; a padding query sees nothing (first > last, prefix_end = -kUnbounded).
at::Tensor visible_key_ranges(const at::Tensor& positions, bool causal, int64_t window_left,
                              int64_t window_right, int64_t prefix_len) {
  TORCH_CHECK(
      positions.dim() == 1 && positions.device().is_cpu() && positions.scalar_type() == at::kLong,
      "cpattn.visible_key_ranges: positions must be a 1-D int64 CPU tensor, got ",
      positions.sizes(), " ", positions.scalar_type(), " on ", positions.device());
  TORCH_CHECK(window_left >= -1 && window_right >= -1,
              "cpattn.visible_key_ranges: window sides must be >= -1 (-1: unbounded), got (",
              window_left, ", ", window_right, ")");
  check_prefix_len("visible_key_ranges", prefix_len);
  const Mask m = global_mask(AttentionOptions{.causal = causal,
                                              .window_left = window_left,
                                              .window_right = window_right,
                                              .prefix_len = prefix_len});
  const at::Tensor pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t n = pos.size(0);
  at::Tensor ranges = at::empty({n, 3}, at::kLong);
  int64_t* out = ranges.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r, out += 3) {
    TORCH_CHECK(p[r] >= -1 && p[r] <= kMaxPosition,
                "cpattn.visible_key_ranges: positions must be -1 (padding) or in [0, ",
                kMaxPosition, "], got ", p[r], " at index ", r);
    if (p[r] < 0) {  // padding: an empty interval and no prefix
      out[0] = kUnbounded;
      out[1] = -kUnbounded;
      out[2] = -kUnbounded;
      continue;
    }
    out[0] = m.first_key(p[r]);
    out[1] = m.last_key(p[r]);
    out[2] = m.prefix_end;
  }
  return ranges;
}

// [KV heads per kernel call, key splits, query rows per band] of the CPU backward over
// contiguous q, k, v and dout in `input_dtype` with gradients in `grad_dtype`, as the backward
// decides them (attention_cpu.cpp, under the byte budget the process runs with; the kernels of
// the instruction set it runs with, for one call's heads).
// One kernel call of the CPU backward over a shape in input_dtype with gradients in grad_dtype:
// its KV heads and how it cuts its work (kernels.h BackwardBands, with its buffers' bytes).
struct BackwardCall {
  int64_t kv_heads;
  cpu::BackwardBands bands;
};
BackwardCall cpu_backward_call(const char* fn, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                               int64_t heads, int64_t kv_heads, int64_t head_dim,
                               at::ScalarType input_dtype, at::ScalarType grad_dtype) {
  TORCH_CHECK(batch > 0 && seqlen_q > 0 && seqlen_k > 0 && head_dim > 0, "cpattn.", fn,
              ": batch, seqlen_q, seqlen_k and head_dim must be > 0, got ", batch, ", ", seqlen_q,
              ", ", seqlen_k, " and ", head_dim);
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0, "cpattn.", fn,
              ": heads must be a positive multiple of kv_heads, got ", heads, " and ", kv_heads);
  TORCH_CHECK(is_float_type(input_dtype) && is_float_type(grad_dtype), "cpattn.", fn,
              ": input_dtype and grad_dtype must be float32, bfloat16 or float16, got ",
              input_dtype, " and ", grad_dtype);
  AttnShape s;  // as check_qkv makes it
  s.batch = batch;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.head_dim = s.head_dim_v = head_dim;
  s.head_dim_padded = s.head_dim_v_padded = (head_dim + 15) / 16 * 16;
  // operands without data: their dtypes and strides are all the grouping reads
  const auto meta = at::TensorOptions().device(at::kMeta).dtype(input_dtype);
  const at::Tensor q = at::empty({batch, seqlen_q, heads, head_dim}, meta);
  const at::Tensor kv = at::empty({batch, seqlen_k, kv_heads, head_dim}, meta);
  const int64_t kv_per_call = cpu_backward_kv_heads_per_call(q, kv, kv, q, s, grad_dtype);
  AttnShape call = s;
  call.kv_heads = kv_per_call;
  call.heads = kv_per_call * s.group_size();
  return {kv_per_call,
          cpu::backward_bands(call, cpu_backward_takes_bf16(q, q) ? 2 : 4, to_dtype(grad_dtype))};
}

std::vector<int64_t> cpu_backward_sizes(int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                        int64_t heads, int64_t kv_heads, int64_t head_dim,
                                        at::ScalarType input_dtype, at::ScalarType grad_dtype) {
  const BackwardCall c = cpu_backward_call("cpu_backward_sizes", batch, seqlen_q, seqlen_k, heads,
                                           kv_heads, head_dim, input_dtype, grad_dtype);
  return {c.kv_heads, c.bands.key_splits, c.bands.band_rows};
}

// The bytes of the buffers one such call allocates beyond its tensors, all threads together
// (attention_kernel.h backward_buffer_bytes: the allocations' own sizes).
int64_t cpu_backward_buffer_bytes(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, at::ScalarType input_dtype,
                                  at::ScalarType grad_dtype) {
  return cpu_backward_call("cpu_backward_buffer_bytes", batch, seqlen_q, seqlen_k, heads, kv_heads,
                           head_dim, input_dtype, grad_dtype)
      .bands.buffer_bytes;
}

}  // namespace
}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("schedule_work", &cpattn::ops::schedule_work);
  m.impl("cpu_backward_sizes", &cpattn::ops::cpu_backward_sizes);
  m.impl("cpu_backward_buffer_bytes", &cpattn::ops::cpu_backward_buffer_bytes);
  m.impl("visible_keys", &cpattn::ops::visible_keys);
  m.impl("visible_key_ranges", &cpattn::ops::visible_key_ranges);
}
