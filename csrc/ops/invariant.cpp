// Invariant mode (invariant=True): results that do not depend on the number of ranks, the layout
// or the strategy, bit for bit. Each rank computes exactly what one process computes for its own
// query rows (out, lse, dQ) and its own keys (dK, dV): the operands it needs are gathered in
// global order (python/cpattn/invariant/) and every sum runs in an order fixed by
// global positions alone. The forward cuts each row's keys (those of its document, with packed
// documents) into tiles from key 0 and merges the tiles' partial results by the tile tree
// (cpattn/invariant.h); the kernels treat every query row alike. The backward runs with
// AttnShape::fixed_order (one key split, query row bands of a fixed size from row 0) and needs only
// the final out and lse; over W ranks its operands stream in global order, a part at a time, into
// fp32 running sums that the kernels continue. Contiguous and zigzag shards are runs of consecutive
// positions, which the kernels' offsets express; striped shards are moved to the contiguous layout
// before (Relayout). The same tiles serve a KV cache sharded in blocks of whole tiles
// (invariant_partial, invariant_merge: python/cpattn/inference/attention.py). docs/invariance.md.
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
  int64_t global_begin = 0;
  for (size_t d = 0; d < lengths.size(); ++d) {
    DocumentShard doc = document_shard(o.layout, lengths[d], world, rank, global_begin);
    if (o.doc_lengths.empty()) {  // one sequence: the shards' length, whatever it pads to
      doc.padded = local_k * world;
      doc.runs = shard_runs(o.layout, doc.padded, world, rank);
    }
    if (world == 1) doc.runs = ShardRuns{1, {{doc.local_begin, doc.padded, 0, 1}, {0, 0, 0, 1}}};
    Mask m = global;
    if (!o.doc_prefix_lens.empty())
      m.prefix_end = o.doc_prefix_lens[d] > 0 ? o.doc_prefix_lens[d] : -kUnbounded;
    for (int i = 0; i < doc.runs.count; ++i) {
      Run run = doc.runs.runs[i];
      run.length = run_length_below(run, lengths[d]);
      m.q_offset = run.global_begin;
      if (run.length > 0) pieces.push_back({run, global_begin, lengths[d], m});
    }
    global_begin += doc.padded;
  }
  return pieces;
}

// Checks before any kernel runs; every rank passes the same values (agreed on in Python). q
// (B, R, H, D) and k, v (B, N, Hkv, D / Dv) some of the call's rows and keys (their shapes beyond
// the tokens are checked); this rank holds `local` tokens of the sequence's `keys` (with one rank:
// q's rows may be fewer than the keys); doc_lengths and doc_prefix_lens as ring_fwd's (the
// documents' lengths; their prefixes, or none), or no documents: one sequence of `seqlen` real
// tokens.
InvariantCall check_invariant_args(const char* fn, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, int64_t local, int64_t keys, int64_t rank,
                                   int64_t world, int64_t layout, int64_t seqlen,
                                   const std::optional<at::Tensor>& doc_lengths,
                                   const std::optional<at::Tensor>& doc_prefix_lens,
                                   const AttentionOptions& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                  k.sizes().slice(0, 3) == v.sizes().slice(0, 3) && k.size(0) == q.size(0) &&
                  k.size(3) == q.size(3),
              "cpattn.", fn,
              ": q must be (batch, rows, heads, head_dim) and k, v (batch, keys, kv_heads, "
              "head_dim / v_head_dim), got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.device().is_cpu(), "cpattn.", fn,
              ": invariant=True runs on CPU tensors only in this version (not run on a GPU "
              "yet), got q on ",
              q.device());
  check_rank(rank, world);
  check_options(fn, options, q.size(2), q.device());
  const RingOptions o =
      make_ring_options(options, layout, doc_lengths, doc_prefix_lens, std::nullopt);
  TORCH_CHECK(world == 1 || o.layout != Layout::kStriped, "cpattn.", fn,
              ": takes contiguous or zigzag shards (runs of consecutive positions; the Python "
              "side moves striped shards to the contiguous layout first)");
  const bool documents = !o.doc_lengths.empty();
  TORCH_CHECK(world == 1 && !documents ? keys >= local : keys == local * world, "cpattn.", fn,
              ": k and v must hold the ", world, " ranks' shards of ", local, " tokens, got ",
              keys);
  if (documents) {
    const int64_t total = padded_documents_length(
        o.layout, o.doc_lengths.data(), static_cast<int64_t>(o.doc_lengths.size()), world);
    TORCH_CHECK(total == keys, "cpattn.", fn, ": with these documents (each padded to a ",
                "multiple of ", layout_granularity(o.layout, world), ") the sequence holds ", total,
                " tokens, k and v ", keys);
  } else {
    TORCH_CHECK(world == 1 || o.layout != Layout::kZigzag || local % 2 == 0, "cpattn.", fn,
                ": the zigzag layout holds two equal segments per rank, so the local sequence "
                "length must be even, got ",
                local);
    TORCH_CHECK(seqlen >= (world == 1 ? keys : 1) && seqlen <= keys, "cpattn.", fn,
                ": seqlen must be in [1, ", keys, "] (with one rank: every key), got ", seqlen);
  }
  return {world, rank, o, rank_pieces(o, world, rank, local, keys / world, seqlen)};
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

