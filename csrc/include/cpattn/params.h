// Plain descriptions of one local attention problem, shared by the CPU and CUDA kernels (their
// parameter structs, cpu/params.h and cuda/params.h, are built from these). No torch types: the
// op layer (csrc/ops) fills them from tensors.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpattn/config.h"
#include "cpattn/mask.h"

namespace cpattn {

struct AttnShape {
  int64_t batch = 0;
  int64_t heads = 0;  // query heads H
  int64_t kv_heads =
      0;  // key/value heads Hkv, H % Hkv == 0; query head h reads kv head h / (H / Hkv)
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;           // D of q and k
  int64_t head_dim_padded = 0;    // Dp >= D, the row length of the packed fp32 operands
  int64_t head_dim_v = 0;         // Dv of v, out and dout (MLA-style models: Dv != D)
  int64_t head_dim_v_padded = 0;  // Dvp >= Dv, likewise
  // Invariant mode (ops/invariant.cpp), the one flag it sets: every sum of the backward runs in
  // an order fixed by global positions alone, never by the call's sizes (CPU: the micro-kernels,
  // one key split, row bands of a fixed size, and dq, dk, dv fp32 running sums that the call
  // continues, unscaled; CUDA: the deterministic dQ pass, one head split in the dK/dV pass).
  bool fixed_order = false;

  int64_t group_size() const { return heads / kv_heads; }
};

// Strides (in elements) of a (batch, seqlen, heads, head_dim) tensor; head_dim is contiguous.
struct BshdStrides {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head = 0;
};

// Strides (in elements) of a (batch, heads, seqlen) tensor (an LSE).
struct BhsStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t seq = 0;
};

// Element type of a tensor a kernel reads or writes.
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// A (batch, seqlen, heads, head_dim) output: D values of `type` per row, contiguous; bf16 and
// fp16 values are rounded to nearest even.
struct BshdOutput {
  void* data = nullptr;
  BshdStrides strides;
  DType type = DType::kFloat32;
};

// What turns q.k into the logit of the softmax, beyond the mask (mask.h), in this order
// (docs/design.md):  s = softmax_scale * q.k  ->  s = softcap * tanh(s / softcap)  ->
// s -= slope_h * |pos_q - pos_k|  ->  mask  ->  softmax whose denominator holds exp(sink_h).
// Defaults change nothing. The sink is not a key of any block: a kernel's partial result over
// some keys never contains it, and it enters a row once, at the final normalisation after every
// partial result is merged (softmax_state.h, add_sink). With it the returned LSE is
// log(exp(sink_h) + sum_j exp(s_j)): the LSE of the softmax actually applied.
struct ScoreOptions {
  float softcap = 0.f;                  // 0: none
  const float* alibi_slopes = nullptr;  // (H,) fp32, or none
  // ALiBi positions: local query r at alibi_q_begin + alibi_stride * r, local key c at
  // alibi_k_begin + alibi_stride * c (global positions; the mask's offsets, stride 1, for a
  // contiguous run; the striped layout has stride W). Distances are exact below 2^24.
  int64_t alibi_q_begin = 0;
  int64_t alibi_k_begin = 0;
  int64_t alibi_stride = 1;
  const float* sinks = nullptr;  // (H,) fp32 logits (natural log), or none

  CPATTN_HOST_DEVICE bool modifies_scores() const {
    return softcap > 0.f || alibi_slopes != nullptr;
  }
};

// The score options of one head in the kernels' base-2 units (scores times log2(e)): the scalar
// form of the rule above, used per element by the CUDA kernels (and their host emulation); the
// CPU kernels apply the same arithmetic vectorised (cpu/attention_kernel.h, modify_scores).
struct HeadScoring {
  float cap2 = 0.f;    // softcap * log2(e); 0: none
  float slope2 = 0.f;  // alibi slope of this head * log2(e); 0: none
  int64_t q_begin = 0, k_begin = 0, stride = 1;

  CPATTN_HOST_DEVICE static HeadScoring of(const ScoreOptions& o, int head) {
    HeadScoring h;
    h.cap2 = o.softcap * 1.4426950408889634f;
    h.slope2 = o.alibi_slopes != nullptr ? o.alibi_slopes[head] * 1.4426950408889634f : 0.f;
    h.q_begin = o.alibi_q_begin;
    h.k_begin = o.alibi_k_begin;
    h.stride = o.alibi_stride;
    return h;
  }
  // The base-2 logit of local query r and local key c from their base-2 score s2 (softmax_scale
  // * log2(e) * q.k): softcap first, then ALiBi on global positions. With dcap, d(logit)/d(s2)
  // (1 - tanh^2 under a softcap, else 1) goes there for the backward's chain rule.
  CPATTN_HOST_DEVICE float logit2(float s2, int64_t r, int64_t c, float* dcap = nullptr) const {
    float x = s2, d = 1.f;
    if (cap2 > 0.f) {
      const float t = tanhf(s2 / cap2);
      x = cap2 * t;
      d = 1.f - t * t;
    }
    if (dcap != nullptr) *dcap = d;
    if (slope2 != 0.f) {
      const int64_t distance = q_begin + stride * r - k_begin - stride * c;  // exact below 2^24
      x -= slope2 * static_cast<float>(distance < 0 ? -distance : distance);
    }
    return x;
  }
};

// What turns q.k into probabilities, the same for every kernel's parameters (CPU: cpu/params.h,
// CUDA: cuda/params.h): the scale, the mask (local indices -> global positions) and the score
// options.
struct AttnScoring {
  float softmax_scale = 1.f;
  Mask mask;
  ScoreOptions score;
};

}  // namespace cpattn
