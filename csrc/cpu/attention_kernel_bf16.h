// Forward and backward attention on bf16 operands with AVX-512 bf16 dot products (vdpbf16ps: each
// fp32 lane adds the products of one pair of bf16 values), fp32 accumulation. Same algorithm and
// online softmax as the fp32 kernel (attention_kernel.h); only the two products differ:
//   S^T = K Q^T  with Q^T packed per query block as (d pairs) x queries x 2,
//   O  += P V    with P rounded to bf16 and packed as (key pairs) x queries x 2, and V packed by
//                the op layer as (key pairs) x d x 2.
// Pairs run along the reduction dim, so one broadcast 32-bit A element and one 64-byte B vector
// feed 32 multiply-adds.
#pragma once

#include <immintrin.h>

#include "cpu/attention_kernel.h"

#ifndef __AVX512BF16__
#error "attention_kernel_bf16.h needs -mavx512bf16"
#endif

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

// C[MR x 16 NV] (+)= sum over pairs p: A pair (m, p) . B pair row p. A pair (m, p) is the two
// bf16 at A + m * a_row + p * a_pair; B pair row p is 16 NV pairs at B + p * ldb.
template <int MR, int NV>
inline void micro_kernel_bf16(int64_t pairs, const uint16_t* A, int64_t a_row, int64_t a_pair,
                              const uint16_t* B, int64_t ldb, float* C, int64_t ldc,
                              bool accumulate, const float* c_row_scale) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const __m512 f = _mm512_set1_ps(c_row_scale ? c_row_scale[m] : 1.f);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[m][v] = accumulate ? _mm512_mul_ps(_mm512_loadu_ps(C + m * ldc + v * kLanes), f)
                             : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + v * 2 * kLanes);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, A + m * a_row + p * a_pair, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + m * ldc + v * kLanes, acc[m][v]);
}

using MicroKernelBf16Fn = void (*)(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,
                                   int64_t, float*, int64_t, bool, const float*);

template <int... Ms>
struct MicroKernelBf16Table {
  template <int M, int... Vs>
  static constexpr auto row(std::integer_sequence<int, Vs...>) {
    return std::array<MicroKernelBf16Fn, sizeof...(Vs)>{&micro_kernel_bf16<M, Vs + 1>...};
  }
  static constexpr std::array<std::array<MicroKernelBf16Fn, CPATTN_NV>, sizeof...(Ms)> table{
      row<Ms + 1>(std::make_integer_sequence<int, CPATTN_NV>{})...};
};
template <int... Ms>
constexpr auto make_table_bf16(std::integer_sequence<int, Ms...>) {
  return MicroKernelBf16Table<Ms...>::table;
}
inline constexpr auto kMicroKernelsBf16 =
    make_table_bf16(std::make_integer_sequence<int, CPATTN_MR>{});

// C[M x N] (+)= A[M x 2 pairs] B[2 pairs x N]; N a multiple of 16; ldb in bf16 elements;
// c_row_scale as in gemm (micro_gemm.h).
inline void gemm_bf16(int64_t M, int64_t N, int64_t pairs, const uint16_t* A, int64_t a_row,
                      int64_t a_pair, const uint16_t* B, int64_t ldb, float* C, int64_t ldc,
                      bool accumulate, const float* c_row_scale = nullptr) {
  constexpr int64_t kTileN = CPATTN_NV * kLanes;
  for (int64_t n0 = 0; n0 < N; n0 += kTileN) {
    const int64_t nv = (N - n0 >= kTileN) ? CPATTN_NV : (N - n0) / kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += CPATTN_MR) {
      const int64_t mr = (M - m0 >= CPATTN_MR) ? CPATTN_MR : M - m0;
      kMicroKernelsBf16[mr - 1][nv - 1](pairs, A + m0 * a_row, a_row, a_pair, B + 2 * n0, ldb,
                                        C + m0 * ldc + n0, ldc, accumulate,
                                        c_row_scale ? c_row_scale + m0 : nullptr);
    }
  }
}