// What the kernel calls of an invariant op would check on each tile or piece (the checked
// entries attention_fwd_scored / attention_bwd_add_scored), once at the op's entry: every call
// is a run of rows of q against a run of keys of k, v, at positions within the call's and with
// its options, so the kernels are called through the unchecked entries (ops.h), as the ring's
// sub-problems are. rows_at: the global position of q's first row; keys_at: k's. Nothing to check
// without rows or keys (no kernel call).
std::optional<AttnShape> check_tile_args(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, double softmax_scale,
                                         const AttentionOptions& options, int64_t rows_at,
                                         int64_t keys_at) {
  if (q.size(1) == 0 || k.size(1) == 0) return std::nullopt;
  Mask whole = global_mask(options);
  whole.q_offset = rows_at;
  whole.k_offset = keys_at;
  return check_attention_args(q, k, v, softmax_scale, whole,
                              fixed_order_score(options, whole, std::nullopt));
}

// With the backward's: dout, out (undefined: its rowsum term folded into dlse), lse, dlse.
void check_tile_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                     const std::optional<at::Tensor>& dlse, double softmax_scale,
                     const AttentionOptions& options, int64_t rows_at, int64_t keys_at) {
  const std::optional<AttnShape> s =
      check_tile_args(q, k, v, softmax_scale, options, rows_at, keys_at);
  if (s) check_bwd_args(dout, q, out, lse, dlse, at::kFloat, *s);
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
      auto [o, l] = attention_fwd_unchecked(q_rows, k.narrow(1, t0, cols), v.narrow(1, t0, cols),
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
                                                 const std::optional<at::Tensor>& doc_prefix_lens,
                                                 const std::optional<at::Tensor>& sinks,
                                                 CPATTN_OPTION_PARAMS) {
  const InvariantCall c =
      check_invariant_args("invariant_fwd", q, k, v, q.size(1), k.size(1), rank, world, layout,
                           seqlen, doc_lengths, doc_prefix_lens, CPATTN_OPTIONS);
  check_per_head("invariant_fwd", "sinks", sinks, q.size(2), q.device());
  const int64_t keys = k.size(1);  // positions: the rows and keys end the sequence
  check_tile_args(q, k, v, softmax_scale, c.options, keys - q.size(1), 0);
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

// The sinks' gradient (H,) fp32 over every real row of the sequence (of each document) from each
// row's lse and shifted = dlse - rowsum(dout * out) (sink_bwd's fixed order, given dout and out
// of one zero column: their delta - dlse is -shifted, the bits of a call given dout, out and dlse,
// IEEE subtraction being antisymmetric), on rank 0; 0 elsewhere: summed over the ranks (the usual
// gradient all-reduce) it is exactly the one-process gradient. lse_all and shifted_all
// (B, H, W L) every rank's rows in global order.
at::Tensor invariant_sink_bwd(const at::Tensor& lse_all, const at::Tensor& shifted_all,
                              const at::Tensor& sinks, int64_t rank, int64_t world, int64_t layout,
                              int64_t seqlen, const std::optional<at::Tensor>& doc_lengths) {
  TORCH_CHECK(lse_all.dim() == 3 && shifted_all.sizes() == lse_all.sizes() &&
                  lse_all.scalar_type() == at::kFloat && shifted_all.scalar_type() == at::kFloat &&
                  lse_all.size(2) % world == 0,
              "cpattn.invariant_sink_bwd: lse_all and shifted_all must be float32 (batch, heads, "
              "W x seqlen_local), got ",
              lse_all.sizes(), " and ", shifted_all.sizes());
  const int64_t batch = lse_all.size(0), heads = lse_all.size(1);
  check_per_head("invariant_sink_bwd", "sinks", sinks, heads, lse_all.device());
  const auto f32 = lse_all.options();
  if (rank != 0) return at::zeros({heads}, f32);
  const int64_t local = lse_all.size(2) / world;
  const RingOptions o =
      make_ring_options(AttentionOptions{}, layout, doc_lengths, std::nullopt, std::nullopt);
  std::vector<at::Tensor> zero_cols, lses, shifted;
  int64_t last_doc = -1;
  for (const Piece& p : rank_pieces(o, world, 0, local, local, seqlen)) {  // rank 0: every doc
    if (p.doc_begin == last_doc) continue;
    last_doc = p.doc_begin;
    lses.push_back(lse_all.narrow(2, p.doc_begin, p.doc_length));
    shifted.push_back(shifted_all.narrow(2, p.doc_begin, p.doc_length));
    zero_cols.push_back(at::zeros({batch, p.doc_length, heads, 1}, f32));
  }
  const at::Tensor zeros = at::cat(zero_cols, 1);
  return backend_for(lse_all.device())
      .sink_bwd(zeros, zeros, at::cat(lses, 2), sinks.to(at::kFloat).contiguous(),
                at::cat(shifted, 2));
}

// One process: dq, dk, dv of every row and key (k, v every key; q's rows may be fewer, bottom-right
// aligned without documents) in the inputs' dtypes, padding rows and keys 0; and with sinks their
// gradient (H,) fp32 (else an empty tensor). Each document's rows against its keys in one call
// into fp32 running sums (AttnShape::fixed_order): the one backward algorithm, whose sums over W
// ranks are streamed a part at a time (invariant_bwd_part) or computed once per block
// (invariant_bwd_rows).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> invariant_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& sinks, int64_t layout, int64_t seqlen,
    const std::optional<at::Tensor>& doc_lengths, const std::optional<at::Tensor>& doc_prefix_lens,
    CPATTN_OPTION_PARAMS) {
  const InvariantCall c =
      check_invariant_args("invariant_bwd", q, k, v, q.size(1), k.size(1), 0, 1, layout, seqlen,
                           doc_lengths, doc_prefix_lens, CPATTN_OPTIONS);
  check_per_head("invariant_bwd", "sinks", sinks, q.size(2), q.device());
  check_tile_args(dout, q, k, v, out, lse, dlse, softmax_scale, c.options, k.size(1) - q.size(1),
                  0);
  // The streamed backward's algorithm (invariant_bwd_part) over one part, every row and key:
  // fp32 running sums from zeros (padding rows and keys stay 0), scaled and rounded once at the
  // end as python/cpattn/invariant/autograd.py finishes them.
  const auto f32 = q.options().dtype(at::kFloat);
  const at::Tensor dq_sum = at::zeros(q.sizes(), f32), dk_sum = at::zeros(k.sizes(), f32),
                   dv_sum = at::zeros(v.sizes(), f32);
  std::vector<at::Tensor> dout_rows, out_rows, lse_rows, dlse_rows;
  for (const Piece& p : c.pieces) {
    const auto mine = [&](const at::Tensor& t, int64_t dim) {
      return t.narrow(dim, p.rows.local_begin, p.rows.length);
    };
    const auto doc = [&](const at::Tensor& t) { return t.narrow(1, p.doc_begin, p.doc_length); };
    const std::optional<at::Tensor> dlse_p =
        dlse ? std::optional(mine(*dlse, 2).contiguous()) : std::nullopt;
    attention_bwd_add_unchecked(
        mine(dq_sum, 1), doc(dk_sum), doc(dv_sum), mine(dout, 1), mine(q, 1), doc(k), doc(v),
        mine(out, 1), mine(lse, 2).contiguous(), softmax_scale, p.mask,
        fixed_order_score(c.options, p.mask, std::nullopt), dlse_p, std::nullopt);
    dout_rows.push_back(mine(dout, 1));
    out_rows.push_back(mine(out, 1));
    lse_rows.push_back(mine(lse, 2));
    if (dlse_p) dlse_rows.push_back(*dlse_p);
  }
  const at::Tensor dq = dq_sum.mul_(softmax_scale).to(q.scalar_type()),
                   dk = dk_sum.mul_(softmax_scale).to(k.scalar_type()),
                   dv = dv_sum.to(v.scalar_type());
  if (!sinks) return {dq, dk, dv, at::empty({0}, f32)};
  return {dq, dk, dv,
          backend_for(q.device())
              .sink_bwd(at::cat(dout_rows, 1), at::cat(out_rows, 1), at::cat(lse_rows, 2),
                        sinks->to(at::kFloat).contiguous(),
                        dlse_rows.empty() ? std::nullopt : std::optional(at::cat(dlse_rows, 2)))};
}

// Where a streamed part, tokens [begin, begin + n) of global order, meets piece p's document:
// its tokens from `part_offset` in the part, from `doc_offset` in the document, `length` of them
// (0: none). The kernels' sums continue across parts when doc_offset is a multiple of
// kInvariantRowBand (checked).
struct PartInDoc {
  int64_t part_offset, doc_offset, length;
};

PartInDoc part_in_doc(const char* fn, const Piece& p, int64_t begin, int64_t n) {
  const int64_t first = std::max(begin, p.doc_begin);
  const int64_t last = std::min(begin + n, p.doc_begin + p.doc_length);
  if (last <= first) return {0, 0, 0};
  TORCH_CHECK((first - p.doc_begin) % kInvariantRowBand == 0, "cpattn.", fn,
              ": a part must start a document or a multiple of ", kInvariantRowBand,
              " tokens into it, got one from token ", first - p.doc_begin);
  return {first - begin, first - p.doc_begin, last - first};
}

// A running fp32 sum the streamed backward adds into: `like`'s shape, float32, contiguous in D.
void check_running_sum(const char* fn, const char* what, const at::Tensor& sum,
                       const at::Tensor& like) {
  TORCH_CHECK(sum.scalar_type() == at::kFloat && sum.sizes() == like.sizes() &&
                  sum.device() == like.device() && sum.stride(3) == 1,
              "cpattn.", fn, ": ", what, " must be float32 of shape ", like.sizes(),
              " contiguous in head_dim, got ", sum.scalar_type(), " ", sum.sizes());
}

// The backward over W ranks, one part of every rank's tokens: adds to dq_sum (B, L, H, D),
// dk_sum and dv_sum (B, L, Hkv, D / Dv), fp32 and unscaled, the terms of this rank's rows against
// the part's keys (dQ) and of the part's rows against this rank's keys (dK, dV). This rank's
// shards: dout, q, k, v, lse and shifted (B, H, L) = dlse - rowsum(dout * out) (op row_dot; the
// backward's delta - dlse is -shifted). The part: tokens [part_begin, part_begin + N) of global
// order (every rank's shards; with documents, each padded as ring_attention_varlen shards them),
// dout_part, q_part, k_part, v_part (B, N, heads, ...), lse_part and shifted_part (B, H, N).
// Called with the parts in global order, each starting a document or a multiple of
// kInvariantRowBand into it, from zeros: dq_sum * softmax_scale, dk_sum * softmax_scale and dv_sum
// are then exactly what one process computes for these rows and keys (dQ sums its terms over the
// keys in order, dK and dV over the query row bands in order; splitting the rows (dQ) or the keys
// (dK, dV) anywhere changes no sum). Where the part's tokens are this rank's own, its rows against
// its keys give dQ, dK and dV in one kernel call, computing P and dP once instead of twice.
void invariant_bwd_part(const at::Tensor& dq_sum, const at::Tensor& dk_sum,
                        const at::Tensor& dv_sum, const at::Tensor& dout, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                        const at::Tensor& shifted, const at::Tensor& dout_part,
                        const at::Tensor& q_part, const at::Tensor& k_part,
                        const at::Tensor& v_part, const at::Tensor& lse_part,
                        const at::Tensor& shifted_part, int64_t part_begin, int64_t rank,
                        int64_t world, int64_t layout, int64_t seqlen,
                        const std::optional<at::Tensor>& doc_lengths,
                        const std::optional<at::Tensor>& doc_prefix_lens, CPATTN_OPTION_PARAMS) {
  constexpr const char* fn = "invariant_bwd_part";
  const int64_t local = q.size(1), keys = local * world, n = q_part.size(1);
  const InvariantCall c =
      check_invariant_args(fn, q, k, v, local, keys, rank, world, layout, seqlen, doc_lengths,
                           doc_prefix_lens, CPATTN_OPTIONS);
  check_invariant_args(fn, q_part, k_part, v_part, local, keys, rank, world, layout, seqlen,
                       doc_lengths, doc_prefix_lens, CPATTN_OPTIONS);
  TORCH_CHECK(
      k.size(1) == local && k_part.size(1) == n && part_begin >= 0 && part_begin + n <= keys,
      "cpattn.", fn, ": k, v must be this rank's shard of ", local, " tokens and the part [",
      part_begin, ", ", part_begin + n, ") of q_part, k_part, v_part tokens of the sequence's ",
      keys, ", got ", k.size(1), " and ", k_part.size(1));
  check_running_sum(fn, "dq_sum", dq_sum, q);
  check_running_sum(fn, "dk_sum", dk_sum, k);
  check_running_sum(fn, "dv_sum", dv_sum, v);
  const at::Tensor none;
  // this rank's rows against the part's keys (dQ), the part's rows against this rank's keys
  check_tile_args(dout, q, k_part, v_part, none, lse, shifted, softmax_scale, c.options,
                  keys - local, keys - n);
  check_tile_args(dout_part, q_part, k, v, none, lse_part, shifted_part, softmax_scale, c.options,
                  keys - n, keys - local);
  for (const Piece& p : c.pieces) {
    const PartInDoc part = part_in_doc(fn, p, part_begin, n);
    if (part.length == 0) continue;
    // Positions inside the document: the piece's tokens [a, b), the part's [s0, s1).
    const int64_t a = p.rows.global_begin, b = a + p.rows.length;
    const int64_t s0 = part.doc_offset, s1 = s0 + part.length;
    const auto mine = [&](const at::Tensor& t, int64_t dim, int64_t x, int64_t y) {
      return t.narrow(dim, p.rows.local_begin + x - a, y - x);
    };
    const auto parts = [&](const at::Tensor& t, int64_t dim) {
      return t.narrow(dim, part.part_offset, part.length);
    };
    // Adds the terms of rows at positions q0.. against keys at k0.. (gradients undefined: not
    // wanted); nothing where no row sees a key.
    const auto add = [&](const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                         const at::Tensor& dout_r, const at::Tensor& q_r, const at::Tensor& lse_r,
                         const at::Tensor& shifted_r, int64_t q0, const at::Tensor& k_c,
                         const at::Tensor& v_c, int64_t k0) {
      Mask m = p.mask;
      m.q_offset = q0;
      m.k_offset = k0;
      if (q_r.size(1) == 0 || k_c.size(1) == 0 ||
          m.classify(0, q_r.size(1), 0, k_c.size(1)) == BlockKind::kEmpty)
        return;
      attention_bwd_add_unchecked(
          dq, dk, dv, dout_r, q_r, k_c, v_c, at::Tensor(), lse_r.contiguous(), softmax_scale, m,
          fixed_order_score(c.options, m, std::nullopt), shifted_r.contiguous(), std::nullopt);
    };
    // This piece's rows [x, y) against the part's keys: dQ.
    const auto dq_terms = [&](int64_t x, int64_t y) {
      add(mine(dq_sum, 1, x, y), none, none, mine(dout, 1, x, y), mine(q, 1, x, y),
          mine(lse, 2, x, y), mine(shifted, 2, x, y), x, parts(k_part, 1), parts(v_part, 1), s0);
    };
    // The part's rows against this piece's keys [x, y): dK, dV.
    const auto dkv_terms = [&](int64_t x, int64_t y) {
      add(none, mine(dk_sum, 1, x, y), mine(dv_sum, 1, x, y), parts(dout_part, 1), parts(q_part, 1),
          parts(lse_part, 2), parts(shifted_part, 2), s0, mine(k, 1, x, y), mine(v, 1, x, y), x);
    };
    if (s0 < a || b < s1) {  // the part is not (only) this piece's
      dq_terms(a, b);
      dkv_terms(a, b);
      continue;
    }
    // The part's tokens are this piece's: their rows against their keys once for all three
    // gradients, then the piece's other rows against them and them against its other keys.
    add(mine(dq_sum, 1, s0, s1), mine(dk_sum, 1, s0, s1), mine(dv_sum, 1, s0, s1),
        mine(dout, 1, s0, s1), mine(q, 1, s0, s1), mine(lse, 2, s0, s1), mine(shifted, 2, s0, s1),
        s0, mine(k, 1, s0, s1), mine(v, 1, s0, s1), s0);
    for (const auto& [x, y] : {std::pair(a, s0), std::pair(s1, b)}) {
      dq_terms(x, y);
      dkv_terms(x, y);
    }
  }
}

// The backward over W ranks with each block computed once (no documents; every rank's runs start
// and end at multiples of kInvariantRowBand): a rank adds its rows' dQ terms against a part of the
// keys to its running sums as invariant_bwd_part does, and returns the dK / dV terms of each of
// its bands of kInvariantRowBand rows against the part separately (a plane per band), for the
// keys' owner to add in global order of the bands (python/cpattn/invariant/). A
// band's plane is exactly the part that one process's call adds to the sums for these rows
// (backward_row_bands: the bands' dK / dV parts are added one after another), so the owner's
// additions give the same sums.

// Band `band` (its rows from local row band * kInvariantRowBand) of a rank's pieces against the
// part [part_begin, part_begin + n) of global order: its piece, the rows' and part's positions in
// the document, and the mask of the block; nullopt where no row of the band sees a key of the
// part (or the band is padding).
struct BandBlock {
  const Piece* piece;
  int64_t row_offset;  // of the band's first row in the piece
  int64_t rows;
  PartInDoc part;
  Mask mask;
};

std::optional<BandBlock> band_block(const char* fn, const std::vector<Piece>& pieces, int64_t band,
                                    int64_t part_begin, int64_t n) {
  const int64_t first = band * kInvariantRowBand;
  for (const Piece& p : pieces) {
    const int64_t offset = first - p.rows.local_begin;
    if (offset < 0 || offset >= p.rows.length) continue;
    TORCH_CHECK((p.rows.global_begin + offset) % kInvariantRowBand == 0, "cpattn.", fn,
                ": the rank's runs must start at multiples of ", kInvariantRowBand,
                " tokens of their document, got a band from token ", p.rows.global_begin + offset);
    const PartInDoc part = part_in_doc(fn, p, part_begin, n);
    Mask m = p.mask;
    m.q_offset = p.rows.global_begin + offset;
    m.k_offset = part.doc_offset;
    const int64_t rows = std::min(kInvariantRowBand, p.rows.length - offset);
    if (part.length == 0 || m.classify(0, rows, 0, part.length) == BlockKind::kEmpty)
      return std::nullopt;
    return BandBlock{&p, offset, rows, part, m};
  }
  return std::nullopt;  // padding rows
}

// Which bands of kInvariantRowBand rows of each rank's `local` tokens see some key of the part
// [part_begin, part_begin + n) of global order: (W, ceil(local / kInvariantRowBand)) bool, the
// bands whose planes invariant_bwd_rows computes (every rank agrees on them: a rule of
// positions only).
at::Tensor invariant_bands_seen(int64_t local, int64_t part_begin, int64_t n, int64_t world,
                                int64_t layout, int64_t seqlen,
                                const std::optional<at::Tensor>& doc_lengths,
                                const std::optional<at::Tensor>& doc_prefix_lens,
                                CPATTN_OPTION_PARAMS) {
  const RingOptions o =
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, std::nullopt);
  const int64_t bands = (local + kInvariantRowBand - 1) / kInvariantRowBand;
  at::Tensor seen = at::zeros({world, bands}, at::kBool);
  for (int64_t r = 0; r < world; ++r) {
    const std::vector<Piece> pieces = rank_pieces(o, world, r, local, local, seqlen);
    for (int64_t j = 0; j < bands; ++j)
      seen[r][j] = band_block("invariant_bands_seen", pieces, j, part_begin, n).has_value();
  }
  return seen;
}

