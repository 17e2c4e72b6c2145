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
#include <atomic>
#include <memory>

#include "cpattn/invariant.h"
#include "cpattn/mask.h"
#include "cpattn/softmax_state.h"
#include "cpu/micro_gemm.h"
#include "cpu/params.h"

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

constexpr int64_t kBlockQ = 64;   // queries per block: the lane dimension of S^T
constexpr int64_t kBlockK = 128;  // keys per block
static_assert(kBlockK == kValuePanelKeys, "the brgemm path's V panels are one key block wide");

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

// Adds n values of src times factor to row `offset` of an fp32 output, or of split fp32 sums (a
// bf16 output of their high halves, `low` their low halves at the same offsets; join_halves).
inline void add_row(const BshdOutput& o, uint16_t* low, int64_t offset, const float* src,
                    float factor, int64_t n) {
  if (o.type == DType::kBFloat16) {
    uint16_t *high = static_cast<uint16_t*>(o.data) + offset, *lo = low + offset;
    int64_t d = 0;
    for (; d + kLanes <= n; d += kLanes)
      split_halves(join_halves(high + d, lo + d) + load(src + d) * factor, high + d, lo + d);
    for (; d < n; ++d) split_halves(join_halves(high[d], lo[d]) + src[d] * factor, high[d], lo[d]);
    return;
  }
  float* dst = static_cast<float*>(o.data) + offset;
  for (int64_t d = 0; d < n; ++d) dst[d] += src[d] * factor;
}

// Rounds n split fp32 sums (add_row) to the nearest bf16, in place in their high halves.
inline void round_split_sums_impl(uint16_t* high, const uint16_t* low, int64_t n) {
  at::parallel_for(0, (n + kLanes - 1) / kLanes, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * kLanes; i < std::min(n, end * kLanes); ++i)
      high[i] = bf16_bits(join_halves(high[i], low[i]));
  });
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
// parallel, with one Scratch per parallel task.
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

// The pass of query blocks [qb_begin, qb_end) of head h over the key blocks, shared by every
// forward: pack(p, b, h, r0, rows, qt) packs a query block (rows r0..) into its place qt in
// s.qt (Dp x kBlockQ elements a block), and step(qt, r0, rows, c0, cols, kind, state, acc,
// factor) adds key block [c0, c0 + cols) to the row states and accumulator of the query block
// packed at qt (kBlockQ x Dvp per query block, in s.acc); then the outputs are written. With
// `rows_buffer` (kBlockQ x Dvp) the accumulators are transposed, Dvp x kBlockQ (the brgemm
// path's O^T), and turned into rows there first.
template <typename Scratch, typename Pack, typename Step>
inline void forward_group(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                          int64_t qb_end, Scratch& s, Pack&& pack, Step&& step,
                          float* rows_buffer = nullptr) {
  const AttnShape& sh = p.shape;
  const int64_t acc_elems = kBlockQ * sh.head_dim_v_padded;
  float* acc = s.acc.get();
  auto qt = [&](int64_t j) { return s.qt.get() + j * sh.head_dim_padded * kBlockQ; };
  OnlineSoftmaxRow state[kMaxQueryBlocksPerTask][kBlockQ];
  PosRange spans[kMaxQueryBlocksPerTask];
  alignas(64) float factor[kBlockQ];
  auto rows_of = [&](int64_t qb) { return std::min(kBlockQ, sh.seqlen_q - qb * kBlockQ); };
  for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
    pack(p, b, h, qb * kBlockQ, rows_of(qb), qt(qb - qb_begin));
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
        step(qt(j), r0, rows, c0, cols, kind, state[j], acc + j * acc_elems, factor);
    }
  const int64_t dvp = sh.head_dim_v_padded;
  for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
    const float* block = acc + (qb - qb_begin) * acc_elems;
    if (rows_buffer) {
      for (int64_t d = 0; d < dvp; ++d)
        for (int64_t i = 0; i < kBlockQ; ++i) rows_buffer[i * dvp + d] = block[d * kBlockQ + i];
      block = rows_buffer;
    }
    write_output(p, b, h, qb * kBlockQ, rows_of(qb), state[qb - qb_begin], block);
  }
}

// Q rows r0.. (`rows` of them) of head h of batch b (B, H, Sq, Dp), transposed into qt and
// scaled to base-2 scores: the first product's operand for one query block.
inline void pack_query_scaled(const FwdParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                              float* qt) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded;
  pack_transposed(p.q + ((b * sh.heads + h) * sh.seqlen_q + r0) * dp, dp, rows, dp,
                  p.softmax_scale * kLog2e, qt);
}

