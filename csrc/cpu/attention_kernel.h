// The fused blockwise attention kernel on the CPU (FlashAttention-2 algorithm), forward and
// backward, for packed fp32 operands. Included once per instruction set by kernels_<isa>.cpp.
//
// Scores are computed transposed, S^T = K Q^T (keys x queries), so that every per-query quantity
// (running max, sum, rescale factor, LSE, delta) is a vector along the 16-wide lanes and the
// softmax needs no horizontal reductions. The mask rule, block classification and online-softmax
// bookkeeping come from the header core (cpattn/mask.h, cpattn/softmax_state.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "cpattn/mask.h"
#include "cpattn/softmax_state.h"
#include "cpu/micro_gemm.h"
#include "cpu/params.h"

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

constexpr int64_t kBlockQ = 64;   // queries per block: the lane dimension of S^T
constexpr int64_t kBlockK = 128;  // keys per block

// Columns of the key block at c0 up to the last key that the query block sees (keys.last, from
// Mask::key_span): on a causal diagonal the keys past it are masked for every row, so they are
// not computed at all. The block's start stays c0, which keeps bf16 key pairs aligned.
inline int64_t visible_cols(const PosRange& keys, int64_t c0) {
  return std::min(kBlockK, keys.last + 1 - c0);
}

// Q^T of one query block, scaled: qt[d * kBlockQ + i] = q[i][d] * factor, from rows of dp
// values `row_stride` apart; padded queries are 0.
inline void pack_transposed(const float* q, int64_t row_stride, int64_t rows, int64_t dp,
                            float factor, float* qt) {
  std::fill(qt, qt + dp * kBlockQ, 0.f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t d = 0; d < dp; ++d) qt[d * kBlockQ + i] = q[i * row_stride + d] * factor;
}

// Sets st[c][i] = -inf for the pairs of a partial block that the mask hides.
inline void apply_mask(const Mask& mask, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                       float* st) {
  vint lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  const vfloat hidden_score = broadcast(neg_inf());
  for (int64_t c = 0; c < cols; ++c) {
    const PosRange seen = mask.query_span(c0 + c, c0 + c + 1, r0 + rows);
    // visible lanes are lo..hi; empty: lo > hi, all hidden
    const int32_t lo = static_cast<int32_t>(std::clamp<int64_t>(seen.first - r0, 0, kBlockQ));
    const int32_t hi = static_cast<int32_t>(std::clamp<int64_t>(seen.last - r0, -1, kBlockQ));
    float* row = st + c * kBlockQ;
    for (int64_t i = 0; i < kBlockQ; i += kLanes) {
      const vint query = lane + static_cast<int32_t>(i);
      const vint hidden = (query < lo) | (query > hi);
      store(row + i, hidden ? hidden_score : load(row + i));
    }
  }
}

// The score options (ScoreOptions, params.h) on one block of scores, before the mask: on entry
// st[c * kBlockQ + i] * in_scale is the base-2 score (softmax_scale * log2(e) * q.k) of key
// c0 + c and query r0 + i of head h; on exit st holds the base-2 logit, softcap first, then
// ALiBi. With softcap_grad, d(capped score) / d(score) = 1 - tanh^2 goes there for the backward.
// Called only when o.modifies_scores(), so the plain path runs none of it.
inline void modify_scores(const ScoreOptions& o, int64_t h, int64_t r0, int64_t c0, int64_t cols,
                          float in_scale, float* st, float* softcap_grad) {
  const int64_t n = cols * kBlockQ;
  if (o.softcap > 0.f) {
    // cap * tanh(s / cap) keeps its form in base-2 units, with the cap times log2(e)
    const float cap = o.softcap * kLog2e;
    const vfloat to_ratio = broadcast(in_scale / cap), cap_v = broadcast(cap);
    for (int64_t e = 0; e < n; e += kLanes) {
      const vfloat t = tanh(load(st + e) * to_ratio);
      store(st + e, t * cap_v);
      if (softcap_grad) store(softcap_grad + e, 1.f - t * t);
    }
  } else if (in_scale != 1.f) {
    const vfloat scale = broadcast(in_scale);
    for (int64_t e = 0; e < n; e += kLanes) store(st + e, load(st + e) * scale);
  }
  if (o.alibi_slopes) {
    const vfloat slope = broadcast(o.alibi_slopes[h] * kLog2e);
    const int64_t stride = o.alibi_stride;
    vfloat lane_distance;  // position of lane l past lane 0
    for (int l = 0; l < kLanes; ++l) lane_distance[l] = static_cast<float>(l * stride);
    for (int64_t c = 0; c < cols; ++c) {
      // query r0 minus key c0 + c, in global positions (exact in fp32 below 2^24)
      const int64_t first = o.alibi_q_begin + stride * r0 - o.alibi_k_begin - stride * (c0 + c);
      float* row = st + c * kBlockQ;
      for (int64_t i = 0; i < kBlockQ; i += kLanes) {
        const vfloat distance = vabs(lane_distance + static_cast<float>(first + stride * i));
        store(row + i, load(row + i) - slope * distance);
      }
    }
  }
}

