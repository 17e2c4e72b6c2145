// Inference over a KV cache sharded across ranks (cpattn/kv_cache.h): storing tokens on their
// owners, attention of queries over one rank's shard, the N-way merge of partial results, and
// prefill of a prompt chunk over a process group.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "comm/transport.h"
#include "cpattn/kv_cache.h"
#include "cpattn/layout.h"
#include "cpattn/softmax_state.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/options.h"
#include "ops/ring.h"

namespace cpattn::ops {
namespace {

CacheSharding checked_sharding(int64_t rank, int64_t world, int64_t interleave) {
  check_rank(rank, world);
  TORCH_CHECK(interleave >= 1, "cpattn: interleave must be >= 1, got ", interleave);
  return {world, interleave};
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4,
              "cpattn: k_cache must be (batch, slots, kv_heads, head_dim), got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "cpattn: v_cache must have k_cache's shape ",
              k_cache.sizes(), ", got ", v_cache.sizes());
  TORCH_CHECK(
      is_float_type(k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
      "cpattn: k_cache and v_cache must have one dtype, float32, bfloat16 or float16, got ",
      k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(v_cache.device() == k_cache.device(),
              "cpattn: k_cache and v_cache must be on one "
              "device, got ",
              k_cache.device(), " and ", v_cache.device());
  backend_for(k_cache.device());  // raises for a device without kernels in this build
}

// An int64 CPU tensor of shape (batch,), as a vector.
std::vector<int64_t> per_sequence(const at::Tensor& t, int64_t batch, const char* name) {
  TORCH_CHECK(
      t.dim() == 1 && t.size(0) == batch && t.scalar_type() == at::kLong && t.device().is_cpu(),
      "cpattn: ", name, " must be an int64 CPU tensor of shape (batch,) = (", batch, ",), got ",
      t.scalar_type(), " ", t.sizes(), " on ", t.device());
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  std::vector<int64_t> v(p, p + batch);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(v[b] >= 0, "cpattn: ", name, " must be >= 0, got ", v[b], " for sequence ", b);
  return v;
}

// New tokens (k, v) must match the cache in batch, heads, head_dim and dtype.
void check_tokens(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(),
              "cpattn: new k and v must be (batch, tokens, kv_heads, head_dim) of one shape, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(
      k.size(0) == k_cache.size(0) && k.size(2) == k_cache.size(2) && k.size(3) == k_cache.size(3),
      "cpattn: new k/v ", k.sizes(), " do not fit the cache ", k_cache.sizes(),
      " (batch, kv_heads and head_dim must match)");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "cpattn: new k/v must have the cache's dtype ", k_cache.scalar_type(), ", got ",
              k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(k.device() == k_cache.device() && v.device() == k_cache.device(),
              "cpattn: new k/v must be on the cache's device ", k_cache.device());
}

// Every rank runs this with the same lengths, so an overflow raises on every rank (not only on
// the owner of the token that would not fit).
void check_room(const CacheSharding& s, int64_t slots, const std::vector<int64_t>& start,
                int64_t tokens) {
  for (size_t b = 0; b < start.size(); ++b)
    TORCH_CHECK(s.count(0, start[b] + tokens) <= slots, "cpattn: KV cache overflow: sequence ", b,
                " would hold ", start[b] + tokens, " tokens but the cache shards have ", slots,
                " slots per rank, room for ", s.max_tokens(slots), " tokens per sequence");
}

// Writes token l of sequence b of (k, v) to its slot when `rank` owns position(b, l) (-1: a
// padding token, stored nowhere). One gather and one scatter for the whole batch; the indices
// are computed on the host and reach a GPU by one asynchronous copy from pinned memory, so
// storing never blocks the host on the device.
template <typename Position>
void store_owned(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                 const at::Tensor& v, const CacheSharding& s, int64_t rank, Position position) {
  std::vector<int64_t> seq, src, dst;
  for (int64_t b = 0; b < k.size(0); ++b)
    for (int64_t l = 0; l < k.size(1); ++l) {
      const int64_t t = position(b, l);
      if (t < 0 || s.owner(t) != rank) continue;
      seq.push_back(b);
      src.push_back(l);
      dst.push_back(s.slot(t));
    }
  if (seq.empty()) return;
  const int64_t n = static_cast<int64_t>(seq.size());
  at::Tensor index = at::empty({3, n}, at::kLong);
  int64_t* p = index.data_ptr<int64_t>();
  std::copy(seq.begin(), seq.end(), p);
  std::copy(src.begin(), src.end(), p + n);
  std::copy(dst.begin(), dst.end(), p + 2 * n);
  if (!k_cache.device().is_cpu()) {
    if (k_cache.is_cuda()) index = index.pin_memory();
    index = index.to(k_cache.device(), /*non_blocking=*/true);
  }
  const at::Tensor b_idx = index[0], src_idx = index[1], dst_idx = index[2];
  k_cache.index_put_({b_idx, dst_idx}, k.index({b_idx, src_idx}));
  v_cache.index_put_({b_idx, dst_idx}, v.index({b_idx, src_idx}));
}

// ---- N-way merge ------------------------------------------------------------------------------

// Merges N partial results over disjoint key sets: outs (N, B, S, H, D) any float dtype, lses
// (N, B, H, S) float32. Returns out (B, S, H, D) in out_dtype (default outs' dtype), computed in
// fp32, and lse (B, H, S) float32. Rows empty in every part stay (0, -inf).
std::tuple<at::Tensor, at::Tensor> merge_attention_states(const at::Tensor& outs,
                                                          const at::Tensor& lses,
                                                          std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(outs.dim() == 5,
              "cpattn: merge_attention_states outs must be (parts, batch, seqlen, "
              "heads, head_dim), got ",
              outs.sizes());
  const int64_t N = outs.size(0), B = outs.size(1), S = outs.size(2), H = outs.size(3),
                D = outs.size(4);
  TORCH_CHECK(N >= 1, "cpattn: merge_attention_states needs at least one part");
  const std::vector<int64_t> lse_shape{N, B, H, S};
  TORCH_CHECK(lses.sizes() == at::IntArrayRef(lse_shape),
              "cpattn: merge_attention_states lses must have shape (parts, batch, heads, seqlen) ",
              "= ", at::IntArrayRef(lse_shape), ", got ", lses.sizes());
  TORCH_CHECK(is_float_type(outs.scalar_type()),
              "cpattn: merge_attention_states outs must be float32, bfloat16 or float16, got ",
              outs.scalar_type());
  TORCH_CHECK(lses.scalar_type() == at::kFloat,
              "cpattn: merge_attention_states lses must be float32, got ", lses.scalar_type());
  TORCH_CHECK(lses.device() == outs.device(),
              "cpattn: merge_attention_states outs and lses must "
              "be on one device, got ",
              outs.device(), " and ", lses.device());
  const at::ScalarType dtype = out_dtype.value_or(outs.scalar_type());
  TORCH_CHECK(is_float_type(dtype), "cpattn: out_dtype must be float32, bfloat16 or float16, got ",
              dtype);
  if (!outs.device().is_cpu()) {  // the device's two-way merge, part by part: the same rule
    at::Tensor out = at::zeros({B, S, H, D}, outs.options().dtype(at::kFloat));
    at::Tensor lse = at::full({B, H, S}, -INFINITY, lses.options());
    for (int64_t n = 0; n < N; ++n) merge_into(out, lse, outs[n], lses[n]);
    return {out.to(dtype), lse};
  }

  const at::Tensor po = outs.to(at::kFloat).contiguous(), pl = lses.contiguous();
  at::Tensor out = at::empty({B, S, H, D}, outs.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({B, H, S}, lses.options());
  const float* po_ = po.data_ptr<float>();
  const float* pl_ = pl.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const int64_t rows = B * S * H;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> w(N);
    for (int64_t row = begin; row < end; ++row) {  // row = (b * S + s) * H + h
      const int64_t h = row % H, s = (row / H) % S, b = row / (H * S);
      const int64_t lse_at = (b * H + h) * S + s;
      l[lse_at] = merge_weights_n(pl_ + lse_at, N, rows, w.data());
      float* dst = o + row * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        if (w[n] == 0.f) continue;  // an empty part (its out is 0 anyway)
        const float* src = po_ + (n * rows + row) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += w[n] * src[d];
      }
    }
  });
  return {out.to(dtype), lse};
}