// A key block's scores in st (kBlockQ per key, base 2: Q was packed with the scale) modified,
// masked and replaced by P, in place, through the online softmax.
inline void scores_to_probs(const FwdParams& p, int64_t h, int64_t r0, int64_t rows, int64_t c0,
                            int64_t cols, BlockKind kind, OnlineSoftmaxRow* state, float* factor,
                            float* st) {
  if (p.score.modifies_scores()) modify_scores(p.score, h, r0, c0, cols, 1.f, st, nullptr);
  if (kind == BlockKind::kPartial) apply_mask(p.mask, r0, rows, c0, cols, st);
  softmax_block(st, cols, 1.f, state, factor, [&](int64_t c, int64_t i, vfloat p0, vfloat p1) {
    store(st + c * kBlockQ + i, p0);
    if (c + 1 < cols) store(st + (c + 1) * kBlockQ + i, p1);
  });
}

// Query blocks [qb_begin, qb_end) of head h of batch b, in one pass over the key blocks.
inline void forward_blocks(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                           int64_t qb_end, FwdScratch& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t hk = h / sh.group_size();
  const float* k = p.k + (b * sh.kv_heads + hk) * sh.seqlen_k * dp;
  const float* v = p.v + (b * sh.kv_heads + hk) * sh.seqlen_k * dvp;
  forward_group(p, b, h, qb_begin, qb_end, s, pack_query_scaled,
                [&](const float* qt, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                    BlockKind kind, OnlineSoftmaxRow* state, float* acc, float* factor) {
                  float* st = s.st.get();
                  gemm(cols, kBlockQ, dp, k + c0 * dp, dp, 1, qt, kBlockQ, st, kBlockQ, false);
                  scores_to_probs(p, h, r0, rows, c0, cols, kind, state, factor, st);
                  // O[rows x Dvp] = factor * O + P[rows x cols] V[cols x Dvp], P read from st
                  // transposed.
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

// How many ranges the key blocks that a row band sees are split into per (batch, kv head)
// pair. A task per (pair, range) adds its dQ into a band-sized fp32 buffer of its range; with
// few pairs (small batch, MQA) the ranges keep the threads busy. The choice depends on the shape
// only, never on the thread count, so results are the same bits with any number of threads.
inline int64_t key_splits(const AttnShape& sh) {
  if (sh.fixed_order) return 1;  // dQ: one sum over the key blocks in order
  constexpr int64_t kTargetTasks = 8;
  const int64_t pairs = sh.batch * sh.kv_heads;
  return (kTargetTasks + pairs - 1) / pairs;
}

// The backward runs over bands of query rows, one band after another (backward_row_bands below):
// the packed query blocks and the dQ buffers are a band's size, whatever the sequence length.
// Rows per band: at most kMaxBandRows, and at most kBandElemBudget query elements over all
// B H heads (the band's packed blocks hold B H x rows x Dp of each operand: the ring's many-head
// calls stay lean), divided by half the key splits beyond two (each split holds a band of dQ:
// with one or two pairs, GQA, the splits' buffers would outweigh the packed blocks), at least
// kBlockQ, a multiple of it; a function of the shape only.
constexpr int64_t kMaxBandRows = 512;
constexpr int64_t kBandElemBudget = 2048 * 128;

// Under fixed_order, bands of kFixedBandRows from query row 0: dK and dV sum the bands' parts
// in an order that depends on the query rows' positions only.
constexpr int64_t kFixedBandRows = kInvariantRowBand;
static_assert(kFixedBandRows % kBlockQ == 0 && kFixedBandRows % kBlockK == 0);

inline int64_t band_rows(const AttnShape& sh) {
  const int64_t rows_needed = (sh.seqlen_q + kBlockQ - 1) / kBlockQ * kBlockQ;
  if (sh.fixed_order) return std::min(kFixedBandRows, rows_needed);
  const int64_t split_share = std::max<int64_t>(1, key_splits(sh) / 2);
  const int64_t by_budget = kBandElemBudget /
                            (sh.batch * sh.heads * sh.head_dim_padded * split_share) / kBlockQ *
                            kBlockQ;
  const int64_t rows = std::clamp(by_budget, kBlockQ, kMaxBandRows);
  return std::min(rows, rows_needed);
}

// The query blocks of a query-shaped operand for one band of query rows of every (batch, head),
// kBlockQ * dim_padded elements per block (Dp for q, Dvp for dout), packed once per band: a
// backward task visits each of them once per key block, so packing there would repeat the work.
// Elements of a band of rows_per_band query rows of every (batch, head), dim_padded each: a
// packed operand's band (BandQueryBlocks), a key split's dQ buffer (backward_row_bands).
inline int64_t band_elems(const AttnShape& sh, int64_t dim_padded, int64_t rows_per_band) {
  return sh.batch * sh.heads * rows_per_band * dim_padded;
}

template <typename T>
struct BandQueryBlocks {
  int64_t block_elems;
  AlignedArray<T> data;
  BandQueryBlocks(const AttnShape& sh, int64_t dim_padded, int64_t rows_per_band)
      : block_elems(kBlockQ * dim_padded),
        data(aligned_array<T>(band_elems(sh, dim_padded, rows_per_band))) {}
  T* at(int64_t slot) { return data.get() + slot * block_elems; }
  const T* at(int64_t slot) const { return data.get() + slot * block_elems; }
};

// The backward's B operands of the current band's query blocks: Q^T and dO^T, Q and dO as rows
// (fp32: Q^T scaled to base-2 scores, rows contiguous; bf16: d pairs and row pairs). Block j of
// the band of head b * H + h sits in slot (b * H + h) * blocks_per_band + j.
template <typename T>
struct PackedBand {
  int64_t q0 = 0;  // the band's first query row
  int64_t blocks_per_band;
  BandQueryBlocks<T> qt, dot, q_rows, do_rows;
  PackedBand(const AttnShape& sh, int64_t rows_per_band)
      : blocks_per_band(rows_per_band / kBlockQ),
        qt(sh, sh.head_dim_padded, rows_per_band),
        dot(sh, sh.head_dim_v_padded, rows_per_band),
        q_rows(sh, sh.head_dim_padded, rows_per_band),
        do_rows(sh, sh.head_dim_v_padded, rows_per_band) {}
  // The slot of the block of query rows r0.. of the head whose first global row is row_base.
  int64_t slot(const AttnShape& sh, int64_t row_base, int64_t r0) const {
    return row_base / sh.seqlen_q * blocks_per_band + (r0 - q0) / kBlockQ;
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

// Calls visit(row_base, r0, rows, seen, kind) for every query block of the query rows [q0, q1)
// (q0 a multiple of kBlockQ), of every query head of kv head hk, that sees some key of the key
// block [c0, c0 + cols); row_base is the head's first global row, and the visit covers keys
// [c0, c0 + seen), up to the last key the query block sees (visible_cols). Returns whether it
// visited any.
template <typename Visit>
inline bool for_each_query_block(const BwdParams& p, int64_t b, int64_t hk, int64_t c0,
                                 int64_t cols, int64_t q0, int64_t q1, Visit&& visit) {
  const AttnShape& sh = p.shape;
  const PosRange queries = p.mask.query_span(c0, c0 + cols, sh.seqlen_q);
  const int64_t first = std::max(queries.first, q0), last = std::min(queries.last, q1 - 1);
  bool visited = false;
  for (int64_t h = hk * sh.group_size(); h < (hk + 1) * sh.group_size(); ++h) {
    const int64_t row_base = (b * sh.heads + h) * sh.seqlen_q;
    for (int64_t r0 = first / kBlockQ * kBlockQ; r0 <= last; r0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, sh.seqlen_q - r0);
      const PosRange keys = p.mask.key_span(r0, r0 + rows, sh.seqlen_k);
      const int64_t seen = std::min(cols, visible_cols(keys, c0));
      const BlockKind kind = p.mask.classify(r0, r0 + rows, c0, c0 + seen);  // empty if seen <= 0
      if (kind == BlockKind::kEmpty) continue;
      visit(row_base, r0, rows, seen, kind);
      visited = true;
    }
  }
  return visited;
}

// The fp32 sums of dK (or dV) over the row bands, one row of dim_padded values per (batch,
// key, kv head), zero at first, times `factor` in the end. Where they live depends on the output
// (D = dim_padded for the first two):
// - fp32: the output itself (no copy: the ring's case, and fp32 Ulysses); with `accumulate`
//   (BwdParams) its values are kept and each block's gradient is added times factor;
// - bf16: split in halves, each sum's high 16 bits (its bf16 truncation) in the output and its
//   low 16 bits in a (B, Sk, Hkv, dim_padded) buffer of their own: the same fp32 sums, the same
//   bits, in half the bytes of an fp32 buffer; rounded to nearest into the output at the end;
// - otherwise a (B, Sk, Hkv, dim_padded) fp32 buffer of their own.
// With `resume` (a fixed-order call continuing fp32 running sums: backward_row_bands) factor is 1
// and the sums start from the output's values; a buffer of their own is copied back.
struct KeyGradSums {
  enum class Storage { kOutput, kSplit, kOwn, kNone };  // kNone: no output (not wanted)
  Storage storage;
  AlignedArray<float> own;
  AlignedArray<uint16_t> low;  // kSplit: the low halves, rows contiguous like `own`
  void* data;                  // kOutput, kOwn: fp32 rows; kSplit: the high halves, in the output
  BshdStrides strides;         // of data
  int64_t seqlen_k, kv_heads, dim_padded;
  float factor;
  bool accumulate, resume;
  // Where the sums of a gradient (wanted or not) of `dim` values (padded) in `type` are kept.
  static Storage storage_for(bool wanted, int64_t dim, int64_t padded, DType type) {
    return !wanted                    ? Storage::kNone
           : dim != padded            ? Storage::kOwn
           : type == DType::kFloat32  ? Storage::kOutput
           : type == DType::kBFloat16 ? Storage::kSplit
                                      : Storage::kOwn;
  }
  // Bytes per padded value that a storage allocates beyond the gradient: fp32 sums of their own,
  // or the low halves of split sums.
  static int64_t bytes_per_value(Storage storage) {
    return storage == Storage::kOwn ? 4 : storage == Storage::kSplit ? 2 : 0;
  }
  KeyGradSums(const AttnShape& sh, const BshdOutput& out, int64_t dim, int64_t padded,
              float factor_, bool accumulate_, bool resume_)
      : seqlen_k(sh.seqlen_k),
        kv_heads(sh.kv_heads),
        dim_padded(padded),
        factor(resume_ ? 1.f : factor_),
        accumulate(accumulate_ || resume_),
        resume(resume_) {
    const int64_t rows = sh.batch * sh.seqlen_k * sh.kv_heads;
    storage = storage_for(out.data != nullptr, dim, padded, out.type);
    if (storage == Storage::kOwn) {
      own = aligned_array<float>(rows * padded);
      data = own.get();
      strides = {sh.seqlen_k * sh.kv_heads * padded, sh.kv_heads * padded, padded};
    } else {
      data = out.data;
      strides = out.strides;
    }
    if (storage == Storage::kSplit) low = aligned_array<uint16_t>(rows * padded);
    if (storage == Storage::kNone) return;
    if (storage == Storage::kOutput && accumulate) return;  // added to what the output holds
    at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {  // r = (b * Sk + c) * Hkv + hk
        const int64_t b = r / (sh.seqlen_k * sh.kv_heads), c = r / sh.kv_heads % sh.seqlen_k,
                      hk = r % sh.kv_heads;
        if (storage == Storage::kSplit) {
          std::fill(high_row(b, c, hk), high_row(b, c, hk) + dim_padded, uint16_t{0});
          std::fill(low_row(b, c, hk), low_row(b, c, hk) + dim_padded, uint16_t{0});
        } else if (resume) {  // kOwn: the running sums' D values, zero beyond
          const float* src = static_cast<const float*>(out.data) + b * out.strides.batch +
                             c * out.strides.seq + hk * out.strides.head;
          std::copy(src, src + dim, row(b, c, hk));
          std::fill(row(b, c, hk) + dim, row(b, c, hk) + dim_padded, 0.f);
        } else {
          std::fill(row(b, c, hk), row(b, c, hk) + dim_padded, 0.f);
        }
      }
    });
  }
  int64_t offset(int64_t b, int64_t c, int64_t hk) const {
    return b * strides.batch + c * strides.seq + hk * strides.head;
  }
  float* row(int64_t b, int64_t c, int64_t hk) const {
    return static_cast<float*>(data) + offset(b, c, hk);
  }
  uint16_t* high_row(int64_t b, int64_t c, int64_t hk) const {
    return static_cast<uint16_t*>(data) + offset(b, c, hk);
  }
  uint16_t* low_row(int64_t b, int64_t c, int64_t hk) const {
    return low.get() + ((b * seqlen_k + c) * kv_heads + hk) * dim_padded;
  }
  // Adds `cols` rows of a key block's gradient (rows of dim_padded values) from key c0 on.
  void add(int64_t b, int64_t hk, int64_t c0, int64_t cols, const float* block) const {
    if (storage == Storage::kNone) return;
    for (int64_t c = 0; c < cols; ++c) {
      const float* y = block + c * dim_padded;
      if (storage == Storage::kSplit) {
        uint16_t *high = high_row(b, c0 + c, hk), *lo = low_row(b, c0 + c, hk);
        // the high halves' rows are Hkv D apart in the output, a stride the hardware
        // prefetchers follow poorly: fetch a few rows ahead
        if (c + 8 < cols)
          for (int64_t d = 0; d < dim_padded; d += 32) {
            __builtin_prefetch(high_row(b, c0 + c + 8, hk) + d, 1);
            __builtin_prefetch(low_row(b, c0 + c + 8, hk) + d, 1);
          }
        for (int64_t d = 0; d < dim_padded; d += kLanes)
          split_halves(join_halves(high + d, lo + d) + load(y + d), high + d, lo + d);
      } else if (storage == Storage::kOutput && accumulate) {
        float* x = row(b, c0 + c, hk);
        for (int64_t d = 0; d < dim_padded; ++d) x[d] += y[d] * factor;
      } else {
        float* x = row(b, c0 + c, hk);
        for (int64_t d = 0; d < dim_padded; ++d) x[d] += y[d];
      }
    }
  }
  // Writes (or with accumulate adds) the sums to `out` (D values of a row), times factor; nothing
  // to do in the output with factor 1 or accumulate.
  void write(const AttnShape& sh, const BshdOutput& out, int64_t dim) const {
    if (storage == Storage::kNone || (storage == Storage::kOutput && (factor == 1.f || accumulate)))
      return;
    at::parallel_for(0, sh.batch * sh.seqlen_k * sh.kv_heads, 256, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / (sh.seqlen_k * sh.kv_heads), c = r / sh.kv_heads % sh.seqlen_k,
                      hk = r % sh.kv_heads;
        if (storage == Storage::kSplit) {  // rounded from the joined fp32 sums, in place
          uint16_t *high = high_row(b, c, hk), *lo = low_row(b, c, hk);
          for (int64_t d = 0; d < dim_padded; d += kLanes) {
            const vbits16 bits = bf16_bits(join_halves(high + d, lo + d) * factor);
            std::memcpy(high + d, &bits, sizeof(bits));
          }
        } else {
          const BshdStrides& o = out.strides;
          const int64_t offset = b * o.batch + c * o.seq + hk * o.head;
          if (accumulate && !resume)
            add_row(out, nullptr, offset, row(b, c, hk), factor, dim);
          else
            write_row(out, offset, row(b, c, hk), factor, dim);
        }
      }
    });
  }
};

