// The brgemm kernel path: the fused attention kernel of attention_kernel.h (and, with bf16 dot
// products, attention_kernel_bf16.h) with its matrix products through oneDNN's brgemm
// (onednn_gemm.h), which runs them on AMX tiles where the CPU has them. Same blocks, masks,
// score options, online softmax and sums as the micro-kernel path, whose pieces it reuses; only
// the products change, into the form brgemm takes (A row-major, B row-major or in VNNI pairs):
//   forward   S^T = K Q^T            as before (B: Q^T, packed per query block)
//             O^T += V^T P^T         the accumulator transposed (Dvp x queries), V^T in panels of
//                                    one key block packed once per call (FwdParams::vt / vt16),
//                                    P^T the softmax's own block (fp32, or bf16 key pairs)
//   backward  S^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q   as before
//             dQ^T += K^T dS^T       K^T of the key block transposed once per task and band
// Key counts of a block are rounded up to kKeyRound over zeroed operands, so that each thread
// generates a handful of kernel shapes, and query blocks are reduced over whole (zero-padded)
// blocks. Every parallel task holds an onednn::TaskGuard (tile state released at both ends).
#pragma once

#include "cpu/attention_kernel.h"
#include "cpu/onednn_gemm.h"

namespace cpattn::cpu {
namespace CPATTN_CPU_ISA {

constexpr int64_t kKeyRound = 32;  // AMX reduces bf16 in 32-deep steps; rows go in 16s
static_assert(kBlockK % kKeyRound == 0);

inline int64_t round_keys(int64_t n) { return (n + kKeyRound - 1) / kKeyRound * kKeyRound; }

// The products, for either operand type (bf16: B in VNNI pairs, see onednn_gemm.h).
inline void brgemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                   int64_t ldb, float* C, int64_t ldc, bool add_c) {
  onednn::gemm_f32(M, N, K, A, lda, B, ldb, C, ldc, add_c);
}
inline void brgemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                   const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool add_c) {
  onednn::gemm_bf16(M, N, K, A, lda, B, ldb, C, ldc, add_c);
}

// Multiplies column i of an O^T block (Dvp rows of kBlockQ) by factor[i], the online softmax's
// rescale; nothing when no row's maximum grew.
inline void scale_columns(float* acc, int64_t dvp, const float* factor) {
  constexpr int kVectors = kBlockQ / kLanes;
  vfloat f[kVectors];
  bool all_one = true;
  for (int v = 0; v < kVectors; ++v) {
    f[v] = load(factor + v * kLanes);
    for (int l = 0; l < kLanes; ++l) all_one &= f[v][l] == 1.f;
  }
  if (all_one) return;
  for (int64_t d = 0; d < dvp; ++d)
    for (int v = 0; v < kVectors; ++v)
      store(acc + d * kBlockQ + v * kLanes, load(acc + d * kBlockQ + v * kLanes) * f[v]);
}

// The key rows c0 .. c0 + m of one head's K (rows of dp values): read in place, or from a
// zero-padded copy where m (cols rounded up) would run past the head's last key.
template <typename T>
inline const T* key_rows(const T* k, int64_t seqlen_k, int64_t dp, int64_t c0, int64_t cols,
                         int64_t m, T* copy) {
  if (c0 + m <= seqlen_k) return k + c0 * dp;
  std::copy(k + c0 * dp, k + (c0 + cols) * dp, copy);
  std::fill(copy + cols * dp, copy + m * dp, T{0});
  return copy;
}

template <typename T>
struct FwdScratchBrgemm {
  onednn::TaskGuard tiles;
  AlignedArray<T> qt, keys;
  AlignedArray<uint16_t> pp;  // bf16: P^T as key pairs
  AlignedArray<float> st, acc, rows;
  explicit FwdScratchBrgemm(const AttnShape& sh)
      : qt(aligned_array<T>(kMaxQueryBlocksPerTask * sh.head_dim_padded * kBlockQ)),
        keys(aligned_array<T>(kBlockK * sh.head_dim_padded)),
        pp(aligned_array<uint16_t>(sizeof(T) == 2 ? kBlockK * kBlockQ : 0)),
        st(aligned_array<float>(kBlockK * kBlockQ)),
        acc(aligned_array<float>(kMaxQueryBlocksPerTask * kBlockQ * sh.head_dim_v_padded)),
        rows(aligned_array<float>(kBlockQ * sh.head_dim_v_padded)) {}
};

