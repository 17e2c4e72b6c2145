// The CUDA decode kernels (csrc/cuda/decode_kernel.cuh: split-KV over one rank's cache shard,
// then the merge of the splits) run on the CPU through the emulation of cuda_emulation.h. Each
// rank's shard is built from a global K/V by the owner rule (cpattn/kv_cache.h); the ranks'
// partial results, merged with log-sum-exp, must give the float64 attention over the global
// positions, computed here directly (the mask and score rules written out, not taken from
// mask.h): batches of sequences of different lengths (0 and 1 stored tokens, one over several
// splits), W ranks x interleave, Sq rows, GQA, causal, windows, a prefix, softcap, ALiBi, bf16
// and fp16, every output poisoned (NaN) first.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/decode_kernel.cuh"
#include "host_elements.h"

namespace cpattn::cuda {
namespace {

struct DecodeCase {
  int world, interleave, seqlen_q, heads, kv_heads;
  std::vector<int64_t> lens;     // tokens stored per sequence (over all ranks)
  std::vector<int64_t> q_start;  // position of query row 0 per sequence
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  int64_t prefix_len = 0;  // 0: none
  float softcap = 0.f;
  bool alibi = false;
  float scale = 0.125f;
};

std::string name_of(const DecodeCase& c, int d, bool bf16) {
  std::ostringstream os;
  os << "W" << c.world << " I" << c.interleave << " Sq" << c.seqlen_q << " H" << c.heads << "/"
     << c.kv_heads << " D" << d << (bf16 ? " bf16" : " fp16") << (c.causal ? " causal" : "")
     << " w(" << c.window_left << "," << c.window_right << ") prefix " << c.prefix_len
     << " softcap " << c.softcap << (c.alibi ? " alibi" : "") << " lens";
  for (int64_t l : c.lens) os << " " << l;
  os << " q_start";
  for (int64_t s : c.q_start) os << " " << s;
  return os.str();
}

// The rule of docs/design.md on global positions, written out.
bool visible(const DecodeCase& c, int64_t i, int64_t j) {
  if (j < c.prefix_len) return true;
  if (c.causal && j > i) return false;
  if (c.window_left >= 0 && j < i - c.window_left) return false;
  if (c.window_right >= 0 && j > i + c.window_right) return false;
  return true;
}

// Float64 attention of every query row over the keys [0, lens[b]) of the global K/V
// (B, max_len, Hkv, d); out (B, Sq, H, d), lse (B, H, Sq) (-inf: the row sees no key).
void reference(const DecodeCase& c, int d, int64_t max_len, const std::vector<double>& q,
               const std::vector<double>& k, const std::vector<double>& v,
               const std::vector<float>& slopes, std::vector<double>* out,
               std::vector<double>* lse) {
  const int B = static_cast<int>(c.lens.size()), Sq = c.seqlen_q, H = c.heads, Hk = c.kv_heads;
  out->assign(size_t(B) * Sq * H * d, 0.0);
  lse->assign(size_t(B) * H * Sq, -INFINITY);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < Sq; ++i)
      for (int h = 0; h < H; ++h) {
        const int hk = h / (H / Hk);
        const int64_t qp = c.q_start[b] + i;
        std::vector<double> s(c.lens[b], -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < c.lens[b]; ++j) {
          if (!visible(c, qp, j)) continue;
          double x = 0;
          for (int e = 0; e < d; ++e)
            x += q[((size_t(b) * Sq + i) * H + h) * d + e] *
                 k[((size_t(b) * max_len + j) * Hk + hk) * d + e];
          x *= c.scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          if (c.alibi) x -= slopes[h] * std::abs(double(qp - j));
          s[j] = x;
          mx = std::max(mx, x);
        }
        if (mx == -INFINITY) continue;
        double sum = 0;
        for (double x : s) sum += x == -INFINITY ? 0.0 : std::exp(x - mx);
        (*lse)[(size_t(b) * H + h) * Sq + i] = mx + std::log(sum);
        for (int e = 0; e < d; ++e) {
          double o = 0;
          for (int64_t j = 0; j < c.lens[b]; ++j)
            if (s[j] != -INFINITY)
              o += std::exp(s[j] - mx) / sum * v[((size_t(b) * max_len + j) * Hk + hk) * d + e];
          (*out)[((size_t(b) * Sq + i) * H + h) * d + e] = o;
        }
      }
}

template <int kHeadDim, typename Elem>
void run_case(const DecodeCase& c, uint64_t seed) {
  using Cfg = DecodeConfig<kHeadDim>;
  constexpr int d = kHeadDim;
  SCOPED_TRACE(name_of(c, d, std::is_same_v<Elem, __nv_bfloat16>));
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int B = static_cast<int>(c.lens.size()), Sq = c.seqlen_q, H = c.heads, Hk = c.kv_heads;
  int64_t max_len = 1;
  for (int64_t l : c.lens) max_len = std::max(max_len, l);
  std::vector<double> qd, kd, vd;
  const std::vector<Elem> q = random_elems<Elem>(size_t(B) * Sq * H * d, rng, &qd);
  const std::vector<Elem> kg = random_elems<Elem>(size_t(B) * max_len * Hk * d, rng, &kd);
  const std::vector<Elem> vg = random_elems<Elem>(size_t(B) * max_len * Hk * d, rng, &vd);
  std::vector<float> slopes(H);
  for (int h = 0; h < H; ++h) slopes[h] = c.alibi ? 0.05f * (h + 1) : 0.f;
  std::vector<double> ref_out, ref_lse;
  reference(c, d, max_len, qd, kd, vd, slopes, &ref_out, &ref_lse);

  const CacheSharding sharding{c.world, c.interleave};
  // Rank 0 fills first; a few spare slots past every sequence's end hold NaN (never read).
  const int64_t slots = sharding.count(0, max_len) + 5;
  const int64_t rows = int64_t(B) * Sq * H;
  const Elem nan16{0x7fff};
  std::vector<float> outs(size_t(c.world) * rows * d), lses(size_t(c.world) * rows);
  for (int rank = 0; rank < c.world; ++rank) {
    std::vector<Elem> kc(size_t(B) * slots * Hk * d, nan16), vc(kc.size(), nan16);
    for (int b = 0; b < B; ++b)
      for (int64_t t = 0; t < c.lens[b]; ++t) {
        if (sharding.owner(t) != rank) continue;
        const size_t src = (size_t(b) * max_len + t) * Hk * d;
        const size_t dst = (size_t(b) * slots + sharding.slot(t)) * Hk * d;
        std::copy(kg.begin() + src, kg.begin() + src + Hk * d, kc.begin() + dst);
        std::copy(vg.begin() + src, vg.begin() + src + Hk * d, vc.begin() + dst);
      }

    DecodeParamsCuda p;
    p.softmax_scale = c.scale;
    p.scale_log2 = c.scale * 1.4426950408889634f;
    p.mask.causal = c.causal;
    p.mask.window_left = c.window_left;
    p.mask.window_right = c.window_right;
    if (c.prefix_len > 0) p.mask.prefix_end = c.prefix_len;
    p.score.softcap = c.softcap;
    p.score.alibi_slopes = c.alibi ? slopes.data() : nullptr;
    p.batch = B;
    p.heads = H;
    p.kv_heads = Hk;
    p.seqlen_q = Sq;
    p.head_dim = d;
    p.dtype = Host<Elem>::kType;
    p.q = q.data();
    p.q_strides = {int64_t(Sq) * H * d, int64_t(H) * d, d};
    p.k_cache = kc.data();
    p.v_cache = vc.data();
    p.k_strides = p.v_strides = {slots * Hk * d, int64_t(Hk) * d, d};
    p.cache_lens = c.lens.data();
    p.q_start = c.q_start.data();
    p.sharding = sharding;
    p.rank = rank;
    // A large target: one tile per split, so that the long sequence spans several splits.
    const DecodeGrid grid = choose_decode_grid<Cfg>(B, Hk, (H / Hk) * Sq, slots, 1 << 20);
    ASSERT_GT(grid.splits, 0);
    ASSERT_GE(grid.splits * grid.split_slots, slots);
    p.splits = grid.splits;
    p.split_slots = grid.split_slots;
    p.row_groups = grid.row_groups;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> part_out(size_t(grid.splits) * rows * d, nan),
        part_lse(size_t(grid.splits) * rows, nan), out(size_t(rows) * d, nan), lse(rows, nan);
    p.part_out = part_out.data();
    p.part_lse = part_lse.data();
    p.out = out.data();
    p.out_strides = {int64_t(Sq) * H * d, int64_t(H) * d, d};
    p.lse = lse.data();
    launch(decode_launch<Cfg>(p), [&] { decode_split_kernel<Cfg, Elem>(p); });
    launch(decode_merge_launch(p), [&] { decode_merge_kernel<d>(p); });
    for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << "out " << i;
    for (size_t i = 0; i < lse.size(); ++i)
      ASSERT_FALSE(std::isnan(lse[i]) || lse[i] == INFINITY) << "lse " << i;
    std::copy(out.begin(), out.end(), outs.begin() + size_t(rank) * rows * d);
    std::copy(lse.begin(), lse.end(), lses.begin() + size_t(rank) * rows);
  }

  // The ranks' partial results merged (the N-way rule of softmax_state.h), against the reference.
  std::vector<float> w(c.world);
  double num = 0, den = 0;
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < Sq; ++i)
      for (int h = 0; h < H; ++h) {
        const int64_t lse_at = (int64_t(b) * H + h) * Sq + i, row = (int64_t(b) * Sq + i) * H + h;
        const float lse = merge_weights_n(lses.data() + lse_at, c.world, rows, w.data());
        const double ref = ref_lse[lse_at];
        if (std::isinf(ref)) {
          ASSERT_TRUE(std::isinf(lse) && lse < 0) << "row " << row << ": lse must be -inf";
          for (int r = 0; r < c.world; ++r)
            for (int e = 0; e < d; ++e)
              ASSERT_EQ(outs[(size_t(r) * rows + row) * d + e], 0.f) << "empty row " << row;
          continue;
        }
        ASSERT_NEAR(lse, ref, 1e-4 * std::max(1.0, std::abs(ref))) << "row " << row;
        for (int e = 0; e < d; ++e) {
          double o = 0;
          for (int r = 0; r < c.world; ++r) o += w[r] * outs[(size_t(r) * rows + row) * d + e];
          const double x = ref_out[row * d + e];
          num += (o - x) * (o - x);
          den += x * x;
        }
      }
  EXPECT_LE(std::sqrt(num) / std::max(std::sqrt(den), 1e-30), 1e-4) << "out: relative error";
}