// Packs query block `slot` of the fp32 band from rows r0.. (`rows` of them) of head h of batch
// b: Q^T scaled to base-2 scores, dO^T, and Q and dO as contiguous rows (read in place, their
// rows are H D apart: at power-of-two strides the products' row loads conflict in the cache).
inline void pack_query_block(const BwdParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                             int64_t slot, PackedBand<float>& out) {
  const int64_t dp = p.shape.head_dim_padded, dvp = p.shape.head_dim_v_padded;
  const BshdStrides &qs = p.q_strides, &ds = p.dout_strides;
  const float* q = p.q + b * qs.batch + r0 * qs.seq + h * qs.head;
  const float* dout = p.dout + b * ds.batch + r0 * ds.seq + h * ds.head;
  pack_transposed(q, qs.seq, rows, dp, p.softmax_scale * kLog2e, out.qt.at(slot));
  pack_transposed(dout, ds.seq, rows, dvp, 1.f, out.dot.at(slot));
  for (int64_t i = 0; i < rows; ++i) {
    std::copy(q + i * qs.seq, q + i * qs.seq + dp, out.q_rows.at(slot) + i * dp);
    std::copy(dout + i * ds.seq, dout + i * ds.seq + dvp, out.do_rows.at(slot) + i * dvp);
  }
  // zero rows past the last query: the brgemm path reduces over whole blocks (0 * NaN = NaN)
  std::fill(out.q_rows.at(slot) + rows * dp, out.q_rows.at(slot) + kBlockQ * dp, 0.f);
  std::fill(out.do_rows.at(slot) + rows * dvp, out.do_rows.at(slot) + kBlockQ * dvp, 0.f);
}

