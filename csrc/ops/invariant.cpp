// Invariant mode (cpattn.ring_attention(invariant=True)): results that do not depend on the number
// of ranks, the layout or the strategy, bit for bit. Each rank computes exactly what one process
// computes for its own query rows (out, lse, dQ) and its own keys (dK, dV): the operands it needs
// are gathered in global order (python/cpattn/strategies/invariant.py), and each product is one
// kernel call over the whole sequence on global positions. The kernels' sums then go in an order
// fixed by global positions alone: the forward folds key blocks from key 0 and treats every query
// row alike; the backward runs with AttnShape::fixed_order (one key split, query chunks of a fixed
// size from row 0). The contiguous and zigzag layouts hold runs of consecutive positions, which
// the kernels' offsets express; striped shards do not. docs/invariance.md.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpattn/layout.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/options.h"

namespace cpattn::ops {
namespace {

// This rank's runs of real positions: its shard's runs cut at `seqlen` (the rest is padding).
// With one rank, q may be shorter than the keys: bottom-right aligned, as cpattn.attention.
std::vector<Run> real_runs(Layout layout, int64_t world, int64_t rank, int64_t local_q,
                           int64_t local_k, int64_t seqlen) {
  std::vector<Run> runs;
  if (world == 1) {
    runs.push_back({0, local_q, seqlen - local_q, 1});
    return runs;
  }
  const ShardRuns s = shard_runs(layout, local_k * world, world, rank);
  for (int i = 0; i < s.count; ++i) {
    Run run = s.runs[i];
    run.length = std::clamp<int64_t>(seqlen - run.global_begin, 0, run.length);
    if (run.length > 0) runs.push_back(run);
  }
  return runs;
}

struct InvariantCall {
  Layout layout;
  int64_t world, rank, seqlen;
  AttentionOptions options;
};

// Checks before any kernel runs; every rank passes the same values (agreed on in Python). q this
// rank's shard (B, L, H, D); k (B, W L, Hkv, D) every rank's keys in global order (with one rank:
// the keys, which q's rows may be fewer than).
InvariantCall check_invariant_args(const char* fn, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, int64_t rank, int64_t world, int64_t layout,
                                   int64_t seqlen, const AttentionOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
                  k.sizes().slice(0, 3) == v.sizes().slice(0, 3) && k.size(0) == q.size(0) &&
                  k.size(3) == q.size(3),
              "cpattn.", fn,
              ": q must be (batch, seqlen_local, heads, head_dim) and k, v (batch, "
              "seqlen, kv_heads, head_dim / v_head_dim) in global order, got ",
              q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.device().is_cpu(), "cpattn.", fn,
              ": invariant=True runs on CPU tensors only "
              "(the CUDA kernels have no fixed-order mode yet), got q on ",
              q.device());
  check_rank(rank, world);
  const Layout l = checked_layout(layout);
  TORCH_CHECK(world == 1 || l != Layout::kStriped, "cpattn.", fn,
              ": invariant=True needs the contiguous or zigzag layout (a striped shard's "
              "positions are not runs of consecutive positions)");
  TORCH_CHECK(world == 1 ? k.size(1) >= q.size(1) : k.size(1) == q.size(1) * world, "cpattn.", fn,
              ": k and v must hold the ", world, " ranks' shards of ", q.size(1), " tokens, got ",
              k.size(1));
  TORCH_CHECK(world == 1 || l != Layout::kZigzag || q.size(1) % 2 == 0, "cpattn.", fn,
              ": the zigzag layout holds two equal chunks per rank, so the local sequence length "
              "must be even, got ",
              q.size(1));
  TORCH_CHECK(seqlen >= (world == 1 ? k.size(1) : 1) && seqlen <= k.size(1), "cpattn.", fn,
              ": seqlen must be in [1, ", k.size(1), "] (with one rank: every key), got ", seqlen);
  check_options(fn, o, q.size(2), q.device());
  return {l, world, rank, seqlen, o};
}

// The mask and score arguments of queries at positions [q_begin, ..) against keys at
// [k_begin, ..), with the sinks when given.
std::pair<Mask, ScoreArgs> run_options(const AttentionOptions& o, int64_t q_begin, int64_t k_begin,
                                       const std::optional<at::Tensor>& sinks) {
  Mask m = global_mask(o);
  m.q_offset = q_begin;
  m.k_offset = k_begin;
  ScoreArgs a = score_args(o);
  a.sinks = sinks;
  a.alibi_q_begin = q_begin;
  a.alibi_k_begin = k_begin;
  a.fixed_order = true;
  return {m, a};
}

std::tuple<at::Tensor, at::Tensor> invariant_fwd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, int64_t rank, int64_t world,
                                                 int64_t layout, int64_t seqlen,
                                                 const std::optional<at::Tensor>& sinks,
                                                 CPATTN_OPTION_PARAMS) {
  const InvariantCall c =
      check_invariant_args("invariant_fwd", q, k, v, rank, world, layout, seqlen, CPATTN_OPTIONS);
  check_per_head("invariant_fwd", "sinks", sinks, q.size(2), q.device());
  const at::Tensor keys = k.narrow(1, 0, seqlen), values = v.narrow(1, 0, seqlen);
  // Padding rows: out 0, lse -inf (with a sink: the sink), as the ring gives them.
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  at::Tensor lse =
      at::full({q.size(0), q.size(2), q.size(1)}, -INFINITY, q.options().dtype(at::kFloat));
  if (sinks) lse.copy_(sinks->to(at::kFloat).view({1, -1, 1}).expand_as(lse));
  for (const Run& run : real_runs(c.layout, world, rank, q.size(1), k.size(1) / world, seqlen)) {
    const auto [mask, score] = run_options(c.options, run.global_begin, 0, sinks);
    const auto [o, l] = attention_fwd_scored(q.narrow(1, run.local_begin, run.length), keys, values,
                                             softmax_scale, mask, score, std::nullopt);
    out.narrow(1, run.local_begin, run.length).copy_(o);
    lse.narrow(2, run.local_begin, run.length).copy_(l);
  }
  return {out, lse};
}