// Sequences of 0, 1, a few and many stored tokens; query row 0 of each where a decode step puts
// it (the last Sq positions of the cache) or, for the third, in the middle of the cache.
DecodeCase base_case(int world, int interleave, int seqlen_q, int kv_heads) {
  DecodeCase c;
  c.world = world;
  c.interleave = interleave;
  c.seqlen_q = seqlen_q;
  c.heads = 4;
  c.kv_heads = kv_heads;
  c.lens = {0, 1, 37, 300 * world + 11};
  for (int64_t l : c.lens) c.q_start.push_back(l >= seqlen_q ? l - seqlen_q : 0);
  c.q_start[2] = 20;
  return c;
}

// The score and mask options of case n (cycled through the W x interleave x Sq grid).
void with_options(DecodeCase* c, int n) {
  switch (n % 7) {
    case 0:  // none: every stored key
      break;
    case 1:
      c->causal = true;
      break;
    case 2:
      c->causal = true;
      c->window_left = 50;
      break;
    case 3:
      c->causal = true;
      c->window_left = 30;
      c->prefix_len = 20;
      break;
    case 4:
      c->causal = true;
      c->softcap = 3.f;
      break;
    case 5:
      c->causal = true;
      c->alibi = true;
      break;
    default:  // a two-sided window without causality, softcap and ALiBi together
      c->window_left = 40;
      c->window_right = 10;
      c->softcap = 5.f;
      c->alibi = true;
      c->scale = 0.2f;
      break;
  }
}

