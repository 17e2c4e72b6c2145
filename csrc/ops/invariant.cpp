// Invariant mode (invariant=True): results that do not depend on the number of ranks, the layout
// or the strategy, bit for bit. Each rank computes exactly what one process computes for its own
// query rows (out, lse, dQ) and its own keys (dK, dV): the operands it needs are gathered in
// global order (python/cpattn/strategies/invariant.py) and every sum runs in an order fixed by
// global positions alone. The forward cuts each row's keys (those of its document, with packed
// documents) into tiles from key 0 and merges the tiles' partial results by the tile tree
// (cpattn/invariant.h); the kernels treat every query row alike. The backward runs with
// AttnShape::fixed_order (one key split, query chunks of a fixed size from row 0) and needs only
// the final out and lse. Contiguous and zigzag shards are runs of consecutive positions, which the
// kernels' offsets express; striped shards are moved to the contiguous layout before (Relayout).
// The same tiles serve a KV cache sharded in blocks of whole tiles (invariant_partial,
// invariant_merge: python/cpattn/inference.py). docs/invariance.md.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpattn/invariant.h"
#include "cpattn/layout.h"
#include "cpattn/schedule.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/options.h"
#include "ops/ring.h"

namespace cpattn::ops {
namespace {

// A run of this rank's rows inside one document (one sequence without documents): the rows
// (global_begin: the position of the first inside the document), where the document's tokens
// start in global order (the gathered tensors) and its real length, and the mask of its rows.
struct Piece {
  Run rows;
  int64_t doc_begin;
  int64_t doc_length;
  Mask mask;
};

struct InvariantCall {
  int64_t world, rank;
  RingOptions options;  // with the layout and the documents
  std::vector<Piece> pieces;
};

// Every piece of this rank: its shard's runs of each document (cut at the document's real
// length; the rest is padding), documents sharded on their own as ring_attention_varlen's
// (cpattn/schedule.h: schedule_step_varlen). Without documents: one of `seqlen` real tokens.
// With one rank and no documents q may be shorter than the keys: bottom-right aligned, as
// cpattn.attention; with one rank every layout keeps the global order, so a document's rows are
// one run.
std::vector<Piece> rank_pieces(const RingOptions& o, int64_t world, int64_t rank, int64_t local_q,
                               int64_t local_k, int64_t seqlen) {
  const Mask global = global_mask(o);
  std::vector<Piece> pieces;
  if (o.doc_lengths.empty() && world == 1) {
    Mask m = global;
    m.q_offset = seqlen - local_q;
    return {{{0, local_q, seqlen - local_q, 1}, 0, seqlen, m}};
  }
  const std::vector<int64_t> lengths =
      o.doc_lengths.empty() ? std::vector<int64_t>{seqlen} : o.doc_lengths;
  const int64_t granularity = layout_granularity(o.layout, world);
  int64_t global_begin = 0;
  for (size_t d = 0; d < lengths.size(); ++d) {
    const int64_t padded = o.doc_lengths.empty()
                               ? local_k * world
                               : (lengths[d] + granularity - 1) / granularity * granularity;
    Mask m = global;
    if (!o.doc_prefix_lens.empty())
      m.prefix_end = o.doc_prefix_lens[d] > 0 ? o.doc_prefix_lens[d] : -kUnbounded;
    const ShardRuns s = world == 1 ? ShardRuns{1, {{0, padded, 0, 1}, {0, 0, 0, 1}}}
                                   : shard_runs(o.layout, padded, world, rank);
    for (int i = 0; i < s.count; ++i) {
      Run run = s.runs[i];
      run.local_begin += global_begin / world;
      run.length = run_length_below(run, lengths[d]);
      m.q_offset = run.global_begin;
      if (run.length > 0) pieces.push_back({run, global_begin, lengths[d], m});
    }
    global_begin += padded;
  }
  return pieces;
}

// Checks before any kernel runs; every rank passes the same values (agreed on in Python). q this
// rank's shard (B, L, H, D); k (B, W L, Hkv, D) every rank's keys in global order (with one rank:
// the keys, which q's rows may be fewer than), `keys` of them (k may be this rank's shard alone,
// for a call that needs no other keys); doc_lengths as ring_fwd's (the documents' lengths, and as
// a second row their prefixes), or none: one sequence of `seqlen` real tokens.
InvariantCall check_invariant_args(const char* fn, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, int64_t keys, int64_t rank, int64_t world,
                                   int64_t layout, int64_t seqlen,
                                   const std::optional<at::Tensor>& doc_lengths,
                                   const AttentionOptions& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                  k.sizes().slice(0, 3) == v.sizes().slice(0, 3) && k.size(0) == q.size(0) &&
                  k.size(3) == q.size(3),
              "cpattn.", fn,
              ": q must be (batch, seqlen_local, heads, head_dim) and k, v (batch, "
              "seqlen, kv_heads, head_dim / v_head_dim) in global order, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.device().is_cpu(), "cpattn.", fn,
              ": invariant=True runs on CPU tensors only in this version (not run on a GPU "
              "yet), got q on ",
              q.device());
  check_rank(rank, world);
  check_options(fn, options, q.size(2), q.device());
  const RingOptions o = make_ring_options(options, layout, doc_lengths, std::nullopt);
  TORCH_CHECK(world == 1 || o.layout != Layout::kStriped, "cpattn.", fn,
              ": takes contiguous or zigzag shards (runs of consecutive positions; the Python "
              "side moves striped shards to the contiguous layout first)");
  const bool documents = !o.doc_lengths.empty();
  TORCH_CHECK(world == 1 && !documents ? keys >= q.size(1) : keys == q.size(1) * world, "cpattn.",
              fn, ": k and v must hold the ", world, " ranks' shards of ", q.size(1),
              " tokens, got ", keys);
  if (documents) {
    const int64_t g = layout_granularity(o.layout, world);
    int64_t total = 0;
    for (int64_t n : o.doc_lengths) total += (n + g - 1) / g * g;
    TORCH_CHECK(total == keys, "cpattn.", fn, ": with these documents (each padded to a ",
                "multiple of ", g, ") the sequence holds ", total, " tokens, k and v ", keys);
  } else {
    TORCH_CHECK(world == 1 || o.layout != Layout::kZigzag || q.size(1) % 2 == 0, "cpattn.", fn,
                ": the zigzag layout holds two equal chunks per rank, so the local sequence "
                "length must be even, got ",
                q.size(1));
    TORCH_CHECK(seqlen >= (world == 1 ? keys : 1) && seqlen <= keys, "cpattn.", fn,
                ": seqlen must be in [1, ", keys, "] (with one rank: every key), got ", seqlen);
  }
  return {world, rank, o, rank_pieces(o, world, rank, q.size(1), keys / world, seqlen)};
}

// The score arguments of rows and keys at the mask's positions, with the sinks when given.
ScoreArgs fixed_order_score(const AttentionOptions& o, const Mask& m,
                            const std::optional<at::Tensor>& sinks) {
  ScoreArgs a = score_args(o);
  a.sinks = sinks;
  a.alibi_q_begin = m.q_offset;
  a.alibi_k_begin = m.k_offset;
  a.fixed_order = true;
  return a;
}

// A partial result: out (B, R, H, Dv) and lse (B, H, R), float32.
using Partial = std::pair<at::Tensor, at::Tensor>;

Partial empty_partial(const at::Tensor& q, int64_t dv) {
  return {at::zeros({q.size(0), q.size(1), q.size(2), dv}, q.options().dtype(at::kFloat)),
          at::full({q.size(0), q.size(2), q.size(1)}, -INFINITY, q.options().dtype(at::kFloat))};
}

// Rows of about this many bytes of fp32 partial results at a time: the tree holds one per level.
constexpr int64_t kPartialBytes = int64_t{1} << 20;

// Query rows q (B, R, H, D) against keys k, v (B, N, Hkv, D / Dv) that start at tile
// `first_tile` (mask and score on their positions, no sinks): the keys' tiles one by one (a tile
// no row sees is skipped: it would merge as empty), merged by the tile tree (cpattn/invariant.h).
// Rows go in groups (a row's bits never depend on the others) to bound the pending results.
Partial tile_tree_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      double softmax_scale, const Mask& mask, const ScoreArgs& score,
                      int64_t first_tile) {
  const int64_t rows = q.size(1), keys = k.size(1), dv = v.size(3);
  Partial result = empty_partial(q, dv);
  const int64_t row_bytes = q.size(0) * q.size(2) * dv * 4;
  const int64_t group = std::max<int64_t>(256, kPartialBytes / std::max<int64_t>(1, row_bytes));
  const auto merge = [](Partial& a, const Partial& b) {
    merge_into(a.first, a.second, b.first, b.second);
  };
  for (int64_t r0 = 0; r0 < rows; r0 += group) {
    const int64_t n = std::min(group, rows - r0);
    const at::Tensor q_rows = q.narrow(1, r0, n);
    TileTree<Partial, decltype(merge)> tree(merge);
    for (int64_t t0 = 0; t0 < keys; t0 += kInvariantTile) {
      const int64_t cols = std::min(kInvariantTile, keys - t0);
      Mask m = mask;
      m.q_offset += r0;
      m.k_offset += t0;
      if (m.classify(0, n, 0, cols) == BlockKind::kEmpty) continue;
      ScoreArgs a = score;
      a.alibi_q_begin += r0;
      a.alibi_k_begin += t0;
      auto [o, l] = attention_fwd_scored(q_rows, k.narrow(1, t0, cols), v.narrow(1, t0, cols),
                                         softmax_scale, m, a, at::kFloat);
      tree.push(first_tile + t0 / kInvariantTile, {std::move(o), std::move(l)});
    }
    if (tree.empty()) continue;
    const auto [o, l] = tree.finish();
    result.first.narrow(1, r0, n).copy_(o);
    result.second.narrow(2, r0, n).copy_(l);
  }
  return result;
}