// out = sum_n w_n o_n with w_n = exp(lse_n - lse):
//   d o_n = w_n dout,  d lse_n = w_n (dout . o_n - dout . out + dlse).
// Gradients of outs and lses from dout (and dlse, if any), given the merged lse.
std::tuple<at::Tensor, at::Tensor> merge_attention_states_bwd(const at::Tensor& dout,
                                                              const std::optional<at::Tensor>& dlse,
                                                              const at::Tensor& outs,
                                                              const at::Tensor& lses,
                                                              const at::Tensor& lse) {
  const int64_t N = outs.size(0), B = outs.size(1), S = outs.size(2), H = outs.size(3),
                D = outs.size(4);
  TORCH_CHECK(dout.sizes() == outs.sizes().slice(1) && lse.sizes() == lses.sizes().slice(1),
              "cpattn: merge_attention_states_bwd: dout ", dout.sizes(), " and lse ", lse.sizes(),
              " must be one part of outs ", outs.sizes(), " and lses ", lses.sizes());
  const bool has_dlse = dlse && dlse->defined();
  if (has_dlse)
    TORCH_CHECK(dlse->sizes() == lse.sizes(), "cpattn: dlse must have lse's shape ", lse.sizes(),
                ", got ", dlse->sizes());
  if (!outs.device().is_cpu()) {  // no device kernel for this small backward: the CPU's, copied
    const auto cpu = [](const at::Tensor& t) { return t.cpu(); };
    auto [douts, dlses] = merge_attention_states_bwd(
        cpu(dout), has_dlse ? std::optional<at::Tensor>(cpu(*dlse)) : std::nullopt, cpu(outs),
        cpu(lses), cpu(lse));
    return {douts.to(outs.device()), dlses.to(outs.device())};
  }
  const at::Tensor po = outs.to(at::kFloat).contiguous(), pl = lses.contiguous();
  const at::Tensor g = dout.to(at::kFloat).contiguous(), lc = lse.contiguous();
  const at::Tensor gl = has_dlse ? dlse->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor douts = at::empty(po.sizes(), po.options());
  at::Tensor dlses = at::empty(pl.sizes(), pl.options());
  const float* po_ = po.data_ptr<float>();
  const float* pl_ = pl.data_ptr<float>();
  const float* g_ = g.data_ptr<float>();
  const float* l_ = lc.data_ptr<float>();
  const float* gl_ = has_dlse ? gl.data_ptr<float>() : nullptr;
  float* do_ = douts.data_ptr<float>();
  float* dl_ = dlses.data_ptr<float>();
  const int64_t rows = B * S * H;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> w(N), dots(N);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % H, s = (row / H) % S, b = row / (H * S);
      const int64_t lse_at = (b * H + h) * S + s;
      const float* grow = g_ + row * D;
      float dot_out = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        w[n] = merged_weight(pl_[n * rows + lse_at], l_[lse_at]);
        const float* src = po_ + (n * rows + row) * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += grow[d] * src[d];
        dots[n] = dot;
        dot_out += w[n] * dot;
      }
      const float extra = has_dlse ? gl_[lse_at] : 0.f;
      for (int64_t n = 0; n < N; ++n) {
        float* dst = do_ + (n * rows + row) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = w[n] * grow[d];
        dl_[n * rows + lse_at] = w[n] == 0.f ? 0.f : w[n] * (dots[n] - dot_out + extra);
      }
    }
  });
  return {douts.to(outs.scalar_type()), dlses};
}

