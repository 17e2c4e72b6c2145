// The block iteration of the CUDA kernels (tiling.h), replayed on the host: every visible pair is
// visited exactly once in each direction, unmasked tiles hold only visible in-range pairs, and
// the row / key bounds agree with the rule.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cpattn/tiling.h"

namespace cpattn {
namespace {

struct Case {
  Mask mask;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int block_m;
  int block_n;
};

Case random_case(std::mt19937_64& rng) {
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  static const int kBlocks[] = {16, 32, 64, 128};
  Case c;
  c.mask.causal = uni(0, 1) == 1;
  c.mask.window_left = uni(0, 3) == 0 ? -1 : uni(0, 150);
  c.mask.window_right = uni(0, 3) == 0 ? -1 : uni(0, 150);
  c.mask.q_offset = uni(-300, 300);
  c.mask.k_offset = uni(-300, 300);
  c.seqlen_q = uni(1, 400);
  c.seqlen_k = uni(1, 400);
  c.block_m = kBlocks[uni(0, 3)];
  c.block_n = kBlocks[uni(0, 3)];
  return c;
}

// One tile (r0, c0) a kernel visits, out-of-range rows and columns included: an unmasked tile
// holds only visible pairs, and what the kernel keeps of a masked one, keeps(r, col) (its per-row
// or per-key bounds), is exactly the visible pairs. Counts the visible pairs in seen.
template <typename Keeps>
void check_tile(const Case& c, int trial, int64_t r0, int64_t c0, bool masked, Keeps keeps,
                std::vector<int>& seen) {
  for (int64_t r = r0; r < r0 + c.block_m; ++r)
    for (int64_t col = c0; col < c0 + c.block_n; ++col) {
      const bool vis = r < c.seqlen_q && col < c.seqlen_k && c.mask.visible(r, col);
      if (!masked) {
        ASSERT_TRUE(vis) << "trial " << trial << ": unmasked tile holds a hidden pair (" << r
                         << ", " << col << ")";
      }
      ASSERT_EQ(masked ? keeps(r, col) : true, vis)
          << "trial " << trial << " (" << r << ", " << col << ")";
      if (vis) ++seen[r * c.seqlen_k + col];
    }
}

// Every visible pair was visited exactly once.
void check_seen_once(const Case& c, int trial, const std::vector<int>& seen) {
  for (int64_t r = 0; r < c.seqlen_q; ++r)
    for (int64_t col = 0; col < c.seqlen_k; ++col)
      ASSERT_EQ(seen[r * c.seqlen_k + col], c.mask.visible(r, col) ? 1 : 0)
          << "trial " << trial << " pair (" << r << ", " << col << ")";
}

// Forward / dQ direction: per query block, the key blocks it visits.
TEST(Tiling, ForwardVisitsEveryVisiblePairOnce) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 600; ++trial) {
    const Case c = random_case(rng);
    const Mask& m = c.mask;
    std::vector<int> seen(c.seqlen_q * c.seqlen_k, 0);
    for (int64_t r0 = 0; r0 < c.seqlen_q; r0 += c.block_m) {
      const int64_t r1 = std::min<int64_t>(r0 + c.block_m, c.seqlen_q);
      const BlockRange kb = key_blocks_of_rows(m, r0, r1, c.seqlen_k, c.block_n);
      for (int nb = kb.first; nb <= kb.last; ++nb) {
        const int64_t c0 = int64_t(nb) * c.block_n;
        ASSERT_LT(c0, c.seqlen_k);
        if (tile_is_empty(m, r0, c.block_m, c0, c.block_n, c.seqlen_q, c.seqlen_k)) continue;
        const bool masked =
            tile_needs_mask(m, r0, c.block_m, c0, c.block_n, c.seqlen_q, c.seqlen_k);
        // the kernel's bounds: per row (rows past seqlen_q are never stored)
        check_tile(
            c, trial, r0, c0, masked,
            [&](int64_t r, int64_t col) {
              return r < c.seqlen_q && visible_keys_of_row(m, r, c.seqlen_k).contains(int(col));
            },
            seen);
      }
    }
    check_seen_once(c, trial, seen);
  }
}

// dK/dV direction: per key block, the query blocks it visits, masked by the per-key bounds.
TEST(Tiling, BackwardVisitsEveryVisiblePairOnce) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 600; ++trial) {
    const Case c = random_case(rng);
    const Mask& m = c.mask;
    std::vector<int> seen(c.seqlen_q * c.seqlen_k, 0);
    for (int64_t c0 = 0; c0 < c.seqlen_k; c0 += c.block_n) {
      const int64_t c1 = std::min<int64_t>(c0 + c.block_n, c.seqlen_k);
      const BlockRange qb = query_blocks_of_keys(m, c0, c1, c.seqlen_q, c.block_m);
      for (int mb = qb.first; mb <= qb.last; ++mb) {
        const int64_t r0 = int64_t(mb) * c.block_m;
        ASSERT_LT(r0, c.seqlen_q);
        if (tile_is_empty(m, r0, c.block_m, c0, c.block_n, c.seqlen_q, c.seqlen_k)) continue;
        const bool masked =
            tile_needs_mask(m, r0, c.block_m, c0, c.block_n, c.seqlen_q, c.seqlen_k);
        // the kernel's bounds: per key
        check_tile(
            c, trial, r0, c0, masked,
            [&](int64_t r, int64_t col) {
              return col < c.seqlen_k && visible_rows_of_key(m, col, c.seqlen_q).contains(int(r));
            },
            seen);
      }
    }
    check_seen_once(c, trial, seen);
  }
}

// Huge windows / offsets: the clipped bounds stay in int range and keep their meaning.
TEST(Tiling, BoundsClipUnboundedMasks) {
  Mask m;  // no mask at all
  m.q_offset = int64_t(1) << 40;
  m.k_offset = -(int64_t(1) << 40);
  IndexBounds b = visible_keys_of_row(m, 5, 100);
  EXPECT_EQ(b.lo, 0);
  EXPECT_EQ(b.hi, 99);
  m.causal = true;  // every key lies far in the past: all visible
  b = visible_keys_of_row(m, 0, 100);
  EXPECT_EQ(b.lo, 0);
  EXPECT_EQ(b.hi, 99);
  std::swap(m.q_offset, m.k_offset);  // every key lies far in the future: none visible
  b = visible_keys_of_row(m, 0, 100);
  EXPECT_GT(b.lo, b.hi);
  EXPECT_TRUE(key_blocks_of_rows(m, 0, 64, 100, 64).empty());
  const IndexBounds rows = visible_rows_of_key(m, 3, 50);
  EXPECT_GT(rows.lo, rows.hi);
}

TEST(Tiling, PickKernelHeadDim) {
  const int compiled[] = {128, 64, 256};
  EXPECT_EQ(pick_kernel_head_dim(64, compiled, 3), 64);
  EXPECT_EQ(pick_kernel_head_dim(1, compiled, 3), 64);
  EXPECT_EQ(pick_kernel_head_dim(65, compiled, 3), 128);
  EXPECT_EQ(pick_kernel_head_dim(200, compiled, 3), 256);
  EXPECT_EQ(pick_kernel_head_dim(257, compiled, 3), -1);
  EXPECT_EQ(pick_kernel_head_dim(64, compiled, 0), -1);
}

}  // namespace
}  // namespace cpattn
