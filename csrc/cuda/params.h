// Parameters of the CUDA attention kernels: the user's (batch, seqlen, heads, head_dim) bf16 / fp16
// tensors as plain strided pointers (no packing copy), the mask as cpattn::Mask. No torch types;
// the op layer (csrc/ops/attention_cuda.cpp) fills these. Every stride is in elements; head_dim is
// contiguous, every other stride a multiple of 8 and every base pointer 16-byte aligned (the op
// layer copies an operand that is not).
#pragma once

#include <cstdint>

#include "cpattn/kv_cache.h"
#include "cpattn/params.h"

namespace cpattn::cuda {

// Whether the kernels can read a (batch, seqlen, heads, head_dim) operand in place: a 16-byte
// aligned base, every stride but head_dim's a multiple of 8 elements (16-byte cp.async chunks),
// and 32-bit offsets within a tile of up to 128 rows. The op layer copies an operand that is not.
inline bool operand_readable(const void* data, const int64_t (&sizes)[3], const BshdStrides& st) {
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  const int64_t strides[3] = {st.batch, st.seq, st.head};
  for (int d = 0; d < 3; ++d)
    if (sizes[d] > 1 && strides[d] % 8 != 0) return false;
  return sizes[1] <= 1 || st.seq < (int64_t(1) << 24);
}

// AttnShape as the kernels index it: 32-bit, head_dim the kernel's (no separate Dv).
struct ShapeCuda {
  int batch = 0;
  int heads = 0;     // query heads H
  int kv_heads = 0;  // H % kv_heads == 0; query head h reads kv head h / (H / kv_heads)
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;  // the kernel's head dim (the op layer zero-pads the operands up to it)
};

// softmax_scale, mask and score (AttnScoring, cpattn/params.h) as for the CPU kernels.
struct FwdParamsCuda : AttnScoring {
  ShapeCuda shape;
  DType dtype = DType::kBFloat16;  // of q, k, v
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  BshdStrides q_strides, k_strides, v_strides;
  DType out_dtype = DType::kBFloat16;  // q's dtype or fp32 (what the ring merges)
  void* out = nullptr;
  BshdStrides out_strides;
  float* lse = nullptr;    // (B, H, Sq) contiguous, natural log
  float scale_log2 = 1.f;  // softmax_scale * log2(e)
};

// Backward from the global out / lse of each query row.
struct BwdParamsCuda : AttnScoring {
  ShapeCuda shape;
  DType dtype = DType::kBFloat16;  // of q, k, v and dout
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* dout = nullptr;
  BshdStrides q_strides, k_strides, v_strides, dout_strides;
  DType out_dtype = DType::kBFloat16;  // of out (read by the preprocess only)
  const void* out = nullptr;
  BshdStrides out_strides;
  int out_head_dim = 0;        // out's (and dout's unpadded) head dim
  const float* lse = nullptr;  // (B, H, Sq), natural log
  BhsStrides lse_strides;
  const float* dlse = nullptr;  // optional (B, H, Sq): gradient into lse, enters as delta - dlse
  BhsStrides dlse_strides;

  // Workspace written by the preprocess, (B, H, seqlen_q_rounded) contiguous: lse in base 2 with
  // an empty row's -inf turned into +inf (its probabilities recompute to 0), and
  // delta = rowsum(dout * out) - dlse. Rows beyond seqlen_q hold +inf and 0.
  int seqlen_q_rounded = 0;
  float* lse_log2 = nullptr;
  float* delta = nullptr;
  // (B, H, seqlen_q_rounded, head_dim) fp32, zero on entry: dQ accumulated with atomics by the
  // dK/dV kernel. nullptr selects the deterministic path (a separate dQ kernel, no atomics).
  // In accumulate mode (below) it is dq itself: the atomics add into it directly.
  float* dq_accum = nullptr;

  // GQA / MQA: the query heads of a kv head are split over head_splits thread blocks
  // (group % head_splits == 0), so that few kv heads still fill the GPU. With head_splits > 1
  // each block writes its scaled fp32 dK / dV to dkv_partial (2, head_splits, B, Sk, Hkv,
  // head_dim) contiguous, and dkv_reduce_kernel sums the splits in a fixed order (deterministic).
  int head_splits = 1;
  float* dkv_partial = nullptr;

