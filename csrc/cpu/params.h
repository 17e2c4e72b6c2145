// Parameters of the CPU kernels: the shared description (cpattn/params.h) plus the CPU's own
// operand packing (fp32 operands packed (batch, heads, seqlen, Dp), or bf16 ones with key pairs
// interleaved). Private to csrc/cpu and the op layer's CPU backend (ops/attention_cpu.cpp).
#pragma once

#include <cstdint>

#include "cpattn/params.h"

namespace cpattn {

// Keys per panel of the brgemm path's transposed V (FwdParams::vt): the kernel's key block.
constexpr int64_t kValuePanelKeys = 128;

// Forward. Inputs are packed fp32, (batch, heads, seqlen, Dp) contiguous, zero beyond D.
struct FwdParams : AttnScoring {  // score.sinks: applied to out and lse when rows are written
  AttnShape shape;
  const float* q = nullptr;  // (B, H, Sq, Dp)
  const float* k = nullptr;  // (B, Hkv, Sk, Dp)
  const float* v = nullptr;  // (B, Hkv, Sk, Dvp)
  BshdOutput out;            // (B, Sq, H, Dv), fully written
  float* lse = nullptr;      // (B, H, Sq) contiguous, natural log
  // bf16 operands instead of q/k/v, where the instruction set packs them so (kernels.h
  // OperandPacking::kBf16Pairs): q16 (B, Sq, H, D) as given, strides q16_strides; k16 (B, Hkv,
  // Sk, Dp); v16 (B, Hkv, Sk2, Dp, 2) with Sk2 = ceil(Sk / 2): V with key pairs interleaved (keys
  // 2j and 2j+1 side by side, a zero key past the end), Dvp in place of Dp. (K is packed so that a
  // block's keys are contiguous: in place, its rows lie H D apart.)
  const uint16_t* q16 = nullptr;
  BshdStrides q16_strides;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  // The brgemm path (kernels.h Packing::kBrgemm) reads V transposed in panels instead of v / v16:
  // (B, Hkv, ceil(Sk / kValuePanelKeys), Dvp, kValuePanelKeys), element (b, hk, key, d) at
  // panel key / kValuePanelKeys, row d, column key % kValuePanelKeys; zero past Sk and beyond Dv.
  const float* vt = nullptr;
  const uint16_t* vt16 = nullptr;
};

// Backward from the *global* out / lse of each query row (delta = rowsum(dout * out)).
struct BwdParams : AttnScoring {  // score.sinks unused: the sink is already in lse
  AttnShape shape;
  // fp32 operands, element (b, s, h, d) at b * batch + s * seq + h * head + d of their strides,
  // Dp (Dvp) values along d, zero beyond D: the caller's tensors read in place when they are
  // fp32 with D = Dp, else packed copies.
  const float* q = nullptr;     // (B, Sq, H, Dp)
  const float* k = nullptr;     // (B, Sk, Hkv, Dp)
  const float* v = nullptr;     // (B, Sk, Hkv, Dvp)
  const float* dout = nullptr;  // (B, Sq, H, Dvp)
  BshdStrides q_strides, k_strides, v_strides, dout_strides;
  const float* lse = nullptr;    // (B, H, Sq), natural log, sinks included (the final LSE)
  const float* delta = nullptr;  // (B, H, Sq)
  BshdOutput dq;                 // (B, Sq, H, D), fully written
  BshdOutput dk, dv;             // (B, Sk, Hkv, D) and (B, Sk, Hkv, Dv), fully written
  // Add the gradients to what dq, dk and dv hold (fp32 outputs only) instead of writing them:
  // the ring's accumulators take a sub-problem's gradients without a temporary.
  bool accumulate = false;
  // With accumulate, dq may be bf16: the high halves of fp32 sums whose low halves dq_low holds
  // at the same offsets (vec.h join_halves), rounded by round_split_sums at the end.
  uint16_t* dq_low = nullptr;
  // bf16 operands instead of q/k/v/dout (OperandPacking::kBf16Pairs): q16 and dout16 (B, Sq, H, D)
  // as given, strides q16_strides and dout16_strides; k16 (B, Sk, Hkv, Dp) and v16 (B, Sk, Hkv,
  // Dvp) by strides k16_strides and v16_strides (the caller's tensors when D = Dp, else copies
  // zero beyond D), and K again with key pairs interleaved, k16_pairs (B, Hkv, ceil(Sk / 2),
  // Dp, 2), for dQ = dS K (none without dQ, and none on the brgemm path).
  const uint16_t* q16 = nullptr;
  BshdStrides q16_strides;
  const uint16_t* dout16 = nullptr;
  BshdStrides dout16_strides;
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  BshdStrides k16_strides, v16_strides;
  const uint16_t* k16_pairs = nullptr;
};

}  // namespace cpattn