std::tuple<at::Tensor, at::Tensor> invariant_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, int64_t rank, int64_t world,
                                                 int64_t layout, int64_t seqlen,
                                                 const std::optional<at::Tensor>& doc_lengths,
                                                 const std::optional<at::Tensor>& sinks,
                                                 CPATTN_OPTION_PARAMS) {
  const InvariantCall c = check_invariant_args("invariant_fwd", q, k, v, k.size(1), rank, world,
                                               layout, seqlen, doc_lengths, CPATTN_OPTIONS);
  check_per_head("invariant_fwd", "sinks", sinks, q.size(2), q.device());
  // Padding rows: out 0, lse -inf (with a sink: the sink), as the ring gives them.
  Partial result = empty_partial(q, v.size(3));
  for (const Piece& p : c.pieces) {
    const auto [o, l] = tile_tree_fwd(q.narrow(1, p.rows.local_begin, p.rows.length),
                                      k.narrow(1, p.doc_begin, p.doc_length),
                                      v.narrow(1, p.doc_begin, p.doc_length), softmax_scale, p.mask,
                                      fixed_order_score(c.options, p.mask, std::nullopt), 0);
    result.first.narrow(1, p.rows.local_begin, p.rows.length).copy_(o);
    result.second.narrow(2, p.rows.local_begin, p.rows.length).copy_(l);
  }
  if (sinks) apply_sinks_(result.first, result.second, *sinks);  // once, after the last merge
  return {result.first.to(q.scalar_type()), result.second};
}