template <typename Elem>
void run_grid(int dtype_index) {
  int n = 0;
  for (int world : {1, 2, 3})
    for (int interleave : {1, 4})
      for (int seqlen_q : {1, 3}) {
        DecodeCase c = base_case(world, interleave, seqlen_q, 1 + n % 2);
        with_options(&c, n + dtype_index);
        run_case<64, Elem>(c, 1000 * dtype_index + n);
        ++n;
      }
}

TEST(EmulatedDecode, GridBf16) { run_grid<__nv_bfloat16>(0); }
TEST(EmulatedDecode, GridFp16) { run_grid<__half>(1); }

TEST(EmulatedDecode, HeadDim128) {
  DecodeCase c = base_case(2, 4, 3, 2);
  with_options(&c, 3);  // causal, window and prefix
  run_case<128, __nv_bfloat16>(c, 77);
  DecodeCase a = base_case(3, 1, 1, 1);
  with_options(&a, 6);
  run_case<128, __half>(a, 78);
}

// More query rows per kv head than one block holds: several row groups over the same keys.
TEST(EmulatedDecode, RowGroups) {
  DecodeCase c = base_case(2, 1, 5, 1);  // G * Sq = 20 rows > kRows = 16 at head dim 64
  with_options(&c, 2);
  run_case<64, __half>(c, 91);
}

TEST(EmulatedDecode, PlanFromShapes) {
  using Cfg = DecodeConfig<128>;
  // One sequence, one kv head, a long shard: splits fill the target, each a whole number of tiles.
  DecodeGrid p = choose_decode_grid<Cfg>(1, 8, 8, 131072, 132 * 4);
  EXPECT_EQ(p.row_groups, 1);
  EXPECT_GE(p.splits * 8, 132 * 4 * 0.9);
  EXPECT_EQ(p.split_slots % Cfg::kBlockN, 0);
  EXPECT_GE(p.splits * p.split_slots, 131072);
  // A large batch fills the GPU without splitting; an empty cache still gets one split.
  EXPECT_EQ(choose_decode_grid<Cfg>(256, 8, 8, 4096, 528).splits, 1);
  EXPECT_EQ(choose_decode_grid<Cfg>(1, 1, 1, 0, 528).splits, 1);
  // Too many query rows per kv head for the decode kernel: no grid (the op falls back).
  EXPECT_EQ(choose_decode_grid<Cfg>(1, 1, Cfg::kRows * Cfg::kMaxRowGroups + 1, 4096, 528).splits,
            0);
}

}  // namespace
}  // namespace cpattn::cuda
