// How a global sequence of S tokens is split over W ranks, as runs of global positions.
//   contiguous: rank r holds [r*S/W, (r+1)*S/W).
//   zigzag:     S is cut into 2W segments; rank r holds segment r, then segment 2W-1-r.
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
      const int64_t segment = local / 2;
      return {2,
              {{0, segment, rank * segment, 1},
               {segment, segment, (2 * world - 1 - rank) * segment, 1}}};
    }
    case Layout::kStriped:
      return {1, {{0, local, rank, world}, {0, 0, 0, 1}}};
    default:
      return {1, {{0, local, rank * local, 1}, {0, 0, 0, 1}}};
  }
}

// Packed documents (ring_attention_varlen's sharding): each document is padded to a multiple of
// the layout granularity and sharded on its own; a rank's shard is its part of document 0, then
// of document 1, ... The one home of this rule: the ring schedule (schedule.h), the ring and
// invariant ops and, through the op document_shards, Python (cpattn/core/layout.py).
CPATTN_HOST_DEVICE int64_t padded_document_length(Layout layout, int64_t length, int64_t world) {
  const int64_t granularity = layout_granularity(layout, world);
  return (length + granularity - 1) / granularity * granularity;
}

// One document of the packed sequence as `rank` holds it.
struct DocumentShard {
  int64_t padded;        // its length padded to the granularity
  int64_t global_begin;  // where it starts in the padded packed sequence
  int64_t local_begin;   // where its part starts in every rank's shard (global_begin / world)
  ShardRuns runs;  // rank's runs of it: local_begin in the shard, global_begin in the document
};

// The document of `length` tokens that starts at `global_begin` of the padded packed sequence
// (the previous document's global_begin + padded; 0 for the first).
CPATTN_HOST_DEVICE DocumentShard document_shard(Layout layout, int64_t length, int64_t world,
                                                int64_t rank, int64_t global_begin) {
  DocumentShard d;
  d.padded = padded_document_length(layout, length, world);
  d.global_begin = global_begin;
  d.local_begin = global_begin / world;
  d.runs = shard_runs(layout, d.padded, world, rank);
  for (int i = 0; i < d.runs.count; ++i) d.runs.runs[i].local_begin += d.local_begin;
  return d;
}

// The padded packed sequence's length: every document padded as document_shard pads it.
CPATTN_HOST_DEVICE int64_t padded_documents_length(Layout layout, const int64_t* lengths,
                                                   int64_t num_docs, int64_t world) {
  int64_t total = 0;
  for (int64_t d = 0; d < num_docs; ++d) total += padded_document_length(layout, lengths[d], world);
  return total;
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
