// The ring driver, written once against comm::Transport. Per step it posts the shift of the next
// K/V shard, computes the sub-problems that the schedule (cpattn/schedule.h) gives for the shard
// it holds, merges them into the running fp32 (out, lse), then waits for the shift.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <initializer_list>

#include "comm/transport.h"
#include "cpattn/schedule.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/ring.h"

namespace cpattn::ops {
namespace {

at::Tensor rows(const at::Tensor& t, const Run& run) {  // (B, S, ...) -> the run's tokens
  return t.narrow(1, run.local_begin, run.length);
}
at::Tensor lse_rows(const at::Tensor& lse, const Run& run) {  // (B, H, S)
  return lse.narrow(2, run.local_begin, run.length);
}

// Keys at global positions < prefix_len (per document) seen by every query.
Mask global_mask(const RingOptions& o) {
  Mask global;
  global.causal = o.causal;
  global.window_left = o.window_left;
  global.window_right = o.window_right;
  if (o.prefix_len > 0) global.prefix_end = o.prefix_len;
  return global;
}

// Checks before any message: every rank raises here alike, no shift is left pending.
void check_ring_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const RingOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "cpattn: ring q and k must be (batch, seqlen_local, "
              "heads, head_dim), got ", q.sizes(), " and ", k.sizes());
  // K and V travel as one stacked message.
  TORCH_CHECK(k.sizes() == v.sizes(), "cpattn.ring_attention: v must have k's shape ", k.sizes(),
              ", got ", v.sizes(), " (a head_dim of v different from q/k's is supported by "
              "cpattn.attention only, not yet by the context-parallel strategies)");
  check_score_args("ring_attention", o.softcap, o.alibi_slopes, o.sinks, q.size(2), q.device());
  AttnShape s;
  s.head_dim = s.head_dim_v = q.size(3);
  ScoreArgs score;
  score.softcap = o.softcap;
  score.alibi_slopes = o.alibi_slopes;
  score.sinks = o.sinks;
  backend_for(q.device()).check_options("ring_attention", s, global_mask(o), score);
  TORCH_CHECK(q.size(1) == k.size(1), "cpattn: ring attention needs q and k/v shards of the same "
              "length, got ", q.size(1), " and ", k.size(1));
  const int64_t local = q.size(1);
  if (o.layout == Layout::kZigzag && o.doc_lengths.empty())
    TORCH_CHECK(local % 2 == 0, "cpattn: the zigzag layout holds two equal chunks per rank, so the "
                "local sequence length must be even, got ", local);
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Where the time of the last ring call on this thread went: compute, and waiting for shifts
// (communication not hidden behind compute). Indexed [0] forward, [1] backward.
thread_local RingStats last_stats[2];

// The sub-problems that `rank` computes at `step`, i.e. against the K/V shard of
// ring_source(rank, step, world).
std::vector<SubProblem> plan(const RingOptions& o, int64_t local_len, int64_t world, int64_t rank,
                             int64_t step) {
  const Mask global = global_mask(o);
  std::vector<SubProblem> items;
  if (o.doc_lengths.empty()) {
    const StepPlan p = plan_step(o.layout, local_len * world, world, rank, step, global);
    items.assign(p.items, p.items + p.count);
  } else {
    plan_step_varlen(o.layout, o.doc_lengths.data(), static_cast<int64_t>(o.doc_lengths.size()),
                     world, rank, step, global, [&](const SubProblem& sp) { items.push_back(sp); });
  }
  return items;
}

// The score options of a sub-problem: ALiBi on the runs' global positions (the sub-problem's
// mask may use shifted local positions, the striped layout), never the sinks (they join once,
// after the last merge: finish_forward).
ScoreArgs sub_problem_score(const RingOptions& o, const SubProblem& sp) {
  ScoreArgs a;
  a.softcap = o.softcap;
  a.alibi_slopes = o.alibi_slopes;
  a.alibi_q_begin = sp.q.global_begin;
  a.alibi_k_begin = sp.k.global_begin;
  a.alibi_stride = sp.q.global_stride;
  return a;
}

// One step of the forward pass: every sub-problem against the K/V shard `kv` (2, B, L, Hkv, D),
// merged into the running fp32 (out, lse).
void forward_step(const at::Tensor& q, const at::Tensor& kv, const std::vector<SubProblem>& items,
                  const RingOptions& o, const at::Tensor& out, const at::Tensor& lse) {
  for (const SubProblem& sp : items) {
    auto [part_out, part_lse] =
        attention_fwd_scored(rows(q, sp.q), rows(kv[0], sp.k), rows(kv[1], sp.k), o.softmax_scale,
                             sp.mask, sub_problem_score(o, sp), at::kFloat);
    merge_into(rows(out, sp.q), lse_rows(lse, sp.q), part_out, part_lse);
  }
}

// After the last merge: the sinks join every row once; out in the asked dtype.
std::tuple<at::Tensor, at::Tensor> finish_forward(const at::Tensor& q, at::Tensor out,
                                                  at::Tensor lse, const RingOptions& o) {
  if (o.sinks) apply_sinks_(out, lse, *o.sinks);
  return {out.to(o.out_dtype.value_or(q.scalar_type())), lse};
}

// One step of the backward pass: adds the sub-problems' dQ to dq and their dK/dV to dkv
// (2, B, L, Hkv, D) fp32, from the global out / lse (and dlse) of the queries.
void backward_step(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& out, const at::Tensor& lse,
                   const std::optional<at::Tensor>& dlse, const std::vector<SubProblem>& items,
                   const RingOptions& o, const at::Tensor& dq, const at::Tensor& dkv) {
  for (const SubProblem& sp : items) {
    auto [dq_part, dk_part, dv_part] = attention_bwd_scored(
        rows(dout, sp.q), rows(q, sp.q), rows(kv[0], sp.k), rows(kv[1], sp.k), rows(out, sp.q),
        lse_rows(lse, sp.q), o.softmax_scale, sp.mask, sub_problem_score(o, sp), at::kFloat,
        dlse ? std::optional<at::Tensor>(lse_rows(*dlse, sp.q)) : std::nullopt);
    rows(dq, sp.q).add_(dq_part);
    rows(dkv[0], sp.k).add_(dk_part);
    rows(dkv[1], sp.k).add_(dv_part);
  }
}

// An error between posting shifts and waiting for them (e.g. a kernel that rejects its input):
// finish the exchanges anyway before rethrowing, since the peers posted theirs. Otherwise the
// next call's messages would meet this call's leftovers and the process group would be broken.
template <typename Compute>
void computing_while_shifting(std::initializer_list<comm::PendingShift*> pending, Compute compute) {
  try {
    compute();
  } catch (...) {
    for (comm::PendingShift* p : pending) {
      if (p == nullptr) continue;
      try {
        p->wait();
      } catch (...) {  // a peer that failed too or left: the original error is the one to report
      }
    }
    throw;
  }
}

std::tuple<at::Tensor, at::Tensor> new_state(const at::Tensor& q) {
  const auto f32 = q.options().dtype(at::kFloat);
  return {at::zeros(q.sizes(), f32), at::full({q.size(0), q.size(2), q.size(1)}, -INFINITY, f32)};
}

}  // namespace