// Query blocks [qb_begin, qb_end) of head h of batch b (forward_blocks, attention_kernel.h).
inline void forward_blocks_brgemm(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                                  int64_t qb_end, FwdScratchBrgemm<float>& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t hk = h / sh.group_size(), panels = (sh.seqlen_k + kBlockK - 1) / kBlockK;
  const float* k = p.k + (b * sh.kv_heads + hk) * sh.seqlen_k * dp;
  const float* vt = p.vt + (b * sh.kv_heads + hk) * panels * dvp * kBlockK;
  forward_group(
      p, b, h, qb_begin, qb_end, s, pack_query_scaled,
      [&](const float* qt, int64_t r0, int64_t rows, int64_t c0, int64_t cols, BlockKind kind,
          OnlineSoftmaxRow* state, float* acc, float* factor) {
        const int64_t m = round_keys(cols);
        float* st = s.st.get();
        brgemm(m, kBlockQ, dp, key_rows(k, sh.seqlen_k, dp, c0, cols, m, s.keys.get()), dp, qt,
               kBlockQ, st, kBlockQ, false);
        scores_to_probs(p, h, r0, rows, c0, cols, kind, state, factor, st);
        std::fill(st + cols * kBlockQ, st + m * kBlockQ, 0.f);  // the rounded-up keys: P = 0
        // O^T = factor * O^T + V^T P^T
        scale_columns(acc, dvp, factor);
        brgemm(dvp, kBlockQ, m, vt + c0 / kBlockK * dvp * kBlockK, kBlockK, st, kBlockQ, acc,
               kBlockQ, true);
      },
      s.rows.get());
}

template <typename T>
struct BwdScratchBrgemm : BwdScratch {
  onednn::TaskGuard tiles;
  AlignedArray<T> k_rows, v_rows, kt;  // the key block's K and V rows, and K^T (Dp x kBlockK)
  AlignedArray<uint16_t> p16, ds16, ds_pairs;  // bf16: P^T, dS^T, and dS^T as key pairs
  explicit BwdScratchBrgemm(const AttnShape& sh)
      : BwdScratch(sh),
        k_rows(aligned_array<T>(kBlockK * sh.head_dim_padded)),
        v_rows(aligned_array<T>(kBlockK * sh.head_dim_v_padded)),
        kt(aligned_array<T>(sh.head_dim_padded * kBlockK)),
        p16(aligned_array<uint16_t>(sizeof(T) == 2 ? kBlockK * kBlockQ : 0)),
        ds16(aligned_array<uint16_t>(sizeof(T) == 2 ? kBlockK * kBlockQ : 0)),
        ds_pairs(aligned_array<uint16_t>(sizeof(T) == 2 ? kBlockK * kBlockQ : 0)) {}
};

// The rows of a key block (`cols` rows of dim values, `stride` apart) into `out`, contiguous,
// zero up to `padded` rows; with kt, K^T too (dim x kBlockK), for dQ^T = K^T dS^T.
template <typename T>
inline void load_key_block(const T* x, int64_t stride, int64_t cols, int64_t padded, int64_t dim,
                           T* out, T* kt) {
  for (int64_t c = 0; c < cols; ++c) std::copy(x + c * stride, x + c * stride + dim, out + c * dim);
  std::fill(out + cols * dim, out + padded * dim, T{0});
  if (!kt) return;
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t c = 0; c < padded; ++c) kt[d * kBlockK + c] = out[c * dim + d];
}

// The start of a key block's backward (k and v: the tensors, ks and vs: their strides): its K and
// V rows loaded into s (K^T too where dQ is wanted), its dK and dV sums cleared.
template <typename T>
inline void load_key_block_pair(const BwdParams& p, const T* k, const BshdStrides& ks, const T* v,
                                const BshdStrides& vs, int64_t b, int64_t hk, int64_t c0,
                                int64_t cols, BwdScratchBrgemm<T>& s) {
  const int64_t dp = p.shape.head_dim_padded, dvp = p.shape.head_dim_v_padded;
  const int64_t padded = round_keys(cols);
  load_key_block(k + b * ks.batch + c0 * ks.seq + hk * ks.head, ks.seq, cols, padded, dp,
                 s.k_rows.get(), p.dq.data ? s.kt.get() : nullptr);
  load_key_block(v + b * vs.batch + c0 * vs.seq + hk * vs.head, vs.seq, cols, padded, dvp,
                 s.v_rows.get(), static_cast<T*>(nullptr));
  std::fill(s.dk.get(), s.dk.get() + kBlockK * dp, 0.f);
  std::fill(s.dv.get(), s.dv.get() + kBlockK * dvp, 0.f);
}