// ---- the cache ----------------------------------------------------------------------------------

// Token l of sequence b of (k, v) (B, L, Hkv, D), at global position start[b] + l, is written to
// (k_cache, v_cache) (B, slots, Hkv, D) when `rank` owns it. start: int64 (B,).
void cache_store_(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& start, int64_t rank, int64_t world,
                  int64_t interleave) {
  const CacheSharding s = checked_sharding(rank, world, interleave);
  check_cache(k_cache, v_cache);
  check_tokens(k, v, k_cache);
  const std::vector<int64_t> first = per_sequence(start, k_cache.size(0), "start");
  check_room(s, k_cache.size(1), first, k.size(1));
  store_owned(k_cache, v_cache, k, v, s, rank, [&](int64_t b, int64_t l) { return first[b] + l; });
}

// Partial attention of q (B, Sq, H, D), query row i of sequence b at position q_start[b] + i,
// over the keys of positions [0, cache_lens[b]) that `rank` stores. Returns out (out_dtype,
// default q's) and lse (B, H, Sq) fp32; a row that sees no key here is (0, -inf). Score options
// (ops.h) on global positions: softcap, alibi_slopes (H,), keys below prefix_len seen by all, and
// the sliding window (mask.h) with the causal rule.
std::tuple<at::Tensor, at::Tensor> cache_attention_fwd(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_lens, const at::Tensor& q_start, int64_t rank, int64_t world,
    int64_t interleave, std::optional<at::ScalarType> out_dtype, CPATTN_OPTION_PARAMS) {
  const CacheSharding s = checked_sharding(rank, world, interleave);
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == k_cache.size(0) && q.size(3) == k_cache.size(3),
              "cpattn: q must be (batch, seqlen_q, heads, head_dim) with the cache's batch and "
              "head_dim (",
              k_cache.size(0), ", ", k_cache.size(3), "), got ", q.sizes());
  TORCH_CHECK(q.size(2) % k_cache.size(2) == 0, "cpattn: the number of query heads (", q.size(2),
              ") must be a multiple of the cache's key/value heads (", k_cache.size(2), ")");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "cpattn: q must have the cache's dtype ",
              k_cache.scalar_type(), ", got ", q.scalar_type());
  const AttentionOptions options = CPATTN_OPTIONS;
  const int64_t B = q.size(0), Sq = q.size(1), H = q.size(2), D = q.size(3);
  check_options("decode_attention", options, H, q.device());
  const int64_t Hkv = k_cache.size(2), group = H / Hkv;
  const std::vector<int64_t> lens = per_sequence(cache_lens, B, "cache_lens");
  const std::vector<int64_t> first = per_sequence(q_start, B, "q_start");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(s.count(0, lens[b]) <= k_cache.size(1), "cpattn: cache_lens[", b, "] = ", lens[b],
                " is more than the cache shards hold (", s.max_tokens(k_cache.size(1)), ")");

  const Mask rule = global_mask(options);
  const ScoreArgs score = score_args(options);
  // A backend with a batched decode kernel serves every sequence in one launch; the spans below
  // are its fallback (and the CPU's path).
  if (const auto decode = backend_for(q.device()).cache_decode) {
    if (auto result = decode(q, k_cache, v_cache, lens, first, s, rank, softmax_scale, rule, score))
      return {std::get<0>(*result).to(out_dtype.value_or(q.scalar_type())), std::get<1>(*result)};
  }
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::zeros({B, Sq, H, D}, f32);
  at::Tensor lse = at::full({B, H, Sq}, -INFINITY, f32);
  const bool alibi = alibi_slopes.has_value();
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor qb = q.narrow(0, b, 1), ob = out.narrow(0, b, 1), lb = lse.narrow(0, b, 1);
    for_each_cache_span(
        s, rank, lens[b], rule, first[b], Sq,
        [&](const CacheSpan& sp) {
          const int64_t n = sp.slot_end - sp.slot_begin;
          const at::Tensor kb = k_cache.narrow(0, b, 1).narrow(1, sp.slot_begin, n);
          const at::Tensor vb = v_cache.narrow(0, b, 1).narrow(1, sp.slot_begin, n);
          const Mask& m = sp.mask;
          const bool plain = !m.causal && m.window_left < 0 && m.window_right < 0;
          if (plain && group > 1 && !alibi) {
            // Every query sees every key of this span, so positions do not matter and the G query
            // heads that share a KV head can go in as G x Sq rows of one head: the kernel tiles 64
            // query rows, and a decode step has only Sq per head.
            const at::Tensor qf =
                qb.reshape({1, Sq, Hkv, group, D}).transpose(2, 3).reshape({1, Sq * group, Hkv, D});
            auto [part_out, part_lse] =
                attention_fwd_scored(qf, kb, vb, softmax_scale, Mask{}, score, at::kFloat);
            merge_into(ob, lb,
                       part_out.view({1, Sq, group, Hkv, D}).transpose(2, 3).reshape({1, Sq, H, D}),
                       part_lse.view({1, Hkv, Sq, group}).transpose(2, 3).reshape({1, H, Sq}));
            return;
          }
          ScoreArgs run_score = score;  // ALiBi on the run's global positions
          run_score.alibi_q_begin = m.q_offset;
          run_score.alibi_k_begin = m.k_offset;
          auto [part_out, part_lse] =
              attention_fwd_scored(qb, kb, vb, softmax_scale, m, run_score, at::kFloat);
          merge_into(ob, lb, part_out, part_lse);
        },
        /*runs_only=*/alibi);
  }
  return {out.to(out_dtype.value_or(q.scalar_type())), lse};
}

