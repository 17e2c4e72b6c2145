// The ring schedule covers every visible (query, key) pair of the global sequence exactly once,
// and no hidden pair, for every layout, world size up to 16 and a set of masks.
#include <gtest/gtest.h>

#include <map>
#include <tuple>
#include <vector>

#include "cpattn/schedule.h"

namespace cpattn {
namespace {

struct MaskCase {
  bool causal;
  int64_t left, right;
  int64_t prefix = -kUnbounded;  // prefix-LM: keys below it seen by every query
};

const MaskCase kMasks[] = {
    {false, -1, -1},   {true, -1, -1},   {true, 5, -1},    {true, 0, -1},     {false, 7, 3},
    {false, 0, 0},     {false, -1, 2},   {false, 9, -1},   {true, 13, 4},     {false, 1, 20},
    {true, -1, -1, 5}, {true, 0, -1, 7}, {true, 3, -1, 1}, {false, 2, 2, 11}, {true, -1, -1, 1000}};

void check_coverage(Layout layout, int64_t world, int64_t seqlen, const MaskCase& mc) {
  Mask global;
  global.causal = mc.causal;
  global.window_left = mc.left;
  global.window_right = mc.right;
  global.prefix_end = mc.prefix;
  std::vector<int> seen(seqlen * seqlen, 0);
  for (int64_t rank = 0; rank < world; ++rank) {
    for (int64_t step = 0; step < world; ++step) {
      const StepSchedule sched = schedule_step(layout, seqlen, world, rank, step, global);
      ASSERT_EQ(sched.source, ((rank - step) % world + world) % world);
      for (int n = 0; n < sched.count; ++n) {
        const SubProblem& sp = sched.items[n];
        for (int64_t a = 0; a < sp.q.length; ++a)
          for (int64_t b = 0; b < sp.k.length; ++b) {
            if (!sp.mask.visible(a, b)) continue;
            const int64_t i = global_position(layout, seqlen, world, rank, sp.q.local_begin + a);
            const int64_t j =
                global_position(layout, seqlen, world, sched.source, sp.k.local_begin + b);
            ASSERT_TRUE(global.visible_pos(i, j)) << "hidden pair computed: i=" << i << " j=" << j
                                                  << " rank " << rank << " step " << step;
            ++seen[i * seqlen + j];
          }
        // Skipped sub-problems are only the empty ones: a computed one has a visible pair.
        ASSERT_NE(sp.mask.classify(0, sp.q.length, 0, sp.k.length), BlockKind::kEmpty);
      }
    }
  }
  for (int64_t i = 0; i < seqlen; ++i)
    for (int64_t j = 0; j < seqlen; ++j)
      ASSERT_EQ(seen[i * seqlen + j], global.visible_pos(i, j) ? 1 : 0)
          << "pair i=" << i << " j=" << j << " layout " << static_cast<int>(layout) << " W "
          << world << " causal " << mc.causal << " window " << mc.left << "," << mc.right
          << " prefix " << mc.prefix;
}

TEST(Schedule, CoversEveryVisiblePairOnce) {
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (int64_t world = 1; world <= 16; ++world)
      for (const MaskCase& mc : kMasks)
        check_coverage(layout, world, layout_granularity(layout, world) * 3, mc);
}

// Packed documents: pairs inside a document's real tokens are covered exactly once; nothing
// crosses documents or touches padding.
// prefixes (optional): each document's own prefix length (0: none) in place of mc.prefix.
void check_varlen_coverage(Layout layout, int64_t world, const std::vector<int64_t>& lengths,
                           const MaskCase& mc, const std::vector<int64_t>& prefixes = {}) {
  // The rule of document d: mc's, with its own prefix when given.
  auto rule = [&](size_t d) {
    Mask m;
    m.causal = mc.causal;
    m.window_left = mc.left;
    m.window_right = mc.right;
    m.prefix_end = prefixes.empty() ? mc.prefix : (prefixes[d] > 0 ? prefixes[d] : -kUnbounded);
    return m;
  };
  Mask global;
  global.causal = mc.causal;
  global.window_left = mc.left;
  global.window_right = mc.right;
  global.prefix_end = mc.prefix;
  const int64_t g = layout_granularity(layout, world);
  // Each rank's shard: per document, its part of the padded document. Map local index -> (doc,
  // position in doc) to check pairs.
  std::vector<int64_t> doc_of, pos_in_doc;
  std::vector<std::vector<int64_t>> local_doc(world), local_pos(world);
  for (int64_t r = 0; r < world; ++r)
    for (size_t d = 0; d < lengths.size(); ++d) {
      const int64_t padded = (lengths[d] + g - 1) / g * g;
      for (int64_t l = 0; l < padded / world; ++l) {
        local_doc[r].push_back(static_cast<int64_t>(d));
        local_pos[r].push_back(global_position(layout, padded, world, r, l));
      }
    }
  std::map<std::tuple<int64_t, int64_t, int64_t>, int> seen;  // (doc, i, j)
  for (int64_t rank = 0; rank < world; ++rank)
    for (int64_t step = 0; step < world; ++step) {
      const int64_t src = ring_source(rank, step, world);
      schedule_step_varlen(
          layout, lengths.data(), static_cast<int64_t>(lengths.size()), world, rank, step, global,
          [&](const SubProblem& sp) {
            for (int64_t a = 0; a < sp.q.length; ++a)
              for (int64_t b = 0; b < sp.k.length; ++b) {
                if (!sp.mask.visible(a, b)) continue;
                const int64_t qa = sp.q.local_begin + a, kb = sp.k.local_begin + b;
                const int64_t d = local_doc[rank][qa];
                ASSERT_EQ(d, local_doc[src][kb]) << "pair crosses documents";
                const int64_t i = local_pos[rank][qa], j = local_pos[src][kb];
                ASSERT_LT(i, lengths[d]) << "padding query";
                ASSERT_LT(j, lengths[d]) << "padding key";
                ASSERT_TRUE(rule(d).visible_pos(i, j));
                ++seen[{d, i, j}];
              }
          },
          prefixes.empty() ? nullptr : prefixes.data());
    }
  for (size_t d = 0; d < lengths.size(); ++d)
    for (int64_t i = 0; i < lengths[d]; ++i)
      for (int64_t j = 0; j < lengths[d]; ++j) {
        const auto it = seen.find({static_cast<int64_t>(d), i, j});
        ASSERT_EQ(it == seen.end() ? 0 : it->second, rule(d).visible_pos(i, j) ? 1 : 0)
            << "doc " << d << " i=" << i << " j=" << j << " W " << world;
      }
}

TEST(Schedule, VarlenCoversEachDocumentOnce) {
  const std::vector<int64_t> lengths = {1, 0, 13, 5, 2, 31};
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (int64_t world = 1; world <= 6; ++world)
      for (const MaskCase& mc : kMasks) check_varlen_coverage(layout, world, lengths, mc);
}

TEST(Schedule, VarlenPrefixPerDocument) {
  const std::vector<int64_t> lengths = {1, 0, 13, 5, 2, 31};
  const std::vector<int64_t> prefixes = {1, 0, 4, 0, 2, 17};  // whole documents and none too
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (int64_t world = 1; world <= 5; ++world)
      for (const MaskCase& mc : {MaskCase{true, -1, -1}, MaskCase{true, 3, -1}})
        check_varlen_coverage(layout, world, lengths, mc, prefixes);
}

TEST(Layout, PositionsArePermutation) {
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (int64_t world = 1; world <= 16; ++world) {
      const int64_t seqlen = layout_granularity(layout, world) * 2;
      std::vector<int> hits(seqlen, 0);
      for (int64_t r = 0; r < world; ++r)
        for (int64_t l = 0; l < seqlen / world; ++l) {
          const int64_t g = global_position(layout, seqlen, world, r, l);
          ASSERT_GE(g, 0);
          ASSERT_LT(g, seqlen);
          ++hits[g];
        }
      for (int h : hits) ASSERT_EQ(h, 1);
    }
}

TEST(Layout, ZigzagHoldsChunksRAnd2WMinus1MinusR) {
  const int64_t world = 4, seqlen = 32, segment = 4;
  for (int64_t r = 0; r < world; ++r) {
    EXPECT_EQ(global_position(Layout::kZigzag, seqlen, world, r, 0), r * segment);
    EXPECT_EQ(global_position(Layout::kZigzag, seqlen, world, r, segment),
              (2 * world - 1 - r) * segment);
  }
}

// Packed documents: each padded to the granularity, one after the other; every rank's runs of a
// document are that rank's shard of it, moved to where the document starts in the shard.
TEST(Layout, DocumentShardsPadAndFollowEachOther) {
  const int64_t lengths[] = {5, 0, 13, 1, 24, 7};
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (int64_t world = 1; world <= 8; ++world) {
      const int64_t g = layout_granularity(layout, world);
      int64_t begin = 0;
      for (int64_t n : lengths)
        for (int64_t rank = 0; rank < world; ++rank) {
          const DocumentShard d = document_shard(layout, n, world, rank, begin);
          ASSERT_EQ(d.padded, (n + g - 1) / g * g);
          ASSERT_EQ(d.padded % g, 0);
          ASSERT_EQ(d.global_begin, begin);
          ASSERT_EQ(d.local_begin, begin / world);
          const ShardRuns plain = shard_runs(layout, d.padded, world, rank);
          ASSERT_EQ(d.runs.count, plain.count);
          for (int i = 0; i < plain.count; ++i) {
            EXPECT_EQ(d.runs.runs[i].local_begin, plain.runs[i].local_begin + begin / world);
            EXPECT_EQ(d.runs.runs[i].global_begin, plain.runs[i].global_begin);
            EXPECT_EQ(d.runs.runs[i].length, plain.runs[i].length);
          }
          if (rank + 1 == world) begin += d.padded;
        }
      EXPECT_EQ(padded_documents_length(layout, lengths, 6, world), begin);
    }
}

}  // namespace
}  // namespace cpattn