// P^T = exp2(S^T - lse) of a block's `seen` keys, in place in st (kBlockQ per key; reference:
// the rows' lse): the scores (base 2: Q was packed with the scale) modified and masked first;
// softcap_grad receives the softcap's derivative where there is one.
inline void backward_probs(const BwdParams& p, int64_t h, int64_t r0, int64_t rows, int64_t c0,
                           int64_t seen, BlockKind kind, float* softcap_grad,
                           const float* reference, float* st) {
  if (p.score.modifies_scores()) modify_scores(p.score, h, r0, c0, seen, 1.f, st, softcap_grad);
  if (kind == BlockKind::kPartial) apply_mask(p.mask, r0, rows, c0, seen, st);
  for (int64_t c = 0; c < seen; ++c)
    for (int64_t i = 0; i < kBlockQ; i += kLanes)
      store(st + c * kBlockQ + i, exp2(load(st + c * kBlockQ + i) - load(reference + i)));
}

// dS^T = P^T * (dP^T - delta) of a block's `seen` keys, in place in dpt (P^T in st), through the
// softcap where there is one (softcap_grad: its derivative, else null).
inline void score_grads(int64_t seen, const float* softcap_grad, const float* delta,
                        const float* st, float* dpt) {
  for (int64_t c = 0; c < seen; ++c)
    for (int64_t i = 0; i < kBlockQ; i += kLanes)
      store(dpt + c * kBlockQ + i,
            load(st + c * kBlockQ + i) * (load(dpt + c * kBlockQ + i) - load(delta + i)));
  if (softcap_grad) apply_softcap_grad(seen, softcap_grad, dpt);
}