// The online-softmax part of a forward step: st holds one key block's raw scores (cols keys x
// kBlockQ queries), base 2 after multiplying by `scale`. Each pair of keys' probabilities goes to
// keep(c, i, p_c, p_c+1) (c even; p_c+1 is 0 past an odd end), the row states take the block,
// and factor[i] receives what row i's accumulator must be multiplied by before this block's
// P V is added (its maximum may have grown; the product's C load applies it).
template <typename KeepProbabilities>
inline void softmax_block(const float* st, int64_t cols, float scale, OnlineSoftmaxRow* state,
                          float* factor, KeepProbabilities&& keep) {
  alignas(64) float reference[kBlockQ], block_max[kBlockQ], block_sum[kBlockQ];
  for (int64_t i = 0; i < kBlockQ; i += kLanes) {
    vfloat mx = broadcast(neg_inf());
    for (int64_t c = 0; c < cols; ++c) mx = vmax(mx, load(st + c * kBlockQ + i));
    store(block_max + i, mx * scale);  // scale > 0, so the max commutes with it
  }
  for (int64_t i = 0; i < kBlockQ; ++i) {
    factor[i] = state[i].rescale_for_block_max(block_max[i]);
    reference[i] = state[i].reference();
  }
  const vfloat scale_v = broadcast(scale);
  for (int64_t i = 0; i < kBlockQ; i += kLanes) {
    const vfloat ref = load(reference + i);
    vfloat sum{};
    for (int64_t c = 0; c < cols; c += 2) {
      const vfloat p0 = exp2(load(st + c * kBlockQ + i) * scale_v - ref);
      const vfloat p1 =
          c + 1 < cols ? exp2(load(st + (c + 1) * kBlockQ + i) * scale_v - ref) : vfloat{};
      sum += p0 + p1;
      keep(c, i, p0, p1);
    }
    store(block_sum + i, sum);
  }
  for (int64_t i = 0; i < kBlockQ; ++i) state[i].sum += block_sum[i];
}

// Writes n values src[d] * factor to an output row starting at element `offset`.
inline void write_row(const BshdOutput& o, int64_t offset, const float* src, float factor,
                      int64_t n) {
  if (o.type != DType::kFloat32) {
    const bool bf16 = o.type == DType::kBFloat16;
    uint16_t* dst = static_cast<uint16_t*>(o.data) + offset;
    int64_t d = 0;
    for (; d + kLanes <= n; d += kLanes) {
      const vfloat x = load(src + d) * factor;
      const vbits16 bits = bf16 ? bf16_bits(x) : fp16_bits(x);
      std::memcpy(dst + d, &bits, sizeof(bits));
    }
    for (; d < n; ++d) dst[d] = bf16 ? bf16_bits(src[d] * factor) : fp16_bits(src[d] * factor);
  } else {
    float* dst = static_cast<float*>(o.data) + offset;
    for (int64_t d = 0; d < n; ++d) dst[d] = src[d] * factor;
  }
}

// Normalises the accumulator rows of query block r0 and writes out and lse; a sink joins each
// row's denominator here, once (add_sink).
inline void write_output(const FwdParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                         const OnlineSoftmaxRow* state, const float* acc) {
  const AttnShape& sh = p.shape;
  const BshdStrides& o = p.out.strides;
  for (int64_t i = 0; i < rows; ++i) {
    float factor = state[i].inv_sum(), lse = state[i].lse();
    if (p.score.sinks) {
      const SinkNormalisation n = add_sink(lse, p.score.sinks[h]);
      factor *= n.out_factor;
      lse = n.lse;
    }
    write_row(p.out, b * o.batch + (r0 + i) * o.seq + h * o.head, acc + i * sh.head_dim_v_padded,
              factor, sh.head_dim_v);
    p.lse[(b * sh.heads + h) * sh.seqlen_q + r0 + i] = lse;
  }
}