  DType grad_dtype = DType::kBFloat16;  // of dq, dk, dv: q's dtype or fp32
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  BshdStrides dq_strides, dk_strides, dv_strides;
  // Accumulate mode (the ring's bwd_add): dq, dk, dv are fp32 accumulators (grad_dtype fp32) that
  // the kernels add their gradients into instead of overwriting them, only in their first
  // dq_cols / dk_cols / dv_cols columns: the accumulators keep the real head dims when the op
  // layer zero-pads the operands (the padded columns' gradients are 0), so nothing is sliced.
  bool accumulate = false;
  int dq_cols = 0, dk_cols = 0, dv_cols = 0;
  float scale_log2 = 1.f;  // softmax_scale * log2(e)
};

// Batched split-KV decode over one rank's shard of a KV cache (decode_kernel.cuh): the queries of
// every sequence against the slots that rank stores, in one launch. The mask is the global rule
// (global_mask: offsets 0) and the score options take global positions (ALiBi offsets 0, stride
// 1, no sinks): query row i of sequence b sits at q_start[b] + i, slot s at
// sharding.position(rank, s).
struct DecodeParamsCuda : AttnScoring {
  int batch = 0;
  int heads = 0;     // query heads H
  int kv_heads = 0;  // H % kv_heads == 0; query head h reads kv head h / (H / kv_heads)
  int seqlen_q = 0;  // Sq query rows per sequence
  int head_dim = 0;  // of q, the cache and out: a compiled head dim (no padding)
  DType dtype = DType::kBFloat16;  // of q and the cache
  const void* q = nullptr;
  BshdStrides q_strides;
  const void* k_cache = nullptr;  // (B, slots, Hkv, D), operand_readable
  const void* v_cache = nullptr;
  BshdStrides k_strides, v_strides;
  const int64_t* cache_lens = nullptr;  // (B,) on the device: positions [0, len) are stored
  const int64_t* q_start = nullptr;     // (B,) on the device
  CacheSharding sharding;
  int64_t rank = 0;
  float scale_log2 = 1.f;  // softmax_scale * log2(e)

  // The grid (decode_grid): key splits of split_slots slots each, and blocks per kv head over its
  // G * Sq query rows.
  int splits = 1;
  int64_t split_slots = 0;
  int row_groups = 1;
  // Written by the split kernel, read by the merge: (splits, B, Sq, H, D) and (splits, B, H, Sq)
  // fp32 contiguous.
  float* part_out = nullptr;
  float* part_lse = nullptr;
  // The merged result: out (B, Sq, H, D) fp32, lse (B, H, Sq) fp32 contiguous, natural log.
  float* out = nullptr;
  BshdStrides out_strides;
  float* lse = nullptr;
};

// How many key splits and query row groups a decode launch uses: from shapes only (never from
// device values), enough blocks to fill `target_blocks` (a few per SM). splits = 0: no decode
// kernel for this head dim or too many query rows per kv head (the op layer falls back).
struct DecodeGrid {
  int splits = 0;
  int64_t split_slots = 0;
  int row_groups = 0;
};
DecodeGrid decode_grid(int head_dim, int batch, int kv_heads, int rows_per_kv_head, int64_t slots,
                       int64_t target_blocks);

// Launchers: one explicit instantiation per (dtype, head dim) in csrc/cuda/inst/ (generated by
// csrc/cuda/generate_instantiations.py). They return a cudaError_t value.
template <DType kDtype, int kHeadDim>
int launch_fwd(const FwdParamsCuda& p, void* stream);
template <DType kDtype, int kHeadDim>
int launch_bwd(const BwdParamsCuda& p, void* stream);
template <DType kDtype, int kHeadDim>
int launch_decode(const DecodeParamsCuda& p, void* stream);

// Dispatch over the compiled instantiations (csrc/cuda/dispatch.cu). The op layer pads the head
// dim to one of compiled_head_dims() first.
int run_fwd(const FwdParamsCuda& p, void* stream);
int run_bwd(const BwdParamsCuda& p, void* stream);
// The decode kernels (split, then merge), p filled with a decode_grid's values.
int run_decode(const DecodeParamsCuda& p, void* stream);
// Preprocess of the backward (lse_log2 and delta); run_bwd calls it first.
int run_bwd_preprocess(const BwdParamsCuda& p, void* stream);
// Head dims with compiled kernels, ascending.
const int* compiled_head_dims(int* count);
// dK/dV thread blocks per (kv head, batch) before any head split: key blocks x head-dim slices.
int bwd_dkdv_blocks(int head_dim, int seqlen_k);
// Rounding of seqlen_q for the backward workspace.
constexpr int kBwdSeqRound = 128;

// Error code for "no kernel compiled for this (dtype, head dim)"; outside cudaError_t's range.
constexpr int kErrNoKernel = 100000;

}  // namespace cpattn::cuda