// Transposes a 16 x 16 matrix of 32-bit words held as 16 row registers: afterwards r[c] holds
// column c. Two rounds of in-lane unpacks, then two of 128-bit lane shuffles.
inline void transpose_16x16_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j], lane L: column 4L + j of rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // gather lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512i lo01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i hi01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
    const __m512i lo23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i hi23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
    t[j] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);       // column j
    t[4 + j] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);   // column 4 + j
    t[8 + j] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);   // column 8 + j
    t[12 + j] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd);  // column 12 + j
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// qt[(d / 2) * 2 kBlockQ + 2 i + d % 2] = q[i][d]: Q^T of a query block as d pairs, from rows of
// `dim` values `row_stride` apart; d >= dim and padded queries are 0. A row's d pair is one
// 32-bit word, so this is a transpose of 32-bit words, done in 16 x 16 tiles.
inline void pack_pairs_transposed(const uint16_t* q, int64_t row_stride, int64_t rows, int64_t dim,
                                  int64_t dp, uint16_t* qt) {
  for (int64_t i0 = 0; i0 < kBlockQ; i0 += kLanes)
    for (int64_t j0 = 0; j0 < dp / 2; j0 += 16) {
      const int64_t n = std::clamp<int64_t>(dim - 2 * j0, 0, 32);  // values of a row in the tile
      const __mmask32 valid = n == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
      __m512i tile[16];
      for (int64_t i = 0; i < kLanes; ++i)
        tile[i] = i0 + i < rows
                      ? _mm512_maskz_loadu_epi16(valid, q + (i0 + i) * row_stride + 2 * j0)
                      : _mm512_setzero_si512();
      transpose_16x16_words(tile);
      for (int64_t j = 0; j < 16 && j0 + j < dp / 2; ++j)
        _mm512_storeu_si512(qt + 2 * ((j0 + j) * kBlockQ + i0), tile[j]);
    }
}

// Stores probabilities of keys c and c + 1 (c even) for queries i..i+15 as bf16 key pairs:
// pairs[(c / 2) * 2 kBlockQ + 2 (i + l) + {0, 1}] = p0[l], p1[l], the A operand of O += P V.
inline void store_key_pair(uint16_t* pairs, int64_t c, int64_t i, vfloat p0, vfloat p1) {
  // interleave the two 16-lane halves: lane 2l <- p0 lane l, lane 2l+1 <- p1 lane l
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0);  // p0 low, p1 high
  _mm512_storeu_si512(pairs + (c / 2) * 2 * kBlockQ + 2 * i,
                      _mm512_permutexvar_epi16(interleave, both));
}

// bf16 copy of 16 fp32 lanes.
inline void store_bf16(uint16_t* out, vfloat x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh((__m512)x));
}

struct FwdScratchBf16 {
  AlignedArray<uint16_t> qt, pp;  // qt and acc: one per query block of a group
  AlignedArray<float> st, acc;
  explicit FwdScratchBf16(const AttnShape& sh)
      : qt(aligned_array<uint16_t>(kMaxQueryBlocksPerTask * sh.head_dim_padded * kBlockQ)),
        pp(aligned_array<uint16_t>(kBlockK * kBlockQ)),
        st(aligned_array<float>(kBlockK * kBlockQ)),
        acc(aligned_array<float>(kMaxQueryBlocksPerTask * kBlockQ * sh.head_dim_v_padded)) {}
};

// pack_query_scaled (attention_kernel.h) on bf16 operands: Q rows r0.. of head h of batch b as
// pairs of dims, transposed, unscaled (the scale is applied to the scores).
inline void pack_query_pairs(const FwdParams& p, int64_t b, int64_t h, int64_t r0, int64_t rows,
                             uint16_t* qt) {
  const BshdStrides& qs = p.q16_strides;
  pack_pairs_transposed(p.q16 + b * qs.batch + r0 * qs.seq + h * qs.head, qs.seq, rows,
                        p.shape.head_dim, p.shape.head_dim_padded, qt);
}

// scores_to_probs (attention_kernel.h) for unscaled scores: modified (to base 2) and masked in
// st, then the online softmax's P stored as bf16 key pairs in pp.
inline void scores_to_prob_pairs(const FwdParams& p, int64_t h, int64_t r0, int64_t rows,
                                 int64_t c0, int64_t cols, BlockKind kind, OnlineSoftmaxRow* state,
                                 float* factor, float* st, uint16_t* pp) {
  const bool modified = p.score.modifies_scores();
  const float scale = p.softmax_scale * kLog2e;
  if (modified) modify_scores(p.score, h, r0, c0, cols, scale, st, nullptr);
  if (kind == BlockKind::kPartial) apply_mask(p.mask, r0, rows, c0, cols, st);
  // modify_scores leaves base-2 logits, which the softmax then takes as they are
  softmax_block(
      st, cols, modified ? 1.f : scale, state, factor,
      [&](int64_t c, int64_t i, vfloat p0, vfloat p1) { store_key_pair(pp, c, i, p0, p1); });
}