// One key block of kv head hk against the current band's query blocks (rows packed.q0 to q1):
// the block's dK and dV contributions in s.dk and s.dv, and its dQ contributions added to
// dq_band, (B H, band rows, Dp). Returns whether any query block of the band sees the keys.
inline bool backward_key_block(const BwdParams& p, const PackedBand<float>& packed, int64_t b,
                               int64_t hk, int64_t c0, int64_t q1, float* dq_band, BwdScratch& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t cols = std::min(kBlockK, sh.seqlen_k - c0);
  float* softcap_grad = p.score.softcap > 0.f ? s.softcap_grad.get() : nullptr;
  const BshdStrides &ks = p.k_strides, &vs = p.v_strides;
  const float* k = p.k + b * ks.batch + c0 * ks.seq + hk * ks.head;
  const float* v = p.v + b * vs.batch + c0 * vs.seq + hk * vs.head;
  std::fill(s.dk.get(), s.dk.get() + kBlockK * dp, 0.f);
  std::fill(s.dv.get(), s.dv.get() + kBlockK * dvp, 0.f);
  alignas(64) float reference[kBlockQ], delta[kBlockQ];

  return for_each_query_block(
      p, b, hk, c0, cols, packed.q0, q1,
      [&](int64_t row_base, int64_t r0, int64_t rows, int64_t seen, BlockKind kind) {
        const int64_t h = head_of_row(sh, row_base);
        const int64_t slot = packed.slot(sh, row_base, r0);
        float* dq = dq_band + slot * kBlockQ * dp;
        load_row_stats(p, row_base + r0, rows, reference, delta);
        float* st = s.st.get();
        float* dpt = s.dpt.get();

        // P^T = exp2(K Q^T - lse)
        gemm(seen, kBlockQ, dp, k, ks.seq, 1, packed.qt.at(slot), kBlockQ, st, kBlockQ, false);
        backward_probs(p, h, r0, rows, c0, seen, kind, softcap_grad, reference, st);
        // dV += P^T dO
        if (p.dv.data)
          gemm(seen, dvp, rows, st, kBlockQ, 1, packed.do_rows.at(slot), dvp, s.dv.get(), dvp,
               true);
        // dP^T = V dO^T ; dS^T = P^T * (dP^T - delta)
        gemm(seen, kBlockQ, dvp, v, vs.seq, 1, packed.dot.at(slot), kBlockQ, dpt, kBlockQ, false);
        score_grads(seen, softcap_grad, delta, st, dpt);
        // dK += dS^T Q ; dQ += dS K   (softmax scale applied once at the end)
        if (p.dk.data)
          gemm(seen, dp, rows, dpt, kBlockQ, 1, packed.q_rows.at(slot), dp, s.dk.get(), dp, true);
        if (p.dq.data) gemm(rows, dp, seen, dpt, 1, kBlockQ, k, ks.seq, dq, dp, true);
      });
}

