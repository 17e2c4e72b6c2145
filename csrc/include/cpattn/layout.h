// How a global sequence of S tokens is split over W ranks, as runs of global positions.
//   contiguous: rank r holds [r*S/W, (r+1)*S/W).
//   zigzag:     S is cut into 2W chunks; rank r holds chunk r, then chunk 2W-1-r.
//   striped:    rank r holds tokens r, r+W, r+2W, ...
// Local token l of a run sits at global position global_begin + (l - local_begin) * global_stride.
#pragma once

#include <cstdint>

#include "cpattn/config.h"

namespace cpattn {

enum class Layout : int { kContiguous = 0, kZigzag = 1, kStriped = 2 };

// Tokens [local_begin, local_begin + length) of a rank's shard.
struct Run {
  int64_t local_begin;
  int64_t length;
  int64_t global_begin;
  int64_t global_stride;
};

// The global length must be a multiple of this for the layout (checked by the op layer).
CPATTN_HOST_DEVICE int64_t layout_granularity(Layout layout, int64_t world) {
  return layout == Layout::kZigzag ? 2 * world : world;
}

struct ShardRuns {
  int count;
  Run runs[2];
};

CPATTN_HOST_DEVICE ShardRuns shard_runs(Layout layout, int64_t seqlen, int64_t world,
                                        int64_t rank) {
  const int64_t local = seqlen / world;
  switch (layout) {
    case Layout::kZigzag: {
      const int64_t chunk = local / 2;
      return {2, {{0, chunk, rank * chunk, 1}, {chunk, chunk, (2 * world - 1 - rank) * chunk, 1}}};
    }
    case Layout::kStriped:
      return {1, {{0, local, rank, world}, {0, 0, 0, 1}}};
    default:
      return {1, {{0, local, rank * local, 1}, {0, 0, 0, 1}}};
  }
}

// Global position of local token l of `rank`.
CPATTN_HOST_DEVICE int64_t global_position(Layout layout, int64_t seqlen, int64_t world,
                                           int64_t rank, int64_t l) {
  const ShardRuns s = shard_runs(layout, seqlen, world, rank);
  for (int i = 0; i < s.count; ++i) {
    const Run& run = s.runs[i];
    if (l >= run.local_begin && l < run.local_begin + run.length)
      return run.global_begin + (l - run.local_begin) * run.global_stride;
  }
  return -1;
}

}  // namespace cpattn