// Query blocks that one forward task takes through a single pass over K and V. At long lengths
// K and V of a head no longer fit in L2 and stream from L3 or memory once per pass; a group uses
// each key block for all its query blocks while the block is in cache. Grouping changes no
// block's arithmetic, so results do not depend on it.
constexpr int64_t kMaxQueryBlocksPerTask = 4;

inline int64_t query_blocks_per_task(const AttnShape& sh, int64_t element_bytes) {
  constexpr int64_t kCachedKvBytes = int64_t{1} << 20;  // K and V of a head that stay in L2
  const int64_t q_blocks = (sh.seqlen_q + kBlockQ - 1) / kBlockQ;
  if (sh.seqlen_k * (sh.head_dim_padded + sh.head_dim_v_padded) * element_bytes <= kCachedKvBytes)
    return 1;
  int64_t group = kMaxQueryBlocksPerTask;
  // keep several tasks per thread for balance
  while (group > 1 &&
         sh.batch * sh.heads * ((q_blocks + group - 1) / group) < 4 * at::get_num_threads())
    group /= 2;
  return group;
}

// Runs the forward: blocks(b, h, qb_begin, qb_end, scratch) for every group of query blocks, in
// parallel, with one Scratch per parallel chunk.
template <typename Scratch, typename Blocks>
inline void for_each_query_group(const FwdParams& p, int64_t element_bytes, Blocks&& blocks) {
  const AttnShape& sh = p.shape;
  const int64_t q_blocks = (sh.seqlen_q + kBlockQ - 1) / kBlockQ;
  const int64_t group = query_blocks_per_task(sh, element_bytes);
  const int64_t groups = (q_blocks + group - 1) / group;
  at::parallel_for(0, sh.batch * sh.heads * groups, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(sh);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t % groups, bh = t / groups;
      blocks(bh / sh.heads, bh % sh.heads, g * group, std::min(q_blocks, (g + 1) * group), scratch);
    }
  });
}

// The keys that query blocks [qb_begin, qb_end) see, each block's span in spans[]: the range of
// key blocks the group's pass covers (empty: first > last).
inline PosRange group_key_span(const FwdParams& p, int64_t qb_begin, int64_t qb_end,
                               PosRange* spans) {
  const AttnShape& sh = p.shape;
  PosRange all{sh.seqlen_k, -1};
  for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
    const int64_t r0 = qb * kBlockQ, rows = std::min(kBlockQ, sh.seqlen_q - r0);
    PosRange& keys = spans[qb - qb_begin];
    keys = p.mask.key_span(r0, r0 + rows, sh.seqlen_k);
    if (keys.empty()) continue;
    all.first = std::min(all.first, keys.first);
    all.last = std::max(all.last, keys.last);
  }
  return all;
}

struct FwdScratch {
  AlignedArray<float> qt, st, acc;  // qt and acc: one per query block of a group
  explicit FwdScratch(const AttnShape& sh)
      : qt(aligned_array<float>(kMaxQueryBlocksPerTask * sh.head_dim_padded * kBlockQ)),
        st(aligned_array<float>(kBlockK * kBlockQ)),
        acc(aligned_array<float>(kMaxQueryBlocksPerTask * kBlockQ * sh.head_dim_v_padded)) {}
};