// With one rank: k, v every key, and q, dout, out, lse and dlse are everything: dQ, dK and dV of
// one call. Over W ranks two passes, each run when its operands are given: the dQ pass (k_all,
// v_all: every rank's keys in global order, as invariant_fwd's k, v) and the dK / dV pass (k, v
// this rank's shard; q_all, dout_all (B, W L, H, D / Dv), lse_all and shifted_all (B, H, W L):
// every rank's, in global order, shifted = dlse - rowsum(dout * out) (op row_dot; the
// backward's delta - dlse is -shifted, the same bits a call given out and dlse computes: IEEE
// subtraction is antisymmetric)); a pass not run returns empty tensors, so that the caller can
// free one pass's gathered operands before it gathers the other's. Returns dq (q's rows) and
// dk, dv (this rank's keys) in the inputs' dtypes, padding rows and keys 0; and with sinks (in
// the dK / dV pass) their gradient (H,) fp32 over every real row of the sequence on rank 0, 0
// elsewhere: summed over the ranks (the usual gradient all-reduce) it is exactly the
// one-process gradient, whatever the number of ranks (no sinks: an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> invariant_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& k_all, const std::optional<at::Tensor>& v_all,
    const std::optional<at::Tensor>& q_all, const std::optional<at::Tensor>& dout_all,
    const std::optional<at::Tensor>& lse_all, const std::optional<at::Tensor>& shifted_all,
    const std::optional<at::Tensor>& sinks, int64_t rank, int64_t world, int64_t layout,
    int64_t seqlen, const std::optional<at::Tensor>& doc_lengths, CPATTN_OPTION_PARAMS) {
  const bool dq_pass = world > 1 && k_all && v_all;
  const bool dkv_pass = world > 1 && q_all && dout_all && lse_all && shifted_all;
  TORCH_CHECK(world == 1 || k.size(1) == q.size(1), "cpattn.invariant_bwd: over ", world,
              " ranks k and v are this rank's shard of ", q.size(1), " tokens, got ", k.size(1));
  TORCH_CHECK(world == 1 || ((k_all.has_value() == v_all.has_value()) && (dq_pass || dkv_pass) &&
                             (!dq_pass || k_all->size(1) == q.size(1) * world)),
              "cpattn.invariant_bwd: over ", world,
              " ranks give k_all and v_all (every rank's "
              "keys: the dQ pass) or q_all, dout_all, lse_all and shifted_all (the dK / dV pass)");
  const InvariantCall c =
      check_invariant_args("invariant_bwd", q, dq_pass ? *k_all : k, dq_pass ? *v_all : v,
                           world == 1 ? k.size(1) : q.size(1) * world, rank, world, layout, seqlen,
                           doc_lengths, CPATTN_OPTIONS);
  check_per_head("invariant_bwd", "sinks", sinks, q.size(2), q.device());
  const auto grads = [&](const Mask& mask, const at::Tensor& dout_rows, const at::Tensor& q_rows,
                         const at::Tensor& k_rows, const at::Tensor& v_rows,
                         const at::Tensor& out_rows, const at::Tensor& lse_rows,
                         const std::optional<at::Tensor>& dlse_rows, bool want_dq, bool want_dkv) {
    return attention_bwd_some_scored(
        dout_rows, q_rows, k_rows, v_rows, out_rows, lse_rows, softmax_scale, mask,
        fixed_order_score(c.options, mask, std::nullopt), dlse_rows, want_dq, want_dkv);
  };
  // With sinks: their gradient over every real row of the sequence on rank 0 (sink_bwd's fixed
  // order), from each row's lse and delta - dlse (given as -shifted: dout and out of one zero
  // column, or with one rank dout and out themselves).
  const auto sink_grads = [&](std::vector<at::Tensor> dout_g, std::vector<at::Tensor> out_g,
                              const std::vector<at::Tensor>& lse_g,
                              const std::vector<at::Tensor>& dlse_g) {
    const auto f32 = q.options().dtype(at::kFloat);
    if (!sinks) return at::empty({0}, f32);
    if (rank != 0) return at::zeros({q.size(2)}, f32);
    return backend_for(q.device())
        .sink_bwd(at::cat(dout_g, 1), at::cat(out_g, 1), at::cat(lse_g, 2),
                  sinks->to(at::kFloat).contiguous(),
                  dlse_g.empty() ? std::nullopt : std::optional(at::cat(dlse_g, 2)));
  };
  // One piece over every row and key of this rank: its gradients are the outputs, not copied
  // into zeroed ones (padding and several pieces). A pass not run: empty tensors.
  const int64_t local_k = world == 1 ? k.size(1) : q.size(1);
  const bool whole = c.pieces.size() == 1 && c.pieces[0].rows.length == q.size(1) &&
                     (world == 1 ? c.pieces[0].doc_length : c.pieces[0].rows.length) == local_k;
  const at::Tensor none = at::empty({0}, q.options());
  at::Tensor dq = none, dk = none, dv = none;
  if (!whole && (world == 1 || dq_pass)) dq = at::zeros_like(q);
  if (!whole && (world == 1 || dkv_pass)) {
    dk = at::zeros({q.size(0), local_k, k.size(2), k.size(3)}, q.options());
    dv = at::zeros({q.size(0), local_k, v.size(2), v.size(3)}, q.options());
  }
  // all's tokens [begin, begin + part's) are part
  const auto put = [&](at::Tensor& all, const at::Tensor& part, int64_t begin) {
    if (whole)
      all = part;
    else
      all.narrow(1, begin, part.size(1)).copy_(part);
  };
  std::vector<at::Tensor> dout_rows, out_rows, lse_rows, dlse_rows;
  if (world == 1) {  // each document's rows against its keys: dQ, dK and dV of one call
    for (const Piece& p : c.pieces) {
      const auto mine = [&](const at::Tensor& t, int64_t dim) {
        return t.narrow(dim, p.rows.local_begin, p.rows.length);
      };
      const auto doc = [&](const at::Tensor& t) { return t.narrow(1, p.doc_begin, p.doc_length); };
      const std::optional<at::Tensor> dlse_p =
          dlse ? std::optional(mine(*dlse, 2).contiguous()) : std::nullopt;
      const auto [dq_p, dk_p, dv_p] =
          grads(p.mask, mine(dout, 1), mine(q, 1), doc(k), doc(v), mine(out, 1),
                mine(lse, 2).contiguous(), dlse_p, true, true);
      put(dq, dq_p, p.rows.local_begin);
      put(dk, dk_p, p.doc_begin);
      put(dv, dv_p, p.doc_begin);
      dout_rows.push_back(mine(dout, 1));
      out_rows.push_back(mine(out, 1));
      lse_rows.push_back(mine(lse, 2));
      if (dlse_p) dlse_rows.push_back(*dlse_p);
    }
    return {dq, dk, dv, sink_grads(dout_rows, out_rows, lse_rows, dlse_rows)};
  }
  int64_t last_doc = -1;
  for (const Piece& p : c.pieces) {
    const auto mine = [&](const at::Tensor& t, int64_t dim) {
      return t.narrow(dim, p.rows.local_begin, p.rows.length);
    };
    const auto doc = [&](const at::Tensor& t, int64_t dim) {
      return t.narrow(dim, p.doc_begin, p.doc_length);
    };
    if (dq_pass) {  // dQ of these rows against the document's keys (their dK, dV: other ranks')
      const auto dq_p = std::get<0>(
          grads(p.mask, mine(dout, 1), mine(q, 1), doc(*k_all, 1), doc(*v_all, 1), mine(out, 1),
                mine(lse, 2).contiguous(),
                dlse ? std::optional(mine(*dlse, 2).contiguous()) : std::nullopt, true, false));
      put(dq, dq_p, p.rows.local_begin);
    }
    if (!dkv_pass) continue;
    // dK and dV of these keys against the document's queries (their dQ is the other ranks').
    Mask keys = p.mask;  // every query of the document against these keys
    keys.q_offset = 0;
    keys.k_offset = p.rows.global_begin;
    const auto [unused, dk_p, dv_p] =
        grads(keys, doc(*dout_all, 1), doc(*q_all, 1), mine(k, 1), mine(v, 1), at::Tensor(),
              doc(*lse_all, 2), doc(*shifted_all, 2), false, true);
    put(dk, dk_p, p.rows.local_begin);
    put(dv, dv_p, p.rows.local_begin);
    if (p.doc_begin != last_doc) {  // the sinks' rows: every real row of each document, once
      lse_rows.push_back(doc(*lse_all, 2));
      dlse_rows.push_back(doc(*shifted_all, 2));
      last_doc = p.doc_begin;
    }
  }
  if (!dkv_pass) return {dq, dk, dv, at::empty({0}, q.options().dtype(at::kFloat))};
  if (sinks && rank == 0) {  // zero columns: delta - dlse = -shifted
    for (const at::Tensor& l : lse_rows)
      dout_rows.push_back(at::zeros({q.size(0), l.size(2), q.size(2), 1}, q.options()));
    out_rows = dout_rows;
  }
  return {dq, dk, dv, sink_grads(dout_rows, out_rows, lse_rows, dlse_rows)};
}

