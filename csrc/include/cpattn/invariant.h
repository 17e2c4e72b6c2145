// Invariant mode's reduction structure over keys (docs/invariance.md): every query row's keys are
// cut into tiles of kInvariantTile from the sequence's (document's) key 0; each tile's partial
// result is computed on its own (the kernels fold its key blocks in order), and the partial
// results merge in the order of a binary tree over the tile index, a tile that holds no visible key
// counting as empty (merging an empty result changes no bit). So a row's bits do not depend on
// who computes which tile: one process over the whole sequence, a rank over gathered keys, or the
// owners of a KV cache's blocks of tiles (each merges its aligned blocks; the blocks' results merge
// on). Host code: the op layer (csrc/ops/invariant.cpp) runs the tiles and merges.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "cpattn/config.h"

namespace cpattn {

constexpr int64_t kInvariantTile = 1024;  // keys per tile (a multiple of every kernel's key block)

// Query rows per row band of the backward's fixed-order dK / dV sums (from a document's row 0), a
// multiple of every kernel's key block. The streamed backward's parts of the queries (dK, dV)
// and of the keys (dQ) start at multiples of it, so the kernels' sums continue across parts.
constexpr int64_t kInvariantRowBand = 1024;

// The level of the smallest aligned block of tiles that holds tiles a and b (a != b): the bit
// length of a ^ b. Level 0 is one tile.
CPATTN_HOST_DEVICE int tile_tree_level(int64_t a, int64_t b) {
  int level = 0;
  for (uint64_t x = static_cast<uint64_t>(a ^ b); x != 0; x >>= 1) ++level;
  return level;
}

// Merges partial results pushed in increasing tile order as the binary tree over tile indices
// does: a result may stand for an aligned block of tiles already merged (pushed with its first
// tile). merge(a, b) merges b (the later keys) into a. The stack holds at most one result per
// level: O(log tiles) pending results.
template <typename Result, typename Merge>
class TileTree {
 public:
  explicit TileTree(Merge merge) : merge_(std::move(merge)) {}

  void push(int64_t tile, Result result) {
    // Pairs below whose common block ends before `tile` are complete: merge them first. The
    // levels of neighbouring pairs then fall towards the top.
    while (stack_.size() >= 2 &&
           tile_tree_level(stack_[stack_.size() - 2].first, stack_.back().first) <
               tile_tree_level(stack_.back().first, tile))
      pop_merge();
    stack_.emplace_back(tile, std::move(result));
  }
  bool empty() const { return stack_.empty(); }
  // The merged result (call once, when not empty).
  Result finish() {
    while (stack_.size() >= 2) pop_merge();
    return std::move(stack_.back().second);
  }

 private:
  void pop_merge() {
    Result top = std::move(stack_.back().second);
    stack_.pop_back();
    merge_(stack_.back().second, top);
  }
  Merge merge_;
  std::vector<std::pair<int64_t, Result>> stack_;
};

}  // namespace cpattn
