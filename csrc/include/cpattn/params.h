// Plain descriptions of one local attention problem, shared by the CPU and CUDA kernels.
// No torch types: the op layer (csrc/ops) fills these from tensors.
#pragma once

#include <cstdint>

#include "cpattn/mask.h"

namespace cpattn {

struct AttnShape {
  int64_t batch = 0;
  int64_t heads = 0;     // query heads H
  int64_t kv_heads = 0;  // key/value heads Hkv, H % Hkv == 0; query head h reads kv head h / (H / Hkv)
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;         // D of q and k
  int64_t head_dim_padded = 0;  // Dp >= D, the row length of the packed fp32 operands
  int64_t head_dim_v = 0;         // Dv of v, out and dout (MLA-style models: Dv != D)
  int64_t head_dim_v_padded = 0;  // Dvp >= Dv, likewise

  int64_t group_size() const { return heads / kv_heads; }
};

// Strides (in elements) of a (batch, seqlen, heads, head_dim) tensor; head_dim is contiguous.
struct BshdStrides {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head = 0;
};

// Element type of a kernel output.
enum class OutType { kFloat32, kBFloat16, kFloat16 };

// A (batch, seqlen, heads, head_dim) output: D values of `type` per row, contiguous; bf16 and
// fp16 values are rounded to nearest even.
struct BshdOutput {
  void* data = nullptr;
  BshdStrides strides;
  OutType type = OutType::kFloat32;
};

// What turns q.k into the logit of the softmax, beyond the mask (mask.h), in this order
// (DESIGN.md):  s = softmax_scale * q.k  ->  s = softcap * tanh(s / softcap)  ->
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

  bool modifies_scores() const { return softcap > 0.f || alibi_slopes != nullptr; }
};

// Forward. Inputs are packed fp32, (batch, heads, seqlen, Dp) contiguous, zero beyond D.
struct FwdParams {
  AttnShape shape;
  const float* q = nullptr;  // (B, H, Sq, Dp)
  const float* k = nullptr;  // (B, Hkv, Sk, Dp)
  const float* v = nullptr;  // (B, Hkv, Sk, Dvp)
  BshdOutput out;            // (B, Sq, H, Dv), fully written
  float* lse = nullptr;      // (B, H, Sq) contiguous, natural log
  float softmax_scale = 1.f;
  Mask mask;
  ScoreOptions score;        // score.sinks: applied to out and lse when the rows are written
  // bf16 operands instead of q/k/v, for CPUs with bf16 dot products (cpu::has_bf16_dot()):
  // q16 (B, Sq, H, D) as given, strides q16_strides; k16 (B, Hkv, Sk, Dp); v16
  // (B, Hkv, Sk2, Dp, 2) with Sk2 = ceil(Sk / 2): V with key pairs interleaved (keys 2j and
  // 2j+1 side by side, a zero key past the end), Dvp in place of Dp.
  const uint16_t* q16 = nullptr;
  BshdStrides q16_strides;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
};

// Backward from the *global* out / lse of each query row (delta = rowsum(dout * out)).
struct BwdParams {
  AttnShape shape;
  const float* q = nullptr;      // (B, H, Sq, Dp)
  const float* k = nullptr;      // (B, Hkv, Sk, Dp)
  const float* v = nullptr;      // (B, Hkv, Sk, Dvp)
  const float* dout = nullptr;   // (B, H, Sq, Dvp)
  const float* lse = nullptr;    // (B, H, Sq), natural log, sinks included (the final LSE)
  const float* delta = nullptr;  // (B, H, Sq)
  BshdOutput dq;                 // (B, Sq, H, D), fully written
  BshdOutput dk, dv;             // (B, Sk, Hkv, D) and (B, Sk, Hkv, Dv), fully written
  float softmax_scale = 1.f;
  Mask mask;
  ScoreOptions score;  // score.sinks unused: the sink is already in lse, and has no value
  // bf16 operands instead of q/k/v/dout (cpu::has_bf16_dot()): q16 and dout16 (B, Sq, H, D) as
  // given, strides q16_strides and dout16_strides; k16 (B, Hkv, Sk, Dp) and v16 (B, Hkv, Sk,
  // Dvp), and K again
  // with key pairs interleaved, k16_pairs (B, Hkv, ceil(Sk / 2), Dp, 2), for dQ = dS K.
  const uint16_t* q16 = nullptr;
  BshdStrides q16_strides;
  const uint16_t* dout16 = nullptr;
  BshdStrides dout16_strides;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  const uint16_t* k16_pairs = nullptr;
};

}  // namespace cpattn
