// Block iteration of the tiled kernels, derived from the mask rule (mask.h): which key blocks a
// block of query rows visits (forward, dQ pass), which query blocks a block of keys visits
// (dK/dV pass), whether a visited block needs element masking, and the per-row / per-key bounds
// that the element masking compares against. Shared by the CUDA kernels and the host tests, so
// that the skipping and masking logic is tested without a GPU.
//
// Blocks are aligned to multiples of the block size from local index 0; the last block of a
// sequence may be cut short by the sequence end. A block that is visited but not "full" is
// masked element by element; every other pair is skipped, so each visible pair is computed once.
#pragma once

#include <cstdint>

#include "cpattn/config.h"
#include "cpattn/mask.h"

namespace cpattn {

// Inclusive range of block indices; empty when first > last.
struct BlockRange {
  int first;
  int last;
  CPATTN_HOST_DEVICE bool empty() const { return first > last; }
  CPATTN_HOST_DEVICE int count() const { return empty() ? 0 : last - first + 1; }
};

CPATTN_HOST_DEVICE int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
CPATTN_HOST_DEVICE int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

// Key blocks (of block_n keys) that query rows [r0, r1) see some key of.
CPATTN_HOST_DEVICE BlockRange key_blocks_of_rows(const Mask& m, int64_t r0, int64_t r1,
                                                 int64_t seqlen_k, int block_n) {
  const PosRange s = m.key_span(r0, r1, seqlen_k);
  if (s.empty()) return {0, -1};
  return {static_cast<int>(s.first / block_n), static_cast<int>(s.last / block_n)};
}

// Query blocks (of block_m rows) that some key of columns [c0, c1) is seen by.
CPATTN_HOST_DEVICE BlockRange query_blocks_of_keys(const Mask& m, int64_t c0, int64_t c1,
                                                   int64_t seqlen_q, int block_m) {
  const PosRange s = m.query_span(c0, c1, seqlen_q);
  if (s.empty()) return {0, -1};
  return {static_cast<int>(s.first / block_m), static_cast<int>(s.last / block_m)};
}

// Whether the tile of query block rows [r0, r0 + block_m) x key block columns [c0, c0 + block_n)
// must be masked element by element: the rule cuts it (not every in-range pair visible), or a
// sequence end cuts it (the tile's out-of-range keys must not enter the softmax).
CPATTN_HOST_DEVICE bool tile_needs_mask(const Mask& m, int64_t r0, int block_m, int64_t c0,
                                        int block_n, int64_t seqlen_q, int64_t seqlen_k) {
  if (c0 + block_n > seqlen_k || r0 + block_m > seqlen_q) return true;
  return m.classify(r0, r0 + block_m, c0, c0 + block_n) != BlockKind::kFull;
}

// Whether the tile holds no visible pair at all (it can then be skipped).
CPATTN_HOST_DEVICE bool tile_is_empty(const Mask& m, int64_t r0, int block_m, int64_t c0,
                                      int block_n, int64_t seqlen_q, int64_t seqlen_k) {
  return m.classify(r0, min_i64(r0 + block_m, seqlen_q), c0, min_i64(c0 + block_n, seqlen_k)) ==
         BlockKind::kEmpty;
}

// Local key columns [lo, hi] visible to local query row r, clipped to [0, seqlen_k): key column c
// of row r is visible iff lo <= c <= hi (32-bit compares in the kernels' inner loops).
struct IndexBounds {
  int lo;
  int hi;
  CPATTN_HOST_DEVICE bool contains(int i) const { return i >= lo && i <= hi; }
};

CPATTN_HOST_DEVICE IndexBounds clip_bounds(int64_t lo, int64_t hi, int64_t n) {
  // lo in [0, n], hi in [-1, n - 1]: an empty range stays empty after clipping.
  lo = max_i64(lo, 0);
  lo = min_i64(lo, n);
  hi = min_i64(hi, n - 1);
  hi = max_i64(hi, -1);
  return {static_cast<int>(lo), static_cast<int>(hi)};
}

CPATTN_HOST_DEVICE IndexBounds visible_keys_of_row(const Mask& m, int64_t r, int64_t seqlen_k) {
  const int64_t i = m.q_offset + r;
  return clip_bounds(m.first_key(i) - m.k_offset, m.last_key(i) - m.k_offset, seqlen_k);
}

// Local key columns [lo, hi] of the prefix (mask.h, prefix_end), clipped to [0, seqlen_k); empty
// without a prefix. With a prefix, key column c of row r is visible iff c is in this range or in
// visible_keys_of_row(m, r, seqlen_k) (the union of mask.h's rule).
CPATTN_HOST_DEVICE IndexBounds prefix_keys(const Mask& m, int64_t seqlen_k) {
  return clip_bounds(0, m.prefix_end - 1 - m.k_offset, seqlen_k);
}

// Local query rows [lo, hi] that see local key column c, clipped to [0, seqlen_q).
CPATTN_HOST_DEVICE IndexBounds visible_rows_of_key(const Mask& m, int64_t c, int64_t seqlen_q) {
  const int64_t j = m.k_offset + c;
  return clip_bounds(m.first_query(j) - m.q_offset, m.last_query(j) - m.q_offset, seqlen_q);
}

// The head dim a kernel is compiled for that serves head dim d: the smallest compiled one >= d
// (the op layer zero-pads q, k, v up to it), or -1 when d exceeds them all.
inline int pick_kernel_head_dim(int d, const int* compiled, int count) {
  int best = -1;
  for (int i = 0; i < count; ++i)
    if (compiled[i] >= d && (best < 0 || compiled[i] < best)) best = compiled[i];
  return best;
}

}  // namespace cpattn