// backward_key_block (attention_kernel.h) with the products through brgemm; dq_band's blocks
// hold dQ^T (backward_row_bands' dq_transposed).
inline bool backward_key_block_brgemm(const BwdParams& p, const PackedBand<float>& packed,
                                      int64_t b, int64_t hk, int64_t c0, int64_t q1, float* dq_band,
                                      BwdScratchBrgemm<float>& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t cols = std::min(kBlockK, sh.seqlen_k - c0);
  float* softcap_grad = p.score.softcap > 0.f ? s.softcap_grad.get() : nullptr;
  load_key_block_pair(p, p.k, p.k_strides, p.v, p.v_strides, b, hk, c0, cols, s);
  alignas(64) float reference[kBlockQ], delta[kBlockQ];

  return for_each_query_block(
      p, b, hk, c0, cols, packed.q0, q1,
      [&](int64_t row_base, int64_t r0, int64_t rows, int64_t seen, BlockKind kind) {
        const int64_t h = head_of_row(sh, row_base);
        const int64_t slot = packed.slot(sh, row_base, r0), m = round_keys(seen);
        float* dq = dq_band + slot * kBlockQ * dp;
        load_row_stats(p, row_base + r0, rows, reference, delta);
        float* st = s.st.get();
        float* dpt = s.dpt.get();

        // P^T = exp2(K Q^T - lse); 0 for the rounded-up keys
        brgemm(m, kBlockQ, dp, s.k_rows.get(), dp, packed.qt.at(slot), kBlockQ, st, kBlockQ, false);
        backward_probs(p, h, r0, rows, c0, seen, kind, softcap_grad, reference, st);
        std::fill(st + seen * kBlockQ, st + m * kBlockQ, 0.f);
        // dV += P^T dO
        if (p.dv.data)
          brgemm(m, dvp, kBlockQ, st, kBlockQ, packed.do_rows.at(slot), dvp, s.dv.get(), dvp, true);
        // dP^T = V dO^T ; dS^T = P^T * (dP^T - delta), 0 for the rounded-up keys
        brgemm(m, kBlockQ, dvp, s.v_rows.get(), dvp, packed.dot.at(slot), kBlockQ, dpt, kBlockQ,
               false);
        score_grads(seen, softcap_grad, delta, st, dpt);
        std::fill(dpt + seen * kBlockQ, dpt + m * kBlockQ, 0.f);
        // dK += dS^T Q ; dQ^T += K^T dS^T   (softmax scale applied once at the end)
        if (p.dk.data)
          brgemm(m, dp, kBlockQ, dpt, kBlockQ, packed.q_rows.at(slot), dp, s.dk.get(), dp, true);
        if (p.dq.data) brgemm(dp, kBlockQ, m, s.kt.get(), kBlockK, dpt, kBlockQ, dq, kBlockQ, true);
      });
}

#ifdef CPATTN_CPU_BF16_DOT

// forward_blocks_bf16 (attention_kernel_bf16.h) with the products through brgemm.
inline void forward_blocks_brgemm_bf16(const FwdParams& p, int64_t b, int64_t h, int64_t qb_begin,
                                       int64_t qb_end, FwdScratchBrgemm<uint16_t>& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t hk = h / sh.group_size(), panels = (sh.seqlen_k + kBlockK - 1) / kBlockK;
  const uint16_t* k = p.k16 + (b * sh.kv_heads + hk) * sh.seqlen_k * dp;
  const uint16_t* vt = p.vt16 + (b * sh.kv_heads + hk) * panels * dvp * kBlockK;
  forward_group(
      p, b, h, qb_begin, qb_end, s, pack_query_pairs,
      [&](const uint16_t* qt, int64_t r0, int64_t rows, int64_t c0, int64_t cols, BlockKind kind,
          OnlineSoftmaxRow* state, float* acc, float* factor) {
        const int64_t m = round_keys(cols);
        float* st = s.st.get();
        uint16_t* pp = s.pp.get();
        brgemm(m, kBlockQ, dp, key_rows(k, sh.seqlen_k, dp, c0, cols, m, s.keys.get()), dp, qt,
               kBlockQ, st, kBlockQ, false);
        scores_to_prob_pairs(p, h, r0, rows, c0, cols, kind, state, factor, st, pp);
        // the rounded-up keys' pairs: P = 0
        std::fill(pp + (cols + 1) / 2 * 2 * kBlockQ, pp + m * kBlockQ, uint16_t{0});
        // O^T = factor * O^T + V^T P^T
        scale_columns(acc, dvp, factor);
        brgemm(dvp, kBlockQ, m, vt + c0 / kBlockK * dvp * kBlockK, kBlockK, pp, kBlockQ, acc,
               kBlockQ, true);
      },
      s.rows.get());
}