// k, v as invariant_fwd's; q_all, dout_all (B, W L, H, D / Dv), lse_all and shifted_all
// (B, H, W L): every rank's, in global order, shifted = dlse - rowsum(dout * out) (op row_dot;
// the backward's delta - dlse is -shifted, the same bits a call given out and dlse computes:
// IEEE subtraction is antisymmetric); with one rank, none of them (q, dout, out, lse and dlse
// are everything). Returns dq (q's rows) and dk, dv (this rank's keys, (B, L, Hkv, D / Dv))
// in the inputs' dtypes, padding rows and keys 0; and with sinks their gradient (H,) fp32 over
// the whole sequence on rank 0, 0 elsewhere: summed over the ranks (the usual gradient
// all-reduce) it is exactly the one-process gradient, whatever the number of ranks (no sinks:
// an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> invariant_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& q_all, const std::optional<at::Tensor>& dout_all,
    const std::optional<at::Tensor>& lse_all, const std::optional<at::Tensor>& shifted_all,
    const std::optional<at::Tensor>& sinks, int64_t rank, int64_t world, int64_t layout,
    int64_t seqlen, CPATTN_OPTION_PARAMS) {
  const InvariantCall c =
      check_invariant_args("invariant_bwd", q, k, v, rank, world, layout, seqlen, CPATTN_OPTIONS);
  check_per_head("invariant_bwd", "sinks", sinks, q.size(2), q.device());
  const auto grads = [&](const at::Tensor& dout_rows, const at::Tensor& q_rows,
                         const at::Tensor& k_rows, const at::Tensor& v_rows,
                         const at::Tensor& out_rows, const at::Tensor& lse_rows,
                         const std::optional<at::Tensor>& dlse_rows, int64_t q_begin,
                         int64_t k_begin, bool want_dq, bool want_dkv) {
    const auto [mask, score] = run_options(c.options, q_begin, k_begin, std::nullopt);
    return attention_bwd_some_scored(dout_rows, q_rows, k_rows, v_rows, out_rows, lse_rows,
                                     softmax_scale, mask, score, dlse_rows, want_dq, want_dkv);
  };
  // With sinks: their gradient over the whole sequence on rank 0 (sink_bwd's fixed order), from
  // every row's lse and delta - dlse (given as -shifted: dout and out of one zero column).
  const auto sink_grads = [&](const at::Tensor& dout_g, const at::Tensor& out_g,
                              const at::Tensor& lse_g, const std::optional<at::Tensor>& dlse_g) {
    const auto f32 = q.options().dtype(at::kFloat);
    if (!sinks) return at::empty({0}, f32);
    if (rank != 0) return at::zeros({q.size(2)}, f32);
    return backend_for(q.device())
        .sink_bwd(dout_g.contiguous(), out_g.contiguous(), lse_g.contiguous(),
                  sinks->to(at::kFloat).contiguous(),
                  dlse_g ? std::optional(dlse_g->contiguous()) : std::nullopt);
  };
  if (world == 1) {  // every row against every key: dQ, dK and dV of one call
    const Run run = real_runs(c.layout, 1, 0, q.size(1), k.size(1), seqlen)[0];
    const auto [dq, dk, dv] = grads(dout, q, k, v, out, lse, dlse, run.global_begin, 0, true, true);
    return {dq, dk, dv, sink_grads(dout, out, lse, dlse)};
  }
  TORCH_CHECK(q_all && dout_all && lse_all && shifted_all, "cpattn.invariant_bwd: over ", world,
              " ranks, q_all, dout_all, lse_all and shifted_all are needed");
  const auto first = [&](const at::Tensor& t, int64_t dim) { return t.narrow(dim, 0, seqlen); };
  const at::Tensor keys = first(k, 1), values = first(v, 1);
  const at::Tensor q_g = first(*q_all, 1), dout_g = first(*dout_all, 1), lse_g = first(*lse_all, 2),
                   shifted_g = first(*shifted_all, 2);
  const int64_t local = q.size(1);
  at::Tensor dq = at::zeros_like(q);
  at::Tensor dk = at::zeros({q.size(0), local, k.size(2), k.size(3)}, q.options());
  at::Tensor dv = at::zeros({q.size(0), local, v.size(2), v.size(3)}, q.options());
  for (const Run& run : real_runs(c.layout, world, rank, local, local, seqlen)) {
    const auto mine = [&](const at::Tensor& t, int64_t dim) {
      return t.narrow(dim, run.local_begin, run.length);
    };
    const auto at_run = [&](const at::Tensor& t) {
      return t.narrow(1, run.global_begin, run.length);
    };
    // dQ of this run's rows against every key (its dK and dV are other ranks' business).
    const auto dq_run = std::get<0>(
        grads(mine(dout, 1), mine(q, 1), keys, values, mine(out, 1), mine(lse, 2).contiguous(),
              dlse ? std::optional(mine(*dlse, 2).contiguous()) : std::nullopt, run.global_begin, 0,
              true, false));
    mine(dq, 1).copy_(dq_run);
    // dK and dV of this run's keys against every query (its dQ is the other ranks').
    const auto [unused, dk_run, dv_run] =
        grads(dout_g, q_g, at_run(keys), at_run(values), at::Tensor(), lse_g, shifted_g, 0,
              run.global_begin, false, true);
    mine(dk, 1).copy_(dk_run);
    mine(dv, 1).copy_(dv_run);
  }
  const at::Tensor zero_column = at::zeros({q.size(0), seqlen, q.size(2), 1}, q.options());
  return {dq, dk, dv, sink_grads(zero_column, zero_column, lse_g, shifted_g)};
}

}  // namespace

void impl_invariant_ops(torch::Library& m) {
  m.impl("invariant_fwd", &invariant_fwd);
  m.impl("invariant_bwd", &invariant_bwd);
}

}  // namespace cpattn::ops