// The pass of query blocks [qb_begin, qb_end) of head h over the key blocks, shared by the fp32
// and bf16 forwards: pack(j, r0, rows) prepares the group's query block j (rows r0..), and
// step(j, r0, rows, c0, cols, kind, state, acc, factor) adds key block [c0, c0 + cols) to its
// row states and accumulator (kBlockQ x Dvp per query block, in `acc`); then the outputs are
// written.
template <typename Pack, typename Step>
inline void forward_group(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                          int64_t qb_end, float* acc, Pack&& pack, Step&& step) {
  const AttnShape& sh = p.shape;
  const int64_t acc_elems = kBlockQ * sh.head_dim_v_padded;
  OnlineSoftmaxRow state[kMaxQueryBlocksPerTask][kBlockQ];
  PosRange spans[kMaxQueryBlocksPerTask];
  alignas(64) float factor[kBlockQ];
  auto rows_of = [&](int64_t qb) { return std::min(kBlockQ, sh.seqlen_q - qb * kBlockQ); };
  for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
    pack(qb - qb_begin, qb * kBlockQ, rows_of(qb));
    std::fill(acc + (qb - qb_begin) * acc_elems, acc + (qb - qb_begin + 1) * acc_elems, 0.f);
  }
  // Only the key blocks that some row of the group can see.
  const PosRange all = group_key_span(p, qb_begin, qb_end, spans);
  for (int64_t c0 = all.first / kBlockK * kBlockK; c0 <= all.last; c0 += kBlockK)
    for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
      const int64_t j = qb - qb_begin, r0 = qb * kBlockQ, rows = rows_of(qb);
      const int64_t cols = visible_cols(spans[j], c0);
      const BlockKind kind = p.mask.classify(r0, r0 + rows, c0, c0 + cols);  // empty: cols <= 0
      if (kind != BlockKind::kEmpty)
        step(j, r0, rows, c0, cols, kind, state[j], acc + j * acc_elems, factor);
    }
  for (int64_t qb = qb_begin; qb < qb_end; ++qb)
    write_output(p, b, h, qb * kBlockQ, rows_of(qb), state[qb - qb_begin],
                 acc + (qb - qb_begin) * acc_elems);
}

// Query blocks [qb_begin, qb_end) of head h of batch b, in one pass over the key blocks.
inline void forward_blocks(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                           int64_t qb_end, FwdScratch& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t hk = h / sh.group_size();
  const bool modified = p.score.modifies_scores();
  const float* k = p.k + (b * sh.kv_heads + hk) * sh.seqlen_k * dp;
  const float* v = p.v + (b * sh.kv_heads + hk) * sh.seqlen_k * dvp;
  auto qt = [&](int64_t j) { return s.qt.get() + j * dp * kBlockQ; };
  forward_group(
      p, b, h, qb_begin, qb_end, s.acc.get(),
      [&](int64_t j, int64_t r0, int64_t rows) {
        const float* q = p.q + ((b * sh.heads + h) * sh.seqlen_q + r0) * dp;
        pack_transposed(q, dp, rows, dp, p.softmax_scale * kLog2e, qt(j));
      },
      [&](int64_t j, int64_t r0, int64_t rows, int64_t c0, int64_t cols, BlockKind kind,
          OnlineSoftmaxRow* state, float* acc, float* factor) {
        float* st = s.st.get();
        gemm(cols, kBlockQ, dp, k + c0 * dp, dp, 1, qt(j), kBlockQ, st, kBlockQ, false);
        if (modified) modify_scores(p.score, h, r0, c0, cols, 1.f, st, nullptr);
        if (kind == BlockKind::kPartial) apply_mask(p.mask, r0, rows, c0, cols, st);
        // Q was packed with the scale, so the scores are already base 2; P replaces them in st.
        softmax_block(st, cols, 1.f, state, factor,
                      [&](int64_t c, int64_t i, vfloat p0, vfloat p1) {
                        store(st + c * kBlockQ + i, p0);
                        if (c + 1 < cols) store(st + (c + 1) * kBlockQ + i, p1);
                      });
        // O[rows x Dvp] = factor * O + P[rows x cols] V[cols x Dvp], P read from st transposed.
        gemm(rows, dvp, cols, st, 1, kBlockQ, v + c0 * dvp, dvp, acc, dvp, true, factor);
      });
}

inline void attention_fwd_impl(const FwdParams& p) {
  for_each_query_group<FwdScratch>(
      p, sizeof(float),
      [&](int64_t b, int64_t h, int64_t qb_begin, int64_t qb_end, FwdScratch& scratch) {
        forward_blocks(p, b, h, qb_begin, qb_end, scratch);
      });
}

struct BwdScratch {
  AlignedArray<float> st, dpt, softcap_grad, dk, dv;
  explicit BwdScratch(const AttnShape& sh)
      : st(aligned_array<float>(kBlockK * kBlockQ)),
        dpt(aligned_array<float>(kBlockK * kBlockQ)),
        softcap_grad(aligned_array<float>(kBlockK * kBlockQ)),
        dk(aligned_array<float>(kBlockK * sh.head_dim_padded)),
        dv(aligned_array<float>(kBlockK * sh.head_dim_v_padded)) {}
};

