// Whether the CUDA kernels (csrc/cuda/*.cuh, run on the CPU through cuda_emulation.h) have what
// invariant mode (docs/invariance.md) needs from a kernel call: a row's (a key's) bits depend on
// global positions only, not on which other rows (keys) share the call. A rank computes a run of
// query rows [a, b) (q_offset = a) or of keys [a, b) (k_offset = a); its results must equal
// bitwise the same rows / keys of one call over the whole sequence:
//   1. forward (out fp32, lse) of rows [a, b) against all keys, and against one key tile of
//      kInvariantTile keys at k_offset = kInvariantTile * t (the partials the tile tree merges);
//   2. the deterministic dQ pass (attention_bwd_dq_kernel, dq_accum = nullptr) of rows [a, b)
//      against all keys, from those rows' global out / lse (the preprocess runs on the run's rows);
//   3. the dK/dV pass (attention_bwd_dkdv_kernel without dq_accum: no dQ product) of keys [a, b)
//      against every query from row 0, with the same head split in both calls.
// The runs are those of contiguous and zigzag shards for W = 2, 3, 4, over lengths that are no
// multiple of any block size; bf16 (causal, and a two-sided window) and fp16 (a causal window,
// forward only); GQA 4 / 2, D 64. Every comparison is bitwise (memcmp of the fp32 results) on
// fresh random inputs; NegativeControls shows that such a comparison does see a change of the
// key-block grid or of the head split.
//
// Outside what this can check: the atomic dQ path (dq_accum) is not fixed-order on a GPU (the
// atomics of different key blocks land in any order; the emulation adds them in block order, so
// it cannot show that), and a head split picked from the shape changes dK / dV's bits
// (NegativeControls): so the op layer runs fixed-order calls (AttnShape::fixed_order) with the
// deterministic dQ pass and one head split (csrc/ops/attention_cuda.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpattn/invariant.h"
#include "cuda/bwd_kernel.cuh"
#include "cuda/bwd_preprocess.cuh"
#include "cuda/fwd_kernel.cuh"
#include "host_elements.h"

