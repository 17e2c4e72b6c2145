// The block iteration of the CUDA kernels (tiling.h), replayed on the host: every visible pair is
// visited exactly once in each direction, unmasked tiles hold only visible in-range pairs, and
// the row / key bounds agree with the rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpattn/invariant.h"
#include "cpattn/tiling.h"
#include "random_mask.h"

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
  c.mask = random_mask(uni, 150, -300, 300);
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

// The kernels' two walks over random cases: the forward / dQ kernel visits, per query block,
// its key blocks (masked by per-row bounds; rows past seqlen_q are never stored); the dK/dV
// kernel, per key block, its query blocks (masked by per-key bounds).
void check_walk(uint64_t seed, bool per_query_block) {
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 600; ++trial) {
    const Case c = random_case(rng);
    const Mask& m = c.mask;
    std::vector<int> seen(c.seqlen_q * c.seqlen_k, 0);
    const int64_t outer_len = per_query_block ? c.seqlen_q : c.seqlen_k;
    const int64_t inner_len = per_query_block ? c.seqlen_k : c.seqlen_q;
    const int outer_block = per_query_block ? c.block_m : c.block_n;
    const int inner_block = per_query_block ? c.block_n : c.block_m;
    for (int64_t o0 = 0; o0 < outer_len; o0 += outer_block) {
      const int64_t o1 = std::min<int64_t>(o0 + outer_block, outer_len);
      const BlockRange inner = per_query_block
                                   ? key_blocks_of_rows(m, o0, o1, c.seqlen_k, c.block_n)
                                   : query_blocks_of_keys(m, o0, o1, c.seqlen_q, c.block_m);
      for (int ib = inner.first; ib <= inner.last; ++ib) {
        const int64_t i0 = int64_t(ib) * inner_block;
        ASSERT_LT(i0, inner_len);
        const int64_t r0 = per_query_block ? o0 : i0, c0 = per_query_block ? i0 : o0;
        if (tile_is_empty(m, r0, c.block_m, c0, c.block_n, c.seqlen_q, c.seqlen_k)) continue;
        const bool masked =
            tile_needs_mask(m, r0, c.block_m, c0, c.block_n, c.seqlen_q, c.seqlen_k);
        check_tile(
            c, trial, r0, c0, masked,
            [&](int64_t r, int64_t col) {
              if (per_query_block)
                return r < c.seqlen_q && visible_keys_of_row(m, r, c.seqlen_k).contains(int(col));
              return col < c.seqlen_k && visible_rows_of_key(m, col, c.seqlen_q).contains(int(r));
            },
            seen);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    check_seen_once(c, trial, seen);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Tiling, ForwardVisitsEveryVisiblePairOnce) { check_walk(7, /*per_query_block=*/true); }

TEST(Tiling, BackwardVisitsEveryVisiblePairOnce) { check_walk(11, /*per_query_block=*/false); }

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

// Invariant mode's tile tree (invariant.h): the merge order written out, "(a,b)" for a merge.
std::string tree_of(const std::vector<std::pair<int64_t, std::string>>& pushed) {
  const auto merge = [](std::string& a, const std::string& b) { a = "(" + a + "," + b + ")"; };
  TileTree<std::string, decltype(merge)> tree(merge);
  for (const auto& [tile, name] : pushed) tree.push(tile, name);
  return tree.finish();
}

TEST(TileTree, MergesAsTheBinaryTreeOverTileIndices) {
  EXPECT_EQ(tree_of({{0, "0"}}), "0");
  EXPECT_EQ(tree_of({{0, "0"}, {1, "1"}, {2, "2"}, {3, "3"}}), "((0,1),(2,3))");
  EXPECT_EQ(tree_of({{0, "0"}, {1, "1"}, {2, "2"}, {3, "3"}, {4, "4"}, {5, "5"}}),
            "(((0,1),(2,3)),(4,5))");
  // absent tiles (no visible key) are empty: the present ones keep their places in the tree
  EXPECT_EQ(tree_of({{1, "1"}, {2, "2"}, {3, "3"}}), "(1,(2,3))");
  EXPECT_EQ(tree_of({{0, "0"}, {3, "3"}, {4, "4"}}), "((0,3),4)");
  EXPECT_EQ(tree_of({{2, "2"}, {5, "5"}, {6, "6"}, {7, "7"}}), "(2,(5,(6,7)))");
}

TEST(TileTree, AlignedBlocksMergeLikeTheirTiles) {
  // A cache owner's aligned block of tiles, merged first, is the tree's node of that block.
  std::vector<std::pair<int64_t, std::string>> tiles;
  for (int64_t t = 0; t < 11; ++t) tiles.emplace_back(t, std::to_string(t));
  const std::string all = tree_of(tiles);
  for (int64_t block : {2, 4, 8}) {
    std::vector<std::pair<int64_t, std::string>> blocks;
    for (int64_t b = 0; b < 11; b += block)
      blocks.emplace_back(
          b, tree_of({tiles.begin() + b, tiles.begin() + std::min<int64_t>(11, b + block)}));
    EXPECT_EQ(tree_of(blocks), all) << block;
  }
}

}  // namespace
}  // namespace cpattn