// The query head of a backward visit, from its first global row (b * H + h) * Sq.
inline int64_t head_of_row(const AttnShape& sh, int64_t row_base) {
  return row_base / sh.seqlen_q % sh.heads;
}

// dS^T *= d(capped score) / d(score): the chain rule through the softcap.
inline void apply_softcap_grad(int64_t cols, const float* softcap_grad, float* dst) {
  for (int64_t e = 0; e < cols * kBlockQ; e += kLanes)
    store(dst + e, load(dst + e) * load(softcap_grad + e));
}

// Global row (in (B, H, Sq) order) of the first query row of kv head hk's first query head.
inline int64_t group_first_row(const AttnShape& sh, int64_t b, int64_t hk) {
  return (b * sh.heads + hk * sh.group_size()) * sh.seqlen_q;
}

// The query blocks of a query-shaped operand for the query heads of kv head hk of batch b, packed
// once by pack(b, h, r0, rows, out) into kBlockQ * dim_padded elements per block (Dp for q, Dvp
// for dout): a backward task visits each of them once per key block, so packing there would
// repeat the work Sk / kBlockK times. Packed by each parallel chunk for the pair it computes (one
// KV head's group at a time), not for every head up front, so that only those groups are held.
template <typename T>
struct PackedQueryBlocks {
  int64_t q_blocks, block_elems, first_row;
  AlignedArray<T> data;

  template <typename Pack>
  PackedQueryBlocks(const AttnShape& sh, int64_t dim_padded, int64_t b, int64_t hk, Pack&& pack)
      : q_blocks((sh.seqlen_q + kBlockQ - 1) / kBlockQ),
        block_elems(kBlockQ * dim_padded),
        first_row(group_first_row(sh, b, hk)),
        data(aligned_array<T>(sh.group_size() * q_blocks * block_elems)) {
    for (int64_t t = 0; t < sh.group_size() * q_blocks; ++t) {
      const int64_t r0 = t % q_blocks * kBlockQ;
      pack(b, hk * sh.group_size() + t / q_blocks, r0, std::min(kBlockQ, sh.seqlen_q - r0),
           data.get() + t * block_elems);
    }
  }
  // The block of query rows r0.. of the head whose first global row is row_base.
  const T* block(const AttnShape& sh, int64_t row_base, int64_t r0) const {
    return data.get() +
           ((row_base - first_row) / sh.seqlen_q * q_blocks + r0 / kBlockQ) * block_elems;
  }
};

// The backward's per-query inputs of a query block starting at global row `first`: the
// reference point of exp2 (from the LSE) and delta. Padded rows get reference +inf, so their
// probabilities, hence all their terms, are 0.
inline void load_row_stats(const BwdParams& p, int64_t first, int64_t rows, float* reference,
                           float* delta) {
  for (int64_t i = 0; i < kBlockQ; ++i) {
    reference[i] =
        i < rows ? backward_reference(p.lse[first + i]) : std::numeric_limits<float>::infinity();
    delta[i] = i < rows ? p.delta[first + i] : 0.f;
  }
}

// Calls visit(row_base, r0, rows, seen, kind) for every query block, of every query head of kv
// head hk, that sees some key of the key block [c0, c0 + cols); row_base is the head's first
// global row, and the visit covers keys [c0, c0 + seen), up to the last key the query block sees
// (visible_cols).
template <typename Visit>
inline void for_each_query_block(const BwdParams& p, int64_t b, int64_t hk, int64_t c0,
                                 int64_t cols, Visit&& visit) {
  const AttnShape& sh = p.shape;
  const PosRange queries = p.mask.query_span(c0, c0 + cols, sh.seqlen_q);
  for (int64_t h = hk * sh.group_size(); h < (hk + 1) * sh.group_size(); ++h) {
    const int64_t row_base = (b * sh.heads + h) * sh.seqlen_q;
    for (int64_t r0 = queries.first / kBlockQ * kBlockQ; r0 <= queries.last; r0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, sh.seqlen_q - r0);
      const PosRange keys = p.mask.key_span(r0, r0 + rows, sh.seqlen_k);
      const int64_t seen = std::min(cols, visible_cols(keys, c0));
      const BlockKind kind = p.mask.classify(r0, r0 + rows, c0, c0 + seen);  // empty if seen <= 0
      if (kind != BlockKind::kEmpty) visit(row_base, r0, rows, seen, kind);
    }
  }
}

