// Inference over a KV cache sharded across ranks (cpattn/kv_cache.h): storing tokens on their
// owners, attention of queries over one rank's shard, the N-way merge of partial results, and
// prefill of a prompt chunk over a process group.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace cpattn::ops {

// Merges N partial results over disjoint key sets: outs (N, B, S, H, D) any float dtype, lses
// (N, B, H, S) float32. Returns out (B, S, H, D) in out_dtype (default outs' dtype), computed in
// fp32, and lse (B, H, S) float32. Rows empty in every part stay (0, -inf).
std::tuple<at::Tensor, at::Tensor> merge_attention_states(const at::Tensor& outs,
                                                          const at::Tensor& lses,
                                                          std::optional<at::ScalarType> out_dtype);
// Gradients of outs and lses from dout (and dlse, if any), given the merged lse.
std::tuple<at::Tensor, at::Tensor> merge_attention_states_bwd(
    const at::Tensor& dout, const std::optional<at::Tensor>& dlse, const at::Tensor& outs,
    const at::Tensor& lses, const at::Tensor& lse);

// Token l of sequence b of (k, v) (B, L, Hkv, D), at global position start[b] + l, is written to
// (k_cache, v_cache) (B, slots, Hkv, D) when `rank` owns it. start: int64 (B,).
void cache_store_(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& start, int64_t rank, int64_t world,
                  int64_t interleave);

// Partial attention of q (B, Sq, H, D), query row i of sequence b at position q_start[b] + i,
// over the keys of positions [0, cache_lens[b]) that `rank` stores. Returns out (out_dtype,
// default q's) and lse (B, H, Sq) fp32; a row that sees no key here is (0, -inf). Score options
// (ops.h) on global positions: softcap, alibi_slopes (H,), keys below prefix_len seen by all.
std::tuple<at::Tensor, at::Tensor> cache_attention_fwd(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_lens, const at::Tensor& q_start, int64_t rank, int64_t world,
    int64_t interleave, double softmax_scale, bool causal, std::optional<at::ScalarType> out_dtype,
    double softcap = 0.0, const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
    int64_t prefix_len = 0);

// Causal ring attention of a prompt chunk sharded over the group in `layout` (q, k, v as for
// ring_fwd), which also stores each chunk token in its owner's cache at position
// cache_lens[b] + (its position in the chunk). Attention to earlier cached tokens is not included.
// Returns out in float32 and lse. Score options as ring_fwd, on positions within the chunk
// (prefix_len: the prefix's end relative to the chunk's first token). seqlen > 0: the chunk's
// real length, the shards padded at its end (padding rows 0 / -inf, padding never stored).
std::tuple<at::Tensor, at::Tensor> prefill_fwd(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache,
                                               const at::Tensor& cache_lens,
                                               c10::string_view group_name, double softmax_scale,
                                               int64_t layout, int64_t interleave,
                                               double timeout_s, double softcap = 0.0,
                                               const std::optional<at::Tensor>& alibi_slopes =
                                                   std::nullopt,
                                               int64_t prefix_len = 0, int64_t seqlen = 0);

// Slots `rank` uses for the tokens of positions [0, n), and their global positions.
int64_t cache_local_count(int64_t n, int64_t rank, int64_t world, int64_t interleave);
at::Tensor cache_positions(int64_t n, int64_t rank, int64_t world, int64_t interleave);

}  // namespace cpattn::ops