const RingStats* last_ring_stats() { return last_stats; }

RingOptions make_ring_options(double softmax_scale, bool causal, int64_t window_left,
                              int64_t window_right, int64_t layout,
                              const std::optional<at::Tensor>& doc_lengths, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes,
                              const std::optional<at::Tensor>& sinks, int64_t prefix_len) {
  RingOptions o{softmax_scale, causal, normalized_window(window_left),
                normalized_window(window_right), checked_layout(layout), {}};
  TORCH_CHECK(prefix_len >= 0, "cpattn.ring_attention: prefix_len must be >= 0 (0: none), got ",
              prefix_len);
  o.softcap = softcap;
  o.alibi_slopes = alibi_slopes;
  o.sinks = sinks;
  o.prefix_len = prefix_len;
  if (doc_lengths && doc_lengths->defined()) {
    TORCH_CHECK(doc_lengths->dim() == 1 && doc_lengths->scalar_type() == at::kLong,
                "cpattn: doc_lengths must be a 1-D int64 tensor, got ", doc_lengths->sizes(), " ",
                doc_lengths->scalar_type());
    const at::Tensor l = doc_lengths->cpu().contiguous();
    o.doc_lengths.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
    for (int64_t n : o.doc_lengths)
      TORCH_CHECK(n >= 0, "cpattn: document lengths must be >= 0, got ", n);
  }
  return o;
}