// Writes a key block's dK (scaled by the softmax scale) and dV from fp32 rows of Dp and Dvp.
inline void write_key_block_grads(const BwdParams& p, int64_t b, int64_t hk, int64_t c0,
                                  int64_t cols, const float* dk, const float* dv) {
  const AttnShape& sh = p.shape;
  for (int64_t c = 0; c < cols; ++c) {
    const BshdStrides& k = p.dk.strides;
    const BshdStrides& v = p.dv.strides;
    write_row(p.dk, b * k.batch + (c0 + c) * k.seq + hk * k.head, dk + c * sh.head_dim_padded,
              p.softmax_scale, sh.head_dim);
    write_row(p.dv, b * v.batch + (c0 + c) * v.seq + hk * v.head, dv + c * sh.head_dim_v_padded,
              1.f, sh.head_dim_v);
  }
}

// Packs blocks of a (B, Sq, H, dim_padded) fp32 operand with strides st transposed, times factor.
inline auto transposed_blocks(int64_t dim_padded, const float* x, const BshdStrides& st,
                              float factor) {
  return [dim_padded, x, st, factor](int64_t b, int64_t h, int64_t r0, int64_t rows, float* out) {
    pack_transposed(x + b * st.batch + r0 * st.seq + h * st.head, st.seq, rows, dim_padded, factor,
                    out);
  };
}

// Packs blocks of a (B, Sq, H, dim_padded) fp32 operand with strides st as contiguous rows.
inline auto row_blocks(int64_t dim_padded, const float* x, const BshdStrides& st) {
  return [dim_padded, x, st](int64_t b, int64_t h, int64_t r0, int64_t rows, float* out) {
    const float* src = x + b * st.batch + r0 * st.seq + h * st.head;
    for (int64_t i = 0; i < rows; ++i)
      std::copy(src + i * st.seq, src + i * st.seq + dim_padded, out + i * dim_padded);
  };
}

// The fp32 backward's B operands of every query block of kv head hk's query heads: Q^T (scaled
// to base-2 scores) and dO^T, and Q and dO as contiguous rows (read in place, their rows are
// H D apart: at power-of-two strides the products' row loads conflict in the cache).
struct PackedQueries {
  PackedQueryBlocks<float> qt, dot, q_rows, do_rows;
  PackedQueries(const BwdParams& p, int64_t b, int64_t hk)
      : qt(p.shape, p.shape.head_dim_padded, b, hk,
           transposed_blocks(p.shape.head_dim_padded, p.q, p.q_strides, p.softmax_scale * kLog2e)),
        dot(p.shape, p.shape.head_dim_v_padded, b, hk,
            transposed_blocks(p.shape.head_dim_v_padded, p.dout, p.dout_strides, 1.f)),
        q_rows(p.shape, p.shape.head_dim_padded, b, hk,
               row_blocks(p.shape.head_dim_padded, p.q, p.q_strides)),
        do_rows(p.shape, p.shape.head_dim_v_padded, b, hk,
                row_blocks(p.shape.head_dim_v_padded, p.dout, p.dout_strides)) {}
};