// Invariant mode over a KV cache sharded in blocks of whole tiles (python/cpattn/inference.py):
// the partial result of query rows q (B, R, H, D) at positions q_begin.. over the keys k, v
// (B, N, Hkv, D / Dv) at positions k_begin.. (a tile boundary), their tiles merged by the tile
// tree: out (B, R, H, Dv) and lse (B, H, R) float32, no sinks.
std::tuple<at::Tensor, at::Tensor> invariant_partial(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, int64_t q_begin,
                                                     int64_t k_begin, CPATTN_OPTION_PARAMS) {
  const AttentionOptions o = CPATTN_OPTIONS;
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                  k.sizes().slice(0, 3) == v.sizes().slice(0, 3) && k.size(0) == q.size(0) &&
                  k.size(3) == q.size(3),
              "cpattn.invariant_partial: q must be (batch, rows, heads, head_dim) and k, v (batch, "
              "keys, kv_heads, head_dim / v_head_dim), got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.device().is_cpu(),
              "cpattn.invariant_partial: invariant=True runs on CPU tensors only in this "
              "version (not run on a GPU yet), got q on ",
              q.device());
  TORCH_CHECK(k_begin >= 0 && k_begin % kInvariantTile == 0 && q_begin >= 0,
              "cpattn.invariant_partial: the keys must start at a tile boundary (a multiple of ",
              kInvariantTile, "), got k_begin ", k_begin, " and q_begin ", q_begin);
  check_options("invariant_partial", o, q.size(2), q.device());
  Mask m = global_mask(o);
  m.q_offset = q_begin;
  m.k_offset = k_begin;
  const auto [out, lse] = tile_tree_fwd(
      q, k, v, softmax_scale, m, fixed_order_score(o, m, std::nullopt), k_begin / kInvariantTile);
  return {out, lse};
}