// forward_blocks (attention_kernel.h) with both products on bf16 operands.
inline void forward_blocks_bf16(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                                int64_t qb_end, FwdScratchBf16& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t hk = h / sh.group_size();
  const int64_t key_pairs = (sh.seqlen_k + 1) / 2;
  const uint16_t* k = p.k16 + (b * sh.kv_heads + hk) * sh.seqlen_k * dp;
  const uint16_t* v = p.v16 + (b * sh.kv_heads + hk) * key_pairs * dvp * 2;
  forward_group(p, b, h, qb_begin, qb_end, s, pack_query_pairs,
                [&](const uint16_t* qt, int64_t r0, int64_t rows, int64_t c0, int64_t cols,
                    BlockKind kind, OnlineSoftmaxRow* state, float* acc, float* factor) {
                  float* st = s.st.get();
                  uint16_t* pp = s.pp.get();
                  gemm_bf16(cols, kBlockQ, dp / 2, k + c0 * dp, dp, 2, qt, 2 * kBlockQ, st, kBlockQ,
                            false);
                  scores_to_prob_pairs(p, h, r0, rows, c0, cols, kind, state, factor, st, pp);
                  // O[rows x Dvp] = factor * O + P[rows x cols] V[cols x Dvp]; c0 is even, so V's
                  // pairs start at c0 / 2.
                  gemm_bf16(rows, dvp, (cols + 1) / 2, pp, 2, 2 * kBlockQ, v + c0 * dvp, 2 * dvp,
                            acc, dvp, true, factor);
                });
}

inline void attention_fwd_bf16_impl(const FwdParams& p) {
  for_each_query_group<FwdScratchBf16>(
      p, sizeof(uint16_t),
      [&](int64_t b, int64_t h, int64_t qb_begin, int64_t qb_end, FwdScratchBf16& scratch) {
        forward_blocks_bf16(p, b, h, qb_begin, qb_end, scratch);
      });
}

// out[(i / 2) * 2 dp + 2 d + i % 2] = x[i][d]: a block of rows (of `dim` values, `row_stride`
// apart) as row pairs, the reduction dim of P^T dO and dS^T Q; d >= dim and a row completing an
// odd count are 0.
inline void pack_row_pairs(const uint16_t* x, int64_t row_stride, int64_t rows, int64_t dim,
                           int64_t dp, uint16_t* out) {
  // interleave a (row i) and b (row i + 1), 16 d at a time: lane 2l <- a[l], 2l + 1 <- b[l]
  alignas(64) int16_t low[32], high[32];
  for (int l = 0; l < 16; ++l) {
    low[2 * l] = static_cast<int16_t>(l), low[2 * l + 1] = static_cast<int16_t>(32 + l);
    high[2 * l] = static_cast<int16_t>(16 + l), high[2 * l + 1] = static_cast<int16_t>(48 + l);
  }
  const __m512i low_index = _mm512_load_si512(low), high_index = _mm512_load_si512(high);
  for (int64_t i = 0; i < rows; i += 2) {
    uint16_t* dst = out + i * dp;  // row pair i / 2 starts at (i / 2) * 2 dp
    for (int64_t d0 = 0; d0 < dp; d0 += 32) {
      const int64_t n = std::clamp<int64_t>(dim - d0, 0, 32);
      const __mmask32 valid = n == 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(valid, x + i * row_stride + d0);
      const __m512i b = i + 1 < rows
                            ? _mm512_maskz_loadu_epi16(valid, x + (i + 1) * row_stride + d0)
                            : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d0, _mm512_permutex2var_epi16(a, low_index, b));
      if (d0 + 16 < dp)
        _mm512_storeu_si512(dst + 2 * d0 + 32, _mm512_permutex2var_epi16(a, high_index, b));
    }
  }
}

// The fp32 backward's blocks, and the bf16 copies the bf16 dot products read.
struct BwdScratchBf16 : BwdScratch {
  AlignedArray<uint16_t> p16, ds16, ds_pairs, k_rows, v_rows;
  explicit BwdScratchBf16(const AttnShape& sh)
      : BwdScratch(sh),
        p16(aligned_array<uint16_t>(kBlockK * kBlockQ)),
        ds16(aligned_array<uint16_t>(kBlockK * kBlockQ)),
        ds_pairs(aligned_array<uint16_t>(kBlockK * kBlockQ)),
        k_rows(aligned_array<uint16_t>(kBlockK * sh.head_dim_padded)),
        v_rows(aligned_array<uint16_t>(kBlockK * sh.head_dim_v_padded)) {}
};

