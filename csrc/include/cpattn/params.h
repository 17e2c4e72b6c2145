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
  int64_t head_dim = 0;         // D
  int64_t head_dim_padded = 0;  // Dp >= D, the row length of the packed fp32 operands

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

// Forward. Inputs are packed fp32, (batch, heads, seqlen, Dp) contiguous, zero beyond D.
struct FwdParams {
  AttnShape shape;
  const float* q = nullptr;  // (B, H, Sq, Dp)
  const float* k = nullptr;  // (B, Hkv, Sk, Dp)
  const float* v = nullptr;  // (B, Hkv, Sk, Dp)
  BshdOutput out;            // (B, Sq, H, D), fully written
  float* lse = nullptr;      // (B, H, Sq) contiguous, natural log
  float softmax_scale = 1.f;
  Mask mask;
  // bf16 operands instead of q/k/v, for CPUs with bf16 dot products (cpu::has_bf16_dot()):
  // q16 (B, Sq, H, D) as given, strides q16_strides; k16 (B, Hkv, Sk, Dp); v16
  // (B, Hkv, Sk2, Dp, 2) with Sk2 = ceil(Sk / 2): V with key pairs interleaved (keys 2j and
  // 2j+1 side by side, a zero key past the end).
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
  const float* v = nullptr;      // (B, Hkv, Sk, Dp)
  const float* dout = nullptr;   // (B, H, Sq, Dp)
  const float* lse = nullptr;    // (B, H, Sq), natural log
  const float* delta = nullptr;  // (B, H, Sq)
  BshdOutput dq;                 // (B, Sq, H, D), fully written
  BshdOutput dk, dv;             // (B, Sk, Hkv, D) each, fully written
  float softmax_scale = 1.f;
  Mask mask;
  // bf16 operands instead of q/k/v/dout (cpu::has_bf16_dot()): q16 and dout16 (B, Sq, H, D) as
  // given, strides q16_strides and dout16_strides; k16 and v16 (B, Hkv, Sk, Dp), and K again
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