// Merges partial results outs (N, B, R, H, Dv) and lses (N, B, H, R) float32, each over an aligned
// block of tiles starting at tiles[n] (increasing), by the tile tree; then the sinks join each row
// once and out is cast to out_dtype (default float32).
std::tuple<at::Tensor, at::Tensor> invariant_merge(const at::Tensor& outs, const at::Tensor& lses,
                                                   at::IntArrayRef tiles,
                                                   const std::optional<at::Tensor>& sinks,
                                                   std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(outs.dim() == 5 && lses.dim() == 4 && outs.scalar_type() == at::kFloat &&
                  lses.scalar_type() == at::kFloat && outs.size(0) == lses.size(0) &&
                  outs.size(0) == static_cast<int64_t>(tiles.size()) && outs.size(0) > 0 &&
                  lses.size(1) == outs.size(1) && lses.size(2) == outs.size(3) &&
                  lses.size(3) == outs.size(2),
              "cpattn.invariant_merge: outs (N, B, R, H, Dv) and lses (N, B, H, R) float32 with "
              "N >= 1 tiles, got ",
              outs.sizes(), ", ", lses.sizes(), " and ", tiles.size(), " tiles");
  for (size_t n = 1; n < tiles.size(); ++n)
    TORCH_CHECK(tiles[n] > tiles[n - 1], "cpattn.invariant_merge: tiles must increase, got ",
                tiles);
  const auto merge = [](Partial& a, const Partial& b) {
    merge_into(a.first, a.second, b.first, b.second);
  };
  TileTree<Partial, decltype(merge)> tree(merge);
  for (int64_t n = 0; n < outs.size(0); ++n)
    tree.push(tiles[n], {outs[n].clone(), lses[n].clone()});
  Partial result = tree.finish();
  if (sinks) apply_sinks_(result.first, result.second, *sinks);
  return {result.first.to(out_dtype.value_or(at::kFloat)), result.second};
}

}  // namespace

void impl_invariant_ops(torch::Library& m) {
  m.impl("invariant_fwd", &invariant_fwd);
  m.impl("invariant_bwd", &invariant_bwd);
  m.impl("invariant_partial", &invariant_partial);
  m.impl("invariant_merge", &invariant_merge);
}

}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("invariant_tile", [] { return cpattn::kInvariantTile; });
}