// The bytes backward_row_bands allocates for a call of shape sh whose operands are packed in
// elements of operand_bytes (bf16: 2, else 4) and whose dK and dV are wanted in grad: one
// band of query rows of every head packed (PackedBand: Q^T, dO^T, Q and dO rows), the band's
// fp32 dQ per key split, and the dK and dV sums beyond the gradients (KeyGradSums), all threads
// together; the per-thread Scratch blocks (about 0.2-0.3 MiB each) aside. The allocations take
// their sizes from the same functions; the memory model reads these bytes (cpattn.plan, through
// the op cpu_backward_buffer_bytes).
inline int64_t backward_buffer_bytes(const AttnShape& sh, int64_t operand_bytes, DType grad) {
  const int64_t rows = band_rows(sh), dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t packed = 2 * operand_bytes * (band_elems(sh, dp, rows) + band_elems(sh, dvp, rows));
  const int64_t dq = 4 * key_splits(sh) * band_elems(sh, dp, rows);
  const auto sums = [&](int64_t dim, int64_t padded) {
    return KeyGradSums::bytes_per_value(KeyGradSums::storage_for(true, dim, padded, grad)) *
           sh.batch * sh.seqlen_k * sh.kv_heads * padded;
  };
  return packed + dq + sums(sh.head_dim, dp) + sums(sh.head_dim_v, dvp);
}