// The rows of a key block, `stride` apart, as contiguous rows of `dim` values in `out`; the rows
// themselves when they already are. Read in place, K and V rows are H D values apart, and rows
// at such strides meet in a few L1 sets while every query block of the band reuses them.
inline const uint16_t* block_rows(const uint16_t* x, int64_t stride, int64_t rows, int64_t dim,
                                  uint16_t* out) {
  if (stride == dim) return x;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; d += 16)  // dim is a multiple of 16: 32-byte moves, inlined
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * dim + d),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * stride + d)));
  return out;
}

// Packs query block `slot` of the bf16 band from rows r0.. (`rows` of them) of head h of batch
// b: Q^T and dO^T as d pairs, Q and dO as row pairs.
inline void pack_query_block_bf16(const BwdParams& p, int64_t b, int64_t h, int64_t r0,
                                  int64_t rows, int64_t slot, PackedBand<uint16_t>& out) {
  const AttnShape& sh = p.shape;
  const BshdStrides &qs = p.q16_strides, &ds = p.dout16_strides;
  const uint16_t* q = p.q16 + b * qs.batch + r0 * qs.seq + h * qs.head;
  const uint16_t* dout = p.dout16 + b * ds.batch + r0 * ds.seq + h * ds.head;
  pack_pairs_transposed(q, qs.seq, rows, sh.head_dim, sh.head_dim_padded, out.qt.at(slot));
  pack_pairs_transposed(dout, ds.seq, rows, sh.head_dim_v, sh.head_dim_v_padded, out.dot.at(slot));
  pack_row_pairs(q, qs.seq, rows, sh.head_dim, sh.head_dim_padded, out.q_rows.at(slot));
  pack_row_pairs(dout, ds.seq, rows, sh.head_dim_v, sh.head_dim_v_padded, out.do_rows.at(slot));
  // zero the row pairs past the last query: the brgemm path reduces over whole blocks
  const int64_t written = (rows + 1) / 2 * 2;
  std::fill(out.q_rows.at(slot) + written * sh.head_dim_padded,
            out.q_rows.at(slot) + kBlockQ * sh.head_dim_padded, uint16_t{0});
  std::fill(out.do_rows.at(slot) + written * sh.head_dim_v_padded,
            out.do_rows.at(slot) + kBlockQ * sh.head_dim_v_padded, uint16_t{0});
}

// backward_probs (attention_kernel.h) for unscaled scores: P^T = exp2(scale S^T - lse) of a
// block's `seen` keys, kept in fp32 in st (for dS) and in bf16 in p16 (for dV).
inline void backward_probs_bf16(const BwdParams& p, int64_t h, int64_t r0, int64_t rows, int64_t c0,
                                int64_t seen, BlockKind kind, float* softcap_grad,
                                const float* reference, float* st, uint16_t* p16) {
  const bool modified = p.score.modifies_scores();
  const float base2 = p.softmax_scale * kLog2e;
  if (modified) modify_scores(p.score, h, r0, c0, seen, base2, st, softcap_grad);
  if (kind == BlockKind::kPartial) apply_mask(p.mask, r0, rows, c0, seen, st);
  // modify_scores leaves base-2 logits, which exp2 then takes as they are
  const vfloat scale = broadcast(modified ? 1.f : base2);
  for (int64_t c = 0; c < seen; ++c)
    for (int64_t i = 0; i < kBlockQ; i += kLanes) {
      const int64_t e = c * kBlockQ + i;
      const vfloat pr = exp2(load(st + e) * scale - load(reference + i));
      store(st + e, pr);
      store_bf16(p16 + e, pr);
    }
}

// score_grads (attention_kernel.h) in bf16: dS^T = P^T * (dP^T - delta) of a block's `seen` keys,
// as is (ds16, for dK) and as key pairs (ds_pairs, for dQ); the softcap's chain rule (where
// softcap_grad is not null) folded into P, st, first.
inline void score_grads_bf16(int64_t seen, const float* softcap_grad, const float* delta, float* st,
                             const float* dpt, uint16_t* ds16, uint16_t* ds_pairs) {
  if (softcap_grad) {
    for (int64_t e = 0; e < seen * kBlockQ; e += kLanes)
      store(st + e, load(st + e) * load(softcap_grad + e));
  }
  for (int64_t c = 0; c < seen; c += 2)
    for (int64_t i = 0; i < kBlockQ; i += kLanes) {
      const int64_t e = c * kBlockQ + i;
      const vfloat ds0 = load(st + e) * (load(dpt + e) - load(delta + i));
      store_bf16(ds16 + e, ds0);
      vfloat ds1{};
      if (c + 1 < seen) {
        ds1 = load(st + e + kBlockQ) * (load(dpt + e + kBlockQ) - load(delta + i));
        store_bf16(ds16 + e + kBlockQ, ds1);
      }
      store_key_pair(ds_pairs, c, i, ds0, ds1);
    }
}