// Causal ring attention of a prompt chunk sharded over the group in `layout` (q, k, v as for
// ring_fwd), which also stores each chunk token in its owner's cache at position
// cache_lens[b] + (its position in the chunk). Attention to earlier cached tokens is not included.
// Returns out in float32 and lse. Score options and window as ring_fwd, on positions within the
// chunk (the same differences as the global ones; prefix_len: the prefix's end relative to the
// chunk's first token). seqlen > 0: the chunk's
// real length, the shards padded at its end (padding rows 0 / -inf, padding never stored).
std::tuple<at::Tensor, at::Tensor> prefill_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& cache_lens, c10::string_view group_name,
    int64_t layout, int64_t interleave, double timeout_s, int64_t seqlen, CPATTN_OPTION_PARAMS) {
  TORCH_CHECK(causal, "cpattn.prefill_attention: a prefill is causal (causal=True)");
  auto transport = group_transport(q, group_name, timeout_s);
  const int64_t world = transport->world(), rank = transport->rank();
  const CacheSharding s = checked_sharding(rank, world, interleave);
  check_cache(k_cache, v_cache);
  check_tokens(k, v, k_cache);
  check_mask_args(softmax_scale, window_left, window_right);
  RingOptions o =
      make_ring_options(CPATTN_OPTIONS, layout, std::nullopt, std::nullopt, std::nullopt);
  o.out_dtype = at::kFloat;  // merged with the cached part before the one cast
  const std::vector<int64_t> start = per_sequence(cache_lens, k_cache.size(0), "cache_lens");
  const int64_t chunk = k.size(1) * world;
  // Any length: a chunk of seqlen real tokens padded at its end is one document of that length
  // (padding rows 0 / -inf, padding keys never seen, never stored).
  TORCH_CHECK(seqlen >= 0 && seqlen <= chunk,
              "cpattn.prefill_attention: seqlen must be between 0 "
              "(the whole chunk) and the chunk's ",
              chunk, " tokens, got ", seqlen);
  const int64_t real = seqlen > 0 ? seqlen : chunk;
  if (real != chunk) o.doc_lengths = {real};
  check_room(s, k_cache.size(1), start, real);
  // Every K/V shard of the chunk passes through every rank in the ring: each rank keeps the
  // tokens it owns, so filling the cache costs no communication beyond the ring's.
  const ShardVisitor store = [&](int64_t source, const at::Tensor& k_shard,
                                 const at::Tensor& v_shard) {
    store_owned(k_cache, v_cache, k_shard, v_shard, s, rank, [&](int64_t b, int64_t l) {
      const int64_t c = global_position(o.layout, chunk, world, source, l);
      return c < real ? start[b] + c : -1;
    });
  };
  auto result = ring_forward(q, k, v, *transport, o, store);
  transport->finish();
  return result;
}