// Adds to dq_sum (B, L, H, D), fp32 and unscaled, the terms of this rank's rows against the part's
// keys k_part, v_part (B, N, Hkv, D / Dv: tokens [part_begin, part_begin + N) of global order,
// parts in global order, each starting at a multiple of kInvariantRowBand), and writes into plane i
// of planes (C, B, N, Hkv, D + Dv) fp32, zeros, the dK (first D) and dV terms, unscaled, of its
// band bands[i] against them: the rows from local row bands[i] * kInvariantRowBand, a band that
// sees the part (invariant_bands_seen). This rank's shards: dout, q, lse and shifted as in
// invariant_bwd_part.
void invariant_bwd_rows(const at::Tensor& dq_sum, const at::Tensor& planes, const at::Tensor& dout,
                        const at::Tensor& q, const at::Tensor& k_part, const at::Tensor& v_part,
                        const at::Tensor& lse, const at::Tensor& shifted, at::IntArrayRef bands,
                        int64_t part_begin, int64_t rank, int64_t world, int64_t layout,
                        int64_t seqlen, const std::optional<at::Tensor>& doc_lengths,
                        const std::optional<at::Tensor>& doc_prefix_lens, CPATTN_OPTION_PARAMS) {
  constexpr const char* fn = "invariant_bwd_rows";
  const int64_t local = q.size(1), keys = local * world, n = k_part.size(1);
  const InvariantCall c =
      check_invariant_args(fn, q, k_part, v_part, local, keys, rank, world, layout, seqlen,
                           doc_lengths, doc_prefix_lens, CPATTN_OPTIONS);
  const int64_t d = k_part.size(3), dv = v_part.size(3);
  TORCH_CHECK(part_begin >= 0 && part_begin + n <= keys && part_begin % kInvariantRowBand == 0,
              "cpattn.", fn, ": the part [", part_begin, ", ", part_begin + n,
              ") must lie in the sequence's ", keys, " tokens and start at a multiple of ",
              kInvariantRowBand);
  TORCH_CHECK(planes.scalar_type() == at::kFloat && planes.dim() == 5 &&
                  planes.size(0) == static_cast<int64_t>(bands.size()) &&
                  planes.size(1) == q.size(0) && planes.size(2) == n &&
                  planes.size(3) == k_part.size(2) && planes.size(4) == d + dv &&
                  planes.is_contiguous(),
              "cpattn.", fn, ": planes must be float32 (bands, batch, part tokens, kv_heads, ",
              "head_dim + v_head_dim), contiguous, one per band: got ", planes.sizes(), " for ",
              bands.size(), " bands");
  check_running_sum(fn, "dq_sum", dq_sum, q);
  check_tile_args(dout, q, k_part, v_part, at::Tensor(), lse, shifted, softmax_scale, c.options,
                  keys - local, keys - n);
  for (size_t i = 0; i < bands.size(); ++i) {
    const std::optional<BandBlock> b = band_block(fn, c.pieces, bands[i], part_begin, n);
    TORCH_CHECK(b.has_value(), "cpattn.", fn, ": band ", bands[i],
                " sees no key of the part (invariant_bands_seen)");
    const int64_t row0 = b->piece->rows.local_begin + b->row_offset;
    const auto mine = [&](const at::Tensor& t, int64_t dim) {
      return t.narrow(dim, row0, b->rows);
    };
    const auto keys_of = [&](const at::Tensor& t) {
      return t.narrow(1, b->part.part_offset, b->part.length);
    };
    const at::Tensor plane = keys_of(planes[i]);
    attention_bwd_add_unchecked(mine(dq_sum, 1), plane.narrow(3, 0, d), plane.narrow(3, d, dv),
                                mine(dout, 1), mine(q, 1), keys_of(k_part), keys_of(v_part),
                                at::Tensor(), mine(lse, 2).contiguous(), softmax_scale, b->mask,
                                fixed_order_score(c.options, b->mask, std::nullopt),
                                mine(shifted, 2).contiguous(), std::nullopt);
  }
}

// Invariant mode over a KV cache sharded in blocks of whole tiles
// (python/cpattn/inference/attention.py): the partial result of query rows q (B, R, H, D) at
// positions q_begin.. over the keys k, v (B, N, Hkv, D / Dv) at positions k_begin.. (a tile
// boundary), their tiles merged by the tile tree: out (B, R, H, Dv) and lse (B, H, R) float32, no
// sinks.
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
  check_tile_args(q, k, v, softmax_scale, o, q_begin, k_begin);
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
  m.impl("invariant_bwd_part", &invariant_bwd_part);
  m.impl("invariant_bwd_rows", &invariant_bwd_rows);
  m.impl("invariant_sink_bwd", &invariant_sink_bwd);
  m.impl("invariant_partial", &invariant_partial);
  m.impl("invariant_merge", &invariant_merge);
}

}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("invariant_tile", [] { return cpattn::kInvariantTile; });
  m.impl("invariant_row_band", [] { return cpattn::kInvariantRowBand; });
  m.impl("invariant_bands_seen", &cpattn::ops::invariant_bands_seen);
}