namespace {

void check_local_length(const at::Tensor& q, const RingOptions& o, int64_t world) {
  if (o.doc_lengths.empty()) return;
  const int64_t g = layout_granularity(o.layout, world);
  int64_t local = 0;
  for (int64_t n : o.doc_lengths) local += (n + g - 1) / g * g / world;
  TORCH_CHECK(q.size(1) == local, "cpattn: with these documents every rank holds ", local,
              " tokens (each document padded to a multiple of ", g, ", split over ", world,
              " ranks), got ", q.size(1));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ring_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, comm::Transport& transport,
                                                const RingOptions& o, const ShardVisitor& visit) {
  const int64_t world = transport.world(), rank = transport.rank();
  check_ring_args(q, k, v, o);
  check_local_length(q, o, world);
  auto [out, lse] = new_state(q);
  RingStats& stats = last_stats[0];
  stats = {};
  // K and V travel as one message; two persistent buffers alternate between "being computed on"
  // and "being received into".
  at::Tensor kv[2] = {at::stack({k, v}), at::Tensor()};
  if (world > 1) kv[1] = at::empty_like(kv[0]);
  for (int64_t step = 0; step < world; ++step) {
    const at::Tensor& cur = kv[step % 2];
    std::unique_ptr<comm::PendingShift> pending;
    if (step + 1 < world) pending = transport.shift(cur, kv[(step + 1) % 2], step);
    const auto compute_start = Clock::now();
    computing_while_shifting({pending.get()}, [&] {
      if (visit) visit(ring_source(rank, step, world), cur);
      forward_step(q, cur, plan(o, q.size(1), world, rank, step), o, out, lse);
    });
    stats.compute_s += seconds_since(compute_start);
    const auto wait_start = Clock::now();
    if (pending) pending->wait();
    stats.wait_s += seconds_since(wait_start);
  }
  return finish_forward(q, out, lse, o);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    comm::Transport& transport, const RingOptions& o) {
  const int64_t world = transport.world(), rank = transport.rank();
  check_ring_args(q, k, v, o);
  check_local_length(q, o, world);
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));

  // K/V go round as in the forward pass. The fp32 dK/dV accumulator of each shard follows it one
  // step behind: at step t a rank receives the accumulator of the shard it now holds while it
  // computes that shard's new contributions into `partial`, and adds the two afterwards.
  at::Tensor kv[2] = {at::stack({k, v}), at::Tensor()};
  at::Tensor acc = at::empty({2, k.size(0), k.size(1), k.size(2), k.size(3)},
                             k.options().dtype(at::kFloat));
  at::Tensor partial = at::empty_like(acc), incoming;
  if (world > 1) {
    kv[1] = at::empty_like(kv[0]);
    incoming = at::empty_like(acc);
  }
  RingStats& stats = last_stats[1];
  stats = {};
  for (int64_t step = 0; step < world; ++step) {
    const at::Tensor& cur = kv[step % 2];
    std::unique_ptr<comm::PendingShift> kv_shift, acc_shift;
    if (step + 1 < world) kv_shift = transport.shift(cur, kv[(step + 1) % 2], 2 * step);
    if (step > 0) acc_shift = transport.shift(acc, incoming, 2 * step + 1);
    const auto compute_start = Clock::now();
    computing_while_shifting({kv_shift.get(), acc_shift.get()}, [&] {
      partial.zero_();
      backward_step(dout, q, cur, out, lse, dlse, plan(o, q.size(1), world, rank, step), o, dq,
                    partial);
    });
    stats.compute_s += seconds_since(compute_start);
    const auto wait_start = Clock::now();
    if (kv_shift) kv_shift->wait();
    if (acc_shift) {
      acc_shift->wait();
      stats.wait_s += seconds_since(wait_start);
      at::add_out(acc, incoming, partial);
    } else {
      stats.wait_s += seconds_since(wait_start);
      acc.copy_(partial);
    }
  }
  // acc now belongs to the shard of rank + 1: one last hop brings every rank its own.
  if (world > 1) {
    const auto wait_start = Clock::now();
    transport.shift(acc, incoming, 2 * world)->wait();
    stats.wait_s += seconds_since(wait_start);
    acc.copy_(incoming);
  }
  // copy=true: dk and dv must not be views of one buffer (autograd may accumulate into either,
  // and the op's schema and fake kernel promise separate tensors).
  return {dq.to(q.scalar_type()), acc[0].to(k.scalar_type(), false, true),
          acc[1].to(v.scalar_type(), false, true)};
}

// ---- all-gathered K/V: the same steps against shards that are already local ---------------

namespace {

void check_gathered_args(const at::Tensor& q, const at::Tensor& kv_all, int64_t rank,
                         const RingOptions& o) {
  TORCH_CHECK(kv_all.dim() == 6 && kv_all.size(1) == 2,
              "cpattn: kv_all must be (world, 2, batch, seqlen_local, kv_heads, head_dim), got ",
              kv_all.sizes());
  const int64_t world = kv_all.size(0);
  check_rank(rank, world);
  check_ring_args(q, kv_all[0][0], kv_all[0][1], o);
  check_local_length(q, o, world);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gathered_forward(const at::Tensor& q, const at::Tensor& kv_all,
                                                    int64_t rank, const RingOptions& o) {
  check_gathered_args(q, kv_all, rank, o);
  const int64_t world = kv_all.size(0);
  auto [out, lse] = new_state(q);
  for (int64_t step = 0; step < world; ++step)
    forward_step(q, kv_all[ring_source(rank, step, world)], plan(o, q.size(1), world, rank, step),
                 o, out, lse);
  return finish_forward(q, out, lse, o);
}

std::tuple<at::Tensor, at::Tensor> gathered_backward(const at::Tensor& dout, const at::Tensor& q,
                                                     const at::Tensor& kv_all,
                                                     const at::Tensor& out, const at::Tensor& lse,
                                                     const std::optional<at::Tensor>& dlse,
                                                     int64_t rank, const RingOptions& o) {
  check_gathered_args(q, kv_all, rank, o);
  const int64_t world = kv_all.size(0);
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor dkv_all = at::zeros(kv_all.sizes(), kv_all.options().dtype(at::kFloat));
  for (int64_t step = 0; step < world; ++step) {
    const int64_t source = ring_source(rank, step, world);
    backward_step(dout, q, kv_all[source], out, lse, dlse, plan(o, q.size(1), world, rank, step),
                  o, dq, dkv_all[source]);
  }
  // dkv_all[s] holds this rank's contribution to shard s; a reduce-scatter sums them.
  return {dq.to(q.scalar_type()), dkv_all};
}

}  // namespace cpattn::ops