// backward_key_block (attention_kernel.h) with the five products on bf16 operands.
inline bool backward_key_block_bf16(const BwdParams& p, const PackedBand<uint16_t>& packed,
                                    int64_t b, int64_t hk, int64_t c0, int64_t q1, float* dq_band,
                                    BwdScratchBf16& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t cols = std::min(kBlockK, sh.seqlen_k - c0);
  const int64_t key_pairs = (sh.seqlen_k + 1) / 2;
  const BshdStrides &ks = p.k16_strides, &vs = p.v16_strides;
  const uint16_t* k = block_rows(p.k16 + b * ks.batch + c0 * ks.seq + hk * ks.head, ks.seq, cols,
                                 dp, s.k_rows.get());
  const uint16_t* v = block_rows(p.v16 + b * vs.batch + c0 * vs.seq + hk * vs.head, vs.seq, cols,
                                 dvp, s.v_rows.get());
  const uint16_t* k_pairs =  // none without dQ
      p.k16_pairs ? p.k16_pairs + ((b * sh.kv_heads + hk) * key_pairs + c0 / 2) * dp * 2 : nullptr;
  std::fill(s.dk.get(), s.dk.get() + kBlockK * dp, 0.f);
  std::fill(s.dv.get(), s.dv.get() + kBlockK * dvp, 0.f);
  alignas(64) float reference[kBlockQ], delta[kBlockQ];
  float* softcap_grad = p.score.softcap > 0.f ? s.softcap_grad.get() : nullptr;

  return for_each_query_block(
      p, b, hk, c0, cols, packed.q0, q1,
      [&](int64_t row_base, int64_t r0, int64_t rows, int64_t seen, BlockKind kind) {
        const int64_t slot = packed.slot(sh, row_base, r0);
        float* dq = dq_band + slot * kBlockQ * dp;
        load_row_stats(p, row_base + r0, rows, reference, delta);
        const int64_t row_pairs = (rows + 1) / 2;
        float* st = s.st.get();
        float* dpt = s.dpt.get();
        uint16_t* p16 = s.p16.get();
        uint16_t* ds16 = s.ds16.get();

        // P^T = exp2(scale K Q^T - lse), kept in fp32 for dS and in bf16 for dV
        gemm_bf16(seen, kBlockQ, dp / 2, k, dp, 2, packed.qt.at(slot), 2 * kBlockQ, st, kBlockQ,
                  false);
        backward_probs_bf16(p, head_of_row(sh, row_base), r0, rows, c0, seen, kind, softcap_grad,
                            reference, st, p16);
        // dV += P^T dO
        if (p.dv.data)
          gemm_bf16(seen, dvp, row_pairs, p16, kBlockQ, 2, packed.do_rows.at(slot), 2 * dvp,
                    s.dv.get(), dvp, true);
        // dP^T = V dO^T ; dS^T = P^T * (dP^T - delta), in bf16 both as is (for dK) and as key pairs
        // (for dQ)
        gemm_bf16(seen, kBlockQ, dvp / 2, v, dvp, 2, packed.dot.at(slot), 2 * kBlockQ, dpt, kBlockQ,
                  false);
        score_grads_bf16(seen, softcap_grad, delta, st, dpt, ds16, s.ds_pairs.get());
        // dK += dS^T Q ; dQ += dS K   (softmax scale applied once at the end)
        if (p.dk.data)
          gemm_bf16(seen, dp, row_pairs, ds16, kBlockQ, 2, packed.q_rows.at(slot), 2 * dp,
                    s.dk.get(), dp, true);
        if (p.dq.data)
          gemm_bf16(rows, dp, (seen + 1) / 2, s.ds_pairs.get(), 2, 2 * kBlockQ, k_pairs, 2 * dp, dq,
                    dp, true);
      });
}

inline void attention_bwd_bf16_impl(const BwdParams& p) {
  backward_row_bands<uint16_t, BwdScratchBf16>(p, pack_query_block_bf16, backward_key_block_bf16);
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