// One key block of one kv head: dK and dV of the block in full, and its dQ contributions for
// every query head of the group (dQ rows of these heads are touched by this task only).
inline void backward_key_block(const BwdParams& p, const PackedQueries& packed, int64_t b,
                               int64_t hk, int64_t c0, float* dq_group, BwdScratch& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t cols = std::min(kBlockK, sh.seqlen_k - c0);
  const bool modified = p.score.modifies_scores();
  float* softcap_grad = p.score.softcap > 0.f ? s.softcap_grad.get() : nullptr;
  const BshdStrides &ks = p.k_strides, &vs = p.v_strides;
  const float* k = p.k + b * ks.batch + c0 * ks.seq + hk * ks.head;
  const float* v = p.v + b * vs.batch + c0 * vs.seq + hk * vs.head;
  std::fill(s.dk.get(), s.dk.get() + kBlockK * dp, 0.f);
  std::fill(s.dv.get(), s.dv.get() + kBlockK * dvp, 0.f);
  alignas(64) float reference[kBlockQ], delta[kBlockQ];

  for_each_query_block(
      p, b, hk, c0, cols,
      [&](int64_t row_base, int64_t r0, int64_t rows, int64_t seen, BlockKind kind) {
        const int64_t h = head_of_row(sh, row_base);
        float* dq = dq_group + (row_base - group_first_row(sh, b, hk) + r0) * dp;
        load_row_stats(p, row_base + r0, rows, reference, delta);
        float* st = s.st.get();
        float* dpt = s.dpt.get();

        // P^T = exp2(K Q^T - lse)
        gemm(seen, kBlockQ, dp, k, ks.seq, 1, packed.qt.block(sh, row_base, r0), kBlockQ, st,
             kBlockQ, false);
        if (modified) modify_scores(p.score, h, r0, c0, seen, 1.f, st, softcap_grad);
        if (kind == BlockKind::kPartial) apply_mask(p.mask, r0, rows, c0, seen, st);
        for (int64_t c = 0; c < seen; ++c)
          for (int64_t i = 0; i < kBlockQ; i += kLanes)
            store(st + c * kBlockQ + i, exp2(load(st + c * kBlockQ + i) - load(reference + i)));
        // dV += P^T dO
        gemm(seen, dvp, rows, st, kBlockQ, 1, packed.do_rows.block(sh, row_base, r0), dvp,
             s.dv.get(), dvp, true);
        // dP^T = V dO^T ; dS^T = P^T * (dP^T - delta)
        gemm(seen, kBlockQ, dvp, v, vs.seq, 1, packed.dot.block(sh, row_base, r0), kBlockQ, dpt,
             kBlockQ, false);
        for (int64_t c = 0; c < seen; ++c)
          for (int64_t i = 0; i < kBlockQ; i += kLanes)
            store(dpt + c * kBlockQ + i,
                  load(st + c * kBlockQ + i) * (load(dpt + c * kBlockQ + i) - load(delta + i)));
        if (softcap_grad) apply_softcap_grad(seen, softcap_grad, dpt);
        // dK += dS^T Q ; dQ += dS K   (softmax scale applied once at the end)
        gemm(seen, dp, rows, dpt, kBlockQ, 1, packed.q_rows.block(sh, row_base, r0), dp, s.dk.get(),
             dp, true);
        gemm(rows, dp, seen, dpt, 1, kBlockQ, k, ks.seq, dq, dp, true);
      });

  write_key_block_grads(p, b, hk, c0, cols, s.dk.get(), s.dv.get());
}

// How many ranges the key blocks of each (batch, kv head) are split into. Without a split a task
// per (batch, kv head) owns the dQ rows of its query heads; with few such pairs (small batch,
// MQA) that leaves threads idle, so each range then accumulates dQ into an fp32 buffer of its
// own (splits x the size of dQ in all), summed afterwards in a fixed order. The choice depends
// on the shape only, never on the thread count, so results are the same bits with any number of
// threads. The buffers are capped at 64 MiB in all (fewer splits for long sequences): they were
// the largest part of a long backward's memory.
inline int64_t key_splits(const AttnShape& sh, int64_t k_blocks) {
  constexpr int64_t kTargetTasks = 8;
  constexpr int64_t kMaxBufferBytes = int64_t{64} << 20;
  const int64_t pairs = sh.batch * sh.kv_heads;
  const int64_t dq_bytes = sh.batch * sh.heads * sh.seqlen_q * sh.head_dim_padded * 4;
  int64_t splits = std::min((kTargetTasks + pairs - 1) / pairs, k_blocks);
  while (splits > 1 && splits * dq_bytes > kMaxBufferBytes) --splits;
  return std::max<int64_t>(splits, 1);
}