// backward_key_block_bf16 (attention_kernel_bf16.h) with the products through brgemm.
inline bool backward_key_block_brgemm_bf16(const BwdParams& p, const PackedBand<uint16_t>& packed,
                                           int64_t b, int64_t hk, int64_t c0, int64_t q1,
                                           float* dq_band, BwdScratchBrgemm<uint16_t>& s) {
  const AttnShape& sh = p.shape;
  const int64_t dp = sh.head_dim_padded, dvp = sh.head_dim_v_padded;
  const int64_t cols = std::min(kBlockK, sh.seqlen_k - c0);
  load_key_block_pair(p, p.k16, p.k16_strides, p.v16, p.v16_strides, b, hk, c0, cols, s);
  alignas(64) float reference[kBlockQ], delta[kBlockQ];
  float* softcap_grad = p.score.softcap > 0.f ? s.softcap_grad.get() : nullptr;

  return for_each_query_block(
      p, b, hk, c0, cols, packed.q0, q1,
      [&](int64_t row_base, int64_t r0, int64_t rows, int64_t seen, BlockKind kind) {
        const int64_t slot = packed.slot(sh, row_base, r0), m = round_keys(seen);
        float* dq = dq_band + slot * kBlockQ * dp;
        load_row_stats(p, row_base + r0, rows, reference, delta);
        float* st = s.st.get();
        float* dpt = s.dpt.get();
        uint16_t* p16 = s.p16.get();
        uint16_t* ds16 = s.ds16.get();
        uint16_t* ds_pairs = s.ds_pairs.get();

        // P^T = exp2(scale K Q^T - lse), kept in fp32 for dS and in bf16 for dV; 0 for the
        // rounded-up keys
        brgemm(m, kBlockQ, dp, s.k_rows.get(), dp, packed.qt.at(slot), kBlockQ, st, kBlockQ, false);
        backward_probs_bf16(p, head_of_row(sh, row_base), r0, rows, c0, seen, kind, softcap_grad,
                            reference, st, p16);
        std::fill(p16 + seen * kBlockQ, p16 + m * kBlockQ, uint16_t{0});
        // dV += P^T dO
        if (p.dv.data)
          brgemm(m, dvp, kBlockQ, p16, kBlockQ, packed.do_rows.at(slot), dvp, s.dv.get(), dvp,
                 true);
        // dP^T = V dO^T ; dS^T = P^T * (dP^T - delta), in bf16 as is (for dK) and as key pairs
        // (for dQ^T), 0 for the rounded-up keys
        brgemm(m, kBlockQ, dvp, s.v_rows.get(), dvp, packed.dot.at(slot), kBlockQ, dpt, kBlockQ,
               false);
        score_grads_bf16(seen, softcap_grad, delta, st, dpt, ds16, ds_pairs);
        std::fill(ds16 + seen * kBlockQ, ds16 + m * kBlockQ, uint16_t{0});
        std::fill(ds_pairs + (seen + 1) / 2 * 2 * kBlockQ, ds_pairs + m * kBlockQ, uint16_t{0});
        // dK += dS^T Q ; dQ^T += K^T dS^T   (softmax scale applied once at the end)
        if (p.dk.data)
          brgemm(m, dp, kBlockQ, ds16, kBlockQ, packed.q_rows.at(slot), dp, s.dk.get(), dp, true);
        if (p.dq.data)
          brgemm(dp, kBlockQ, m, s.kt.get(), kBlockK, ds_pairs, kBlockQ, dq, kBlockQ, true);
      });
}

#endif  // CPATTN_CPU_BF16_DOT

inline void attention_fwd_brgemm_impl(const FwdParams& p) {
#ifdef CPATTN_CPU_BF16_DOT
  if (p.q16)
    return for_each_query_group<FwdScratchBrgemm<uint16_t>>(
        p, sizeof(uint16_t),
        [&](int64_t b, int64_t h, int64_t qb_begin, int64_t qb_end,
            FwdScratchBrgemm<uint16_t>& scratch) {
          forward_blocks_brgemm_bf16(p, b, h, qb_begin, qb_end, scratch);
        });
#endif
  for_each_query_group<FwdScratchBrgemm<float>>(
      p, sizeof(float),
      [&](int64_t b, int64_t h, int64_t qb_begin, int64_t qb_end,
          FwdScratchBrgemm<float>& scratch) {
        forward_blocks_brgemm(p, b, h, qb_begin, qb_end, scratch);
      });
}

inline void attention_bwd_brgemm_impl(const BwdParams& p) {
#ifdef CPATTN_CPU_BF16_DOT
  if (p.q16)
    return backward_row_bands<uint16_t, BwdScratchBrgemm<uint16_t>>(
        p, pack_query_block_bf16, backward_key_block_brgemm_bf16, /*dq_transposed=*/true);
#endif
  backward_row_bands<float, BwdScratchBrgemm<float>>(p, pack_query_block, backward_key_block_brgemm,
                                                     /*dq_transposed=*/true);
}

}  // namespace CPATTN_CPU_ISA
}  // namespace cpattn::cpu