namespace cpattn::cuda {
namespace {

constexpr int kD = 64, kHeads = 4, kKvHeads = 2;
using FCfg = FwdConfigFor<kD>;  // 128 query rows x 64 keys
using BCfg = BwdConfigFor<kD>;  // 128 keys x 64 query rows
using QCfg = DqConfigFor<kD>;   // 64 query rows x 64 keys

// One sequence (batch 1): q, dout (S, H, D), k, v (S, Hkv, D), and the mask on global positions.
template <typename Elem>
struct Problem {
  int S;
  Mask mask;  // offsets 0; each call sets its own
  float scale;
  std::vector<Elem> q, k, v, dout;
};

template <typename Elem>
Problem<Elem> make_problem(int S, bool causal, int64_t wl, int64_t wr, uint32_t seed) {
  Problem<Elem> p;
  p.S = S;
  p.mask.causal = causal;
  p.mask.window_left = wl;
  p.mask.window_right = wr;
  p.scale = 0.125f;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  auto fill = [&](std::vector<Elem>* x, size_t n) {
    x->resize(n);
    for (Elem& e : *x) e = Host<Elem>::enc(nd(rng));
  };
  fill(&p.q, size_t(S) * kHeads * kD);
  fill(&p.k, size_t(S) * kKvHeads * kD);
  fill(&p.v, size_t(S) * kKvHeads * kD);
  fill(&p.dout, size_t(S) * kHeads * kD);
  return p;
}

BshdStrides q_strides(int S) { return {int64_t(S) * kHeads * kD, kHeads * kD, kD}; }
BshdStrides k_strides(int S) { return {int64_t(S) * kKvHeads * kD, kKvHeads * kD, kD}; }

// out (rows, H, D) fp32 (what the tile tree merges), lse (H, rows).
struct Fwd {
  int rows;
  std::vector<float> out, lse;
};

// The forward of rows [r0, r1) against keys [k0, k1), as a rank calls it: operands offset to the
// run, the mask's offsets its global positions. Outputs poisoned: an unwritten row fails.
template <typename Elem>
Fwd forward(const Problem<Elem>& pb, int r0, int r1, int k0, int k1) {
  const int rows = r1 - r0;
  Fwd r{rows, std::vector<float>(size_t(rows) * kHeads * kD, NAN),
        std::vector<float>(size_t(kHeads) * rows, NAN)};
  FwdParamsCuda fp;
  fp.shape = ShapeCuda{1, kHeads, kKvHeads, rows, k1 - k0, kD};
  fp.dtype = Host<Elem>::kType;
  fp.q = pb.q.data() + size_t(r0) * kHeads * kD;
  fp.k = pb.k.data() + size_t(k0) * kKvHeads * kD;
  fp.v = pb.v.data() + size_t(k0) * kKvHeads * kD;
  fp.q_strides = q_strides(pb.S);
  fp.k_strides = fp.v_strides = k_strides(pb.S);
  fp.out_dtype = DType::kFloat32;
  fp.out = r.out.data();
  fp.out_strides = q_strides(rows);
  fp.lse = r.lse.data();
  fp.softmax_scale = pb.scale;
  fp.scale_log2 = pb.scale * kLog2e;
  fp.mask = pb.mask;
  fp.mask.q_offset = r0;
  fp.mask.k_offset = k0;
  EXPECT_FALSE(fwd_needs_scoring(fp));  // the plain instantiation, as launch_fwd_config picks
  launch(fwd_launch<FCfg>(fp.shape), [&] { attention_fwd_kernel<FCfg, Elem, float, false>(fp); });
  return r;
}

// The preprocess (lse_log2 and delta, bwd_preprocess.cuh) of rows [r0, r1), from the global out
// and lse of those rows (full: the forward of every row).
struct Workspace {
  int rounded;
  std::vector<float> lse_log2, delta;
};
template <typename Elem>
BwdParamsCuda bwd_params(const Problem<Elem>& pb, const Fwd& full, int r0, int r1, int k0, int k1) {
  BwdParamsCuda bp;
  bp.softmax_scale = pb.scale;
  bp.scale_log2 = pb.scale * kLog2e;
  bp.mask = pb.mask;
  bp.mask.q_offset = r0;
  bp.mask.k_offset = k0;
  bp.shape = ShapeCuda{1, kHeads, kKvHeads, r1 - r0, k1 - k0, kD};
  bp.dtype = Host<Elem>::kType;
  bp.q = pb.q.data() + size_t(r0) * kHeads * kD;
  bp.dout = pb.dout.data() + size_t(r0) * kHeads * kD;
  bp.k = pb.k.data() + size_t(k0) * kKvHeads * kD;
  bp.v = pb.v.data() + size_t(k0) * kKvHeads * kD;
  bp.q_strides = bp.dout_strides = q_strides(pb.S);
  bp.k_strides = bp.v_strides = k_strides(pb.S);
  bp.out_dtype = DType::kFloat32;
  bp.out = full.out.data() + size_t(r0) * kHeads * kD;
  bp.out_strides = q_strides(pb.S);
  bp.out_head_dim = kD;
  bp.lse = full.lse.data() + r0;
  bp.lse_strides = {int64_t(kHeads) * pb.S, pb.S, 1};
  bp.dq_accum = nullptr;  // the deterministic path: no atomics
  bp.grad_dtype = DType::kFloat32;
  EXPECT_FALSE(bwd_needs_scoring(bp));  // the plain instantiations, as launch_bwd_typed picks
  return bp;
}
template <typename Elem>
Workspace preprocess(const Problem<Elem>& pb, const Fwd& full, int r0, int r1) {
  BwdParamsCuda bp = bwd_params(pb, full, r0, r1, 0, pb.S);
  Workspace ws{(r1 - r0 + kBwdSeqRound - 1) / kBwdSeqRound * kBwdSeqRound, {}, {}};
  ws.lse_log2.assign(size_t(kHeads) * ws.rounded, NAN);
  ws.delta.assign(ws.lse_log2.size(), NAN);
  bp.seqlen_q_rounded = ws.rounded;
  bp.lse_log2 = ws.lse_log2.data();
  bp.delta = ws.delta.data();
  launch(preprocess_launch(bp.shape, ws.rounded), [&] { bwd_preprocess_kernel<float, Elem>(bp); });
  return ws;
}

// The dQ pass of rows [r0, r1) against every key, after the preprocess of those rows: dq
// (rows, H, D) fp32.
template <typename Elem>
std::vector<float> dq_pass(const Problem<Elem>& pb, const Fwd& full, int r0, int r1) {
  Workspace ws = preprocess(pb, full, r0, r1);
  std::vector<float> dq(size_t(r1 - r0) * kHeads * kD, NAN);
  BwdParamsCuda bp = bwd_params(pb, full, r0, r1, 0, pb.S);
  bp.seqlen_q_rounded = ws.rounded;
  bp.lse_log2 = ws.lse_log2.data();
  bp.delta = ws.delta.data();
  bp.dq = dq.data();
  bp.dq_strides = q_strides(r1 - r0);
  launch(dq_launch<QCfg>(bp.shape), [&] { attention_bwd_dq_kernel<QCfg, Elem, float, false>(bp); });
  return dq;
}

// The dK/dV pass (no dQ product) of keys [k0, k1) against every query, from the preprocess of
// every row (ws; invariant mode gathers every row's lse and delta): dk and dv (keys, Hkv, D) fp32.
// head_splits > 1 through dkv_partial and dkv_reduce_kernel.
template <typename Elem>
std::pair<std::vector<float>, std::vector<float>> dkdv_pass(const Problem<Elem>& pb,
                                                            const Fwd& full, Workspace& ws, int k0,
                                                            int k1, int head_splits) {
  const size_t n = size_t(k1 - k0) * kKvHeads * kD;
  std::vector<float> dk(n, NAN), dv(n, NAN), partial(2 * head_splits * n, NAN);
  BwdParamsCuda bp = bwd_params(pb, full, 0, pb.S, k0, k1);
  bp.seqlen_q_rounded = ws.rounded;
  bp.lse_log2 = ws.lse_log2.data();
  bp.delta = ws.delta.data();
  bp.dk = dk.data();
  bp.dv = dv.data();
  bp.dk_strides = bp.dv_strides = k_strides(k1 - k0);
  bp.head_splits = head_splits;
  bp.dkv_partial = head_splits > 1 ? partial.data() : nullptr;
  launch(dkdv_launch<BCfg>(bp.shape, head_splits),
         [&] { attention_bwd_dkdv_kernel<BCfg, Elem, float, false>(bp); });
  if (head_splits > 1)
    launch(pairs_launch(dkv_pairs(bp.shape)), [&] { dkv_reduce_kernel<kD, float>(bp); });
  return {std::move(dk), std::move(dv)};
}

// Bitwise: rows [a, b) x cols of a (rows_full, cols) array against a (b - a, cols) one.
::testing::AssertionResult same_rows(const std::vector<float>& full, const std::vector<float>& run,
                                     int a, int b, size_t cols) {
  if (run.size() != size_t(b - a) * cols) return ::testing::AssertionFailure() << "size";
  const float* f = full.data() + size_t(a) * cols;
  if (std::memcmp(f, run.data(), run.size() * sizeof(float)) == 0)
    return ::testing::AssertionSuccess();
  for (size_t i = 0; i < run.size(); ++i)
    if (std::memcmp(f + i, &run[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << "first difference at row " << a + int(i / cols) << ", element " << i % cols << ": "
             << f[i] << " vs " << run[i] << " (bits differ)";
  return ::testing::AssertionFailure() << "unreachable";
}

// The poisoned outputs are NaN: two unwritten elements would compare equal. Every full result
// must be written (lse may be -inf: a row that sees no key of a tile).
bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}
bool no_nan(const std::vector<float>& x) {
  for (float v : x)
    if (std::isnan(v)) return false;
  return true;
}

// lse (H, rows_full) rows [a, b) against (H, b - a).
::testing::AssertionResult same_lse(const Fwd& full, const Fwd& run, int a, int b) {
  for (int h = 0; h < kHeads; ++h)
    for (int r = a; r < b; ++r) {
      const float x = full.lse[size_t(h) * full.rows + r],
                  y = run.lse[size_t(h) * run.rows + r - a];
      if (std::memcmp(&x, &y, sizeof(float)) != 0)
        return ::testing::AssertionFailure()
               << "lse head " << h << " row " << r << ": " << x << " vs " << y;
    }
  return ::testing::AssertionSuccess();
}

// The runs of consecutive positions of W ranks' shards: contiguous (W runs of ceil(S / W)) and
// zigzag (2W chunks of ceil(S / 2W); rank r holds chunks r and 2W - 1 - r, each a run).
std::vector<std::pair<int, int>> runs_of(int S, int W, bool zigzag) {
  const int parts = zigzag ? 2 * W : W, chunk = (S + parts - 1) / parts;
  std::vector<std::pair<int, int>> runs;
  for (int i = 0; i < parts; ++i)
    if (i * chunk < S) runs.push_back({i * chunk, std::min(S, (i + 1) * chunk)});
  return runs;
}

struct Layout {
  int W;
  bool zigzag;
};
std::string name_of(const Layout& l, int a, int b) {
  return "W" + std::to_string(l.W) + (l.zigzag ? " zigzag" : " contiguous") + " [" +
         std::to_string(a) + ", " + std::to_string(b) + ")";
}

// Which shards' runs each property is checked on (each layout's runs cost about one call over
// the whole sequence in the emulation, so the slow passes get fewer).
struct Plan {
  std::vector<Layout> fwd, tile, dq, dkdv;
  int head_splits = 1;
};

template <typename Elem>
void check_problem(const Problem<Elem>& pb, const Plan& plan) {
  const int S = pb.S;
  const size_t qcols = size_t(kHeads) * kD, kcols = size_t(kKvHeads) * kD;
  const Fwd full = forward(pb, 0, S, 0, S);
  ASSERT_TRUE(all_finite(full.out) && no_nan(full.lse));

  // 1. Forward against every key.
  for (const Layout& l : plan.fwd)
    for (auto [a, b] : runs_of(S, l.W, l.zigzag)) {
      SCOPED_TRACE("forward, rows " + name_of(l, a, b));
      const Fwd run = forward(pb, a, b, 0, S);
      EXPECT_TRUE(same_rows(full.out, run.out, a, b, qcols));
      EXPECT_TRUE(same_lse(full, run, a, b));
    }
  // 1b. Forward against one key tile (the tile tree's partials): the tiles after the first, whose
  // key blocks start at k_offset = kInvariantTile * t (tile 0 starts at key 0, as above).
  for (int k0 = int(kInvariantTile); k0 < S; k0 += int(kInvariantTile)) {
    const int k1 = std::min<int>(S, k0 + int(kInvariantTile));
    const Fwd tile = forward(pb, 0, S, k0, k1);
    ASSERT_TRUE(all_finite(tile.out) && no_nan(tile.lse));
    for (const Layout& l : plan.tile)
      for (auto [a, b] : runs_of(S, l.W, l.zigzag)) {
        SCOPED_TRACE("forward, keys [" + std::to_string(k0) + ", " + std::to_string(k1) +
                     "), rows " + name_of(l, a, b));
        const Fwd run = forward(pb, a, b, k0, k1);
        EXPECT_TRUE(same_rows(tile.out, run.out, a, b, qcols));
        EXPECT_TRUE(same_lse(tile, run, a, b));
      }
  }

  // 2. The deterministic dQ pass against every key (the full call runs it after the dK/dV pass,
  // which does not touch dq without dq_accum).
  if (plan.dq.empty() && plan.dkdv.empty()) return;
  const std::vector<float> dq_full = dq_pass(pb, full, 0, S);
  ASSERT_TRUE(all_finite(dq_full));
  for (const Layout& l : plan.dq)
    for (auto [a, b] : runs_of(S, l.W, l.zigzag)) {
      SCOPED_TRACE("dq, rows " + name_of(l, a, b));
      EXPECT_TRUE(same_rows(dq_full, dq_pass(pb, full, a, b), a, b, qcols));
    }

  // 3. dK / dV against every query, the same head split in both calls.
  Workspace ws = preprocess(pb, full, 0, S);
  const auto [dk_full, dv_full] = dkdv_pass(pb, full, ws, 0, S, plan.head_splits);
  ASSERT_TRUE(all_finite(dk_full) && all_finite(dv_full));
  for (const Layout& l : plan.dkdv)
    for (auto [a, b] : runs_of(S, l.W, l.zigzag)) {
      SCOPED_TRACE("dk/dv, keys " + name_of(l, a, b) + ", head_splits " +
                   std::to_string(plan.head_splits));
      const auto [dk, dv] = dkdv_pass(pb, full, ws, a, b, plan.head_splits);
      EXPECT_TRUE(same_rows(dk_full, dk, a, b, kcols));
      EXPECT_TRUE(same_rows(dv_full, dv, a, b, kcols));
    }
}

// Whether any element of two equally long fp32 arrays differs in its bits.
bool any_bits_differ(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0;
}

// Causal over 2 key tiles (the second cut short at 600), bf16. Runs of W = 4 zigzag start at
// multiples of 75, W = 3 contiguous at 200 and 400, W = 2 zigzag at 150, 300, 450: none on a
// 64- or 128-row (key) block boundary but the first.
TEST(EmulatedInvariant, CausalBf16) {
  const auto pb = make_problem<__nv_bfloat16>(600, true, -1, -1, 11);
  Plan plan;
  plan.fwd = {{4, true}};
  plan.tile = {{2, false}, {3, false}, {4, true}};
  plan.dq = {{3, false}};
  plan.dkdv = {{2, true}};
  check_problem(pb, plan);
}

// A two-sided sliding window (a row skips key blocks on both sides, a key the query blocks on
// both sides), bf16, and a head split of 2 (GQA: the two query heads of a kv head in two thread
// blocks, summed by dkv_reduce_kernel) in both calls of the dK/dV comparison.
TEST(EmulatedInvariant, WindowBf16) {
  const auto pb = make_problem<__nv_bfloat16>(700, false, 100, 20, 12);
  Plan plan;
  plan.fwd = {{2, false}, {3, false}};
  plan.tile = {{2, false}, {3, false}, {4, true}};
  plan.dq = {{4, true}};
  plan.dkdv = {{3, true}};
  plan.head_splits = 2;
  check_problem(pb, plan);
}

// fp16, a causal sliding window: the forward only (kept short; the backward differs from bf16's in
// the element decode alone).
TEST(EmulatedInvariant, SlidingWindowFp16Forward) {
  const auto pb = make_problem<__half>(600, true, 150, -1, 13);
  Plan plan;
  plan.fwd = {{3, true}};
  plan.tile = {{4, false}};
  check_problem(pb, plan);
}

// Negative controls: the comparisons above can see a difference, and what does change the bits.
// (a) The forward of the same rows with the same visible keys, but key blocks anchored 32 keys
// later (k_offset 32): the online softmax folds other blocks, so the bits differ. This is why a
// tile's call must start at the tile's first key.
// (b) dK/dV of the same keys with head_splits 1 and 2: the split sums the query heads of a kv
// head in separate accumulators, so the bits differ. The op layer picks head_splits per call
// from seqlen_k and the GPU's SM count (bwd_head_splits, csrc/ops/attention_cuda.cpp), so a rank
// with fewer keys may get another split than the one-process call.
TEST(EmulatedInvariant, NegativeControls) {
  const auto pb = make_problem<__nv_bfloat16>(700, false, 100, 20, 14);
  const int a = 300, b = 400;  // rows that see keys 200..419 only
  const Fwd from0 = forward(pb, a, b, 0, pb.S), from32 = forward(pb, a, b, 32, pb.S);
  EXPECT_TRUE(any_bits_differ(from0.out, from32.out));
  const Fwd full = forward(pb, 0, pb.S, 0, pb.S);
  Workspace ws = preprocess(pb, full, 0, pb.S);
  const auto one = dkdv_pass(pb, full, ws, 128, 256, 1), two = dkdv_pass(pb, full, ws, 128, 256, 2);
  EXPECT_TRUE(any_bits_differ(one.first, two.first));
  EXPECT_TRUE(any_bits_differ(one.second, two.second));
}

}  // namespace
}  // namespace cpattn::cuda