// The backward, one band of query rows after another. Per band: (1) pack(p, b, h, r0, rows,
// slot, packed) packs the band's query blocks of every head; (2) a task per (batch, kv head)
// pair and split of the key blocks that the band sees runs key_block(p, packed, b, hk, c0, q1,
// dq, scratch) on each of its key blocks, adding dQ into its split's buffer and the block's dK /
// dV into their sums; (3) the splits' dQ are summed in split order and written. Then dK and dV
// are written. Every key block of a band is one task's and the bands run in order, so every
// sum has a fixed order: the same bits with any number of threads. Memory beyond the outputs:
// the band's packed blocks, splits x the band's dQ, and the sums when not in place. dQ may be
// dO itself (same strides): a band's dO rows are read when packed, before its dQ rows are
// written, and never again (attention_bwd_in_dout).
// Under fixed_order (invariant mode: the one flag it sets) dq, dk and dv are fp32 running sums,
// unscaled, that the call continues: each band's dQ starts from dq's rows, each band's dK / dV
// part is added to the sums, and nothing is scaled. So calls over consecutive parts of the keys
// (dQ) or of the queries (dK, dV), each starting at a multiple of kFixedBandRows (a multiple of
// kBlockK) from the first, give exactly the sums of one call (the rows of dQ and the keys of dK /
// dV may be split anywhere: each row's, each key's sum is its own); the caller scales once at the
// end (invariant mode's backward: ops/invariant.cpp).
// With dq_transposed, key_block adds dQ^T (Dp x kBlockQ per query block: the brgemm path's
// form), turned into rows before the splits are summed; not under fixed_order.
template <typename T, typename Scratch, typename Pack, typename KeyBlock>
inline void backward_row_bands(const BwdParams& p, Pack pack, KeyBlock key_block,
                               bool dq_transposed = false) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, group = sh.group_size();
  const int64_t rows_per_band = band_rows(sh);
  const int64_t heads = sh.batch * sh.heads, pairs = sh.batch * sh.kv_heads;
  const int64_t max_splits = key_splits(sh);
  const int64_t band_size = band_elems(sh, dp, rows_per_band);
  PackedBand<T> packed(sh, rows_per_band);
  AlignedArray<float> dq = aligned_array<float>(max_splits * band_size);
  const bool resume = sh.fixed_order;  // running sums (params.h AttnShape::fixed_order)
  const KeyGradSums dk(sh, p.dk, sh.head_dim, dp, p.softmax_scale, p.accumulate, resume),
      dv(sh, p.dv, sh.head_dim_v, sh.head_dim_v_padded, 1.f, p.accumulate, resume);
  for (int64_t q0 = 0; q0 < sh.seqlen_q; q0 += rows_per_band) {
    const int64_t q1 = std::min(sh.seqlen_q, q0 + rows_per_band);
    const int64_t blocks = (q1 - q0 + kBlockQ - 1) / kBlockQ;
    packed.q0 = q0;
    at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t bh = t / blocks, j = t % blocks, r0 = q0 + j * kBlockQ;
        pack(p, bh / sh.heads, bh % sh.heads, r0, std::min(kBlockQ, q1 - r0),
             bh * packed.blocks_per_band + j, packed);
      }
    });
    const PosRange keys = p.mask.key_span(q0, q1, sh.seqlen_k);
    const int64_t kb_first = keys.first / kBlockK;
    const int64_t kb_count = keys.empty() ? 0 : keys.last / kBlockK + 1 - kb_first;
    const int64_t splits = std::clamp<int64_t>(kb_count, 1, max_splits);
    // Tasks are taken in order by whichever thread is free (a thread on a shared core takes
    // fewer); which thread runs a task changes no bits.
    std::atomic<int64_t> next_task{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch scratch(sh);
      for (int64_t t; (t = next_task.fetch_add(1)) < pairs * splits;) {
        const int64_t pair = t / splits, split = t % splits;
        const int64_t b = pair / sh.kv_heads, hk = pair % sh.kv_heads;
        float* dq_split = dq.get() + split * band_size;
        float* own = dq_split + (b * sh.heads + hk * group) * rows_per_band * dp;
        std::fill(own, own + group * rows_per_band * dp, 0.f);
        if (resume && p.dq.data)  // the running sums of the band's rows (one split)
          for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
            for (int64_t i = 0; i < q1 - q0; ++i) {
              const float* src = static_cast<const float*>(p.dq.data) + b * p.dq.strides.batch +
                                 (q0 + i) * p.dq.strides.seq + h * p.dq.strides.head;
              std::copy(src, src + sh.head_dim, own + ((h - hk * group) * rows_per_band + i) * dp);
            }
        // every splits-th key block: a causal diagonal's partly masked blocks spread over splits
        for (int64_t kb = kb_first + split; kb < kb_first + kb_count; kb += splits) {
          const int64_t c0 = kb * kBlockK, cols = std::min(kBlockK, sh.seqlen_k - c0);
          if (!key_block(p, packed, b, hk, c0, q1, dq_split, scratch)) continue;
          dk.add(b, hk, c0, cols, scratch.dk.get());
          dv.add(b, hk, c0, cols, scratch.dv.get());
        }
      }
    });
    if (!p.dq.data) continue;  // no dQ wanted
    if (dq_transposed)
      at::parallel_for(0, splits * heads * blocks, 1, [&](int64_t begin, int64_t end) {
        AlignedArray<float> rows = aligned_array<float>(kBlockQ * dp);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t split = t / (heads * blocks), bh = t / blocks % heads, j = t % blocks;
          float* block =
              dq.get() + split * band_size + (bh * packed.blocks_per_band + j) * kBlockQ * dp;
          for (int64_t d = 0; d < dp; ++d)
            for (int64_t i = 0; i < kBlockQ; ++i) rows[i * dp + d] = block[d * kBlockQ + i];
          std::copy(rows.get(), rows.get() + kBlockQ * dp, block);
        }
      });
    at::parallel_for(0, heads * (q1 - q0), 64, [&](int64_t begin, int64_t end) {
      const BshdStrides& o = p.dq.strides;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t bh = r / (q1 - q0), i = r % (q1 - q0);
        float* row = dq.get() + (bh * rows_per_band + i) * dp;
        for (int64_t split = 1; split < splits; ++split)
          for (int64_t d = 0; d < dp; ++d) row[d] += row[split * band_size + d];
        const int64_t offset = bh / sh.heads * o.batch + (q0 + i) * o.seq + bh % sh.heads * o.head;
        if (resume)
          write_row(p.dq, offset, row, 1.f, sh.head_dim);
        else if (p.accumulate)
          add_row(p.dq, p.dq_low, offset, row, p.softmax_scale, sh.head_dim);
        else
          write_row(p.dq, offset, row, p.softmax_scale, sh.head_dim);
      }
    });
  }
  dk.write(sh, p.dk, sh.head_dim);
  dv.write(sh, p.dv, sh.head_dim_v);
}

inline void attention_bwd_impl(const BwdParams& p) {
  backward_row_bands<float, BwdScratch>(p, pack_query_block, backward_key_block);
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