// Slots `rank` uses for the tokens of positions [0, n), and their global positions.
int64_t cache_local_count(int64_t n, int64_t rank, int64_t world, int64_t interleave) {
  TORCH_CHECK(n >= 0, "cpattn: the number of tokens must be >= 0, got ", n);
  return checked_sharding(rank, world, interleave).count(rank, n);
}

at::Tensor cache_positions(int64_t n, int64_t rank, int64_t world, int64_t interleave) {
  const CacheSharding s = checked_sharding(rank, world, interleave);
  TORCH_CHECK(n >= 0, "cpattn: the number of tokens must be >= 0, got ", n);
  at::Tensor pos = at::empty({s.count(rank, n)}, at::kLong);
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.size(0); ++i) p[i] = s.position(rank, i);
  return pos;
}

}  // namespace

void impl_inference_ops(torch::Library& m) {
  m.impl("merge_attention_states", &merge_attention_states);
  m.impl("merge_attention_states_bwd", &merge_attention_states_bwd);
  m.impl("cache_store_", &cache_store_);
  m.impl("cache_attention_fwd", &cache_attention_fwd);
  m.impl("prefill_fwd", &prefill_fwd);
}

}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("cache_local_count", &cpattn::ops::cache_local_count);
  m.impl("cache_positions", &cpattn::ops::cache_positions);
}