// Writes the dQ rows of the (batch, kv head) pair `pair`, scaled by the softmax scale, from its
// fp32 accumulators: `splits` of them, `split_stride` apart, each (group heads, Sq, Dp), summed
// in split order (into the first).
inline void write_group_dq(const BwdParams& p, int64_t pair, float* acc, int64_t split_stride,
                           int64_t splits) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded;
  const int64_t b = pair / sh.kv_heads, first_head = pair % sh.kv_heads * sh.group_size();
  const BshdStrides& o = p.dq.strides;
  for (int64_t r = 0; r < sh.group_size() * sh.seqlen_q; ++r) {
    float* row = acc + r * dp;
    for (int64_t split = 1; split < splits; ++split)
      for (int64_t d = 0; d < dp; ++d) row[d] += row[split * split_stride + d];
    const int64_t h = first_head + r / sh.seqlen_q, i = r % sh.seqlen_q;
    write_row(p.dq, b * o.batch + i * o.seq + h * o.head, row, p.softmax_scale, sh.head_dim);
  }
}

// Runs the backward tasks: body(b, hk, kb_begin, kb_end, dq_group, scratch) computes the key
// blocks [kb_begin, kb_end) of (batch b, kv head hk), adding dQ to the fp32 accumulator
// dq_group, (group heads, Sq, Dp) and zero at first, the rows of the query heads of hk; then dQ
// is written to p.dq. One Scratch per parallel chunk.
template <typename Scratch, typename Body>
inline void run_backward(const BwdParams& p, Body&& body) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded;
  const int64_t k_blocks = (sh.seqlen_k + kBlockK - 1) / kBlockK;
  const int64_t splits = key_splits(sh, k_blocks);
  const int64_t pairs = sh.batch * sh.kv_heads;
  const int64_t group_elems = sh.group_size() * sh.seqlen_q * dp;
  if (splits == 1) {
    // A task owns its pair's dQ rows: they accumulate in a buffer of the parallel chunk, which
    // stays in cache for moderate lengths, and are written out when the task ends.
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(sh);
      AlignedArray<float> dq = aligned_array<float>(group_elems);
      for (int64_t pair = begin; pair < end; ++pair) {
        std::fill(dq.get(), dq.get() + group_elems, 0.f);
        body(pair / sh.kv_heads, pair % sh.kv_heads, 0, k_blocks, dq.get(), scratch);
        write_group_dq(p, pair, dq.get(), 0, 1);
      }
    });
    return;
  }
  // Few pairs: each split of a pair's key blocks accumulates dQ in a buffer of its own; the
  // splits are summed afterwards in a fixed order.
  const int64_t split_stride = pairs * group_elems;
  AlignedArray<float> dq = aligned_array<float>(splits * split_stride);
  at::parallel_for(0, splits * split_stride, 1 << 16, [&](int64_t begin, int64_t end) {
    std::fill(dq.get() + begin, dq.get() + end, 0.f);
  });
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(sh);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t split = t % splits, pair = t / splits;
      body(pair / sh.kv_heads, pair % sh.kv_heads, k_blocks * split / splits,
           k_blocks * (split + 1) / splits, dq.get() + split * split_stride + pair * group_elems,
           scratch);
    }
  });
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair)
      write_group_dq(p, pair, dq.get() + pair * group_elems, split_stride, splits);
  });
}

// The backward with one operand flavour: its packed queries, scratch and per-key-block step
// (fp32 here, bf16 in attention_kernel_bf16.h).
template <typename Packed, typename Scratch>
struct ScratchWithQueries : Scratch {
  std::optional<Packed> packed;  // the queries of (batch, kv head) pair `pair`
  int64_t pair = -1;
  using Scratch::Scratch;
};

template <typename Packed, typename Scratch, typename KeyBlock>
inline void backward_key_blocks(const BwdParams& p, KeyBlock key_block) {
  using Chunk = ScratchWithQueries<Packed, Scratch>;
  run_backward<Chunk>(p, [&](int64_t b, int64_t hk, int64_t kb_begin, int64_t kb_end,
                             float* dq_group, Chunk& chunk) {
    // A parallel chunk's tasks come in pair order (the splits of a pair one after another), so
    // each chunk packs a pair's queries once and holds one pair's at a time.
    const int64_t pair = b * p.shape.kv_heads + hk;
    if (chunk.pair != pair) {
      chunk.packed.reset();
      chunk.packed.emplace(p, b, hk);
      chunk.pair = pair;
    }
    for (int64_t kb = kb_begin; kb < kb_end; ++kb)
      key_block(p, *chunk.packed, b, hk, kb * kBlockK, dq_group, chunk);
  });
}

inline void attention_bwd_impl(const BwdParams& p) {
  backward_key_blocks<PackedQueries, BwdScratch>(p, backward_key_block);
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
