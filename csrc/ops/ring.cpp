// The ring driver, written once against comm::Transport. Per step it posts the shift of the next
// K/V shard, computes the sub-problems that the schedule (cpattn/schedule.h) gives for the shard
// it holds, merges them into the running fp32 (out, lse), then waits for the shift.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <thread>

#include "comm/transport.h"
#include "cpattn/schedule.h"
#include "ops/ops.h"
#include "ops/ring.h"

namespace cpattn::ops {
namespace {

// K and V of one shard, or their fp32 gradient accumulators: two tensors (B, L, Hkv, D), so that
// neither the caller's k, v nor the returned dk, dv need a stacked copy.
struct KvPair {
  at::Tensor k, v;
};

at::Tensor rows(const at::Tensor& t, const Run& run) {  // (B, S, ...) -> the run's tokens
  return t.narrow(1, run.local_begin, run.length);
}
at::Tensor lse_rows(const at::Tensor& lse, const Run& run) {  // (B, H, S)
  return lse.narrow(2, run.local_begin, run.length);
}

Layout checked_layout(int64_t layout) {
  TORCH_CHECK(layout >= 0 && layout <= 2, "cpattn: layout code must be 0 (contiguous), 1 (zigzag) "
              "or 2 (striped), got ", layout);
  return static_cast<Layout>(layout);
}

void check_ring_args(const at::Tensor& q, const at::Tensor& k, const RingOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "cpattn: ring q and k must be (batch, seqlen_local, "
              "heads, head_dim), got ", q.sizes(), " and ", k.sizes());
  check_score_args("ring_attention", o.softcap, o.alibi_slopes, o.sinks, q.size(2), q.device());
  // before any message: every rank raises here alike, no shift is left pending
  TORCH_CHECK(!q.is_cuda() || (o.softcap == 0.0 && !o.alibi_slopes && !o.sinks &&
                               o.prefix_len == 0),
              "cpattn.ring_attention: softcap, alibi_slopes, sinks and prefix_len are not "
              "supported by the CUDA kernels yet (CPU tensors only)");
  TORCH_CHECK(q.size(1) == k.size(1), "cpattn: ring attention needs q and k/v shards of the same "
              "length, got ", q.size(1), " and ", k.size(1));
  const int64_t local = q.size(1);
  if (o.layout == Layout::kZigzag && o.doc_lengths.empty())
    TORCH_CHECK(local % 2 == 0, "cpattn: the zigzag layout holds two equal chunks per rank, so the "
                "local sequence length must be even, got ", local);
}

// K and V travel as one stacked message.
void check_same_kv_shape(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.sizes() == v.sizes(), "cpattn.ring_attention: v must have k's shape ", k.sizes(),
              ", got ", v.sizes(), " (a head_dim of v different from q/k's is supported by "
              "cpattn.attention only, not yet by the context-parallel strategies)");
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
  Mask global;
  global.causal = o.causal;
  global.window_left = o.window_left;
  global.window_right = o.window_right;
  if (o.prefix_len > 0) global.prefix_end = o.prefix_len;
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

// One step of the forward pass: every sub-problem against the K/V shard `kv`, merged into the
// running fp32 (out, lse).
void forward_step(const at::Tensor& q, const KvPair& kv, const std::vector<SubProblem>& items,
                  const RingOptions& o, const at::Tensor& out, const at::Tensor& lse) {
  for (const SubProblem& sp : items) {
    auto [part_out, part_lse] =
        attention_fwd_scored(rows(q, sp.q), rows(kv.k, sp.k), rows(kv.v, sp.k), o.softmax_scale,
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

// One step of the backward pass: adds the sub-problems' dQ to dq and their dK/dV to the fp32
// accumulators dkv, from the global out / lse (and dlse) of the queries. before_add() runs
// before the first addition into dkv (the ring waits there for that accumulator to arrive, so
// the first sub-problem's kernel overlaps its transfer).
void backward_step(const at::Tensor& dout, const at::Tensor& q, const KvPair& kv,
                   const at::Tensor& out, const at::Tensor& lse,
                   const std::optional<at::Tensor>& dlse, const std::vector<SubProblem>& items,
                   const RingOptions& o, const at::Tensor& dq, const KvPair& dkv,
                   const std::function<void()>& before_add = {}) {
  for (const SubProblem& sp : items) {
    auto [dq_part, dk_part, dv_part] = attention_bwd_scored(
        rows(dout, sp.q), rows(q, sp.q), rows(kv.k, sp.k), rows(kv.v, sp.k), rows(out, sp.q),
        lse_rows(lse, sp.q), o.softmax_scale, sp.mask, sub_problem_score(o, sp), at::kFloat,
        dlse ? std::optional<at::Tensor>(lse_rows(*dlse, sp.q)) : std::nullopt);
    rows(dq, sp.q).add_(dq_part);
    if (before_add) before_add();
    rows(dkv.k, sp.k).add_(dk_part);
    rows(dkv.v, sp.k).add_(dv_part);
  }
}

// Shifts posted and not waited for yet; wait() waits for each once.
struct Shifts {
  std::vector<std::unique_ptr<comm::PendingShift>> pending;
  void post(comm::Transport& t, const at::Tensor& send, const at::Tensor& recv, int64_t tag) {
    pending.push_back(t.shift(send, recv, tag));
  }
  void wait() {
    for (auto& p : pending) {
      if (p) p->wait();
      p.reset();
    }
  }
};

// An error between posting shifts and waiting for them (e.g. a kernel that rejects its input):
// finish the exchanges anyway before rethrowing, since the peers posted theirs. Otherwise the
// next call's messages would meet this call's leftovers and the process group would be broken.
template <typename Compute>
void computing_while_shifting(std::initializer_list<Shifts*> shifts, Compute compute) {
  try {
    compute();
  } catch (...) {
    for (Shifts* s : shifts) {
      for (auto& p : s->pending) {
        if (p == nullptr) continue;
        try {
          p->wait();
        } catch (...) {  // a peer that failed too or left: the original error is the one to report
        }
        p.reset();
      }
    }
    throw;
  }
}

// Receive buffers and dK/dV accumulators of the CPU ring, kept between calls: a model's layers
// call the ring with the same shapes one after another, and reuse them instead of allocating
// (and faulting in) fresh memory each time. A slot's tensor is handed out only while nothing
// else refers to it or its storage (a returned or saved tensor is never reused); a slot asked
// for with another shape or dtype gets a new tensor. CUDA tensors come from torch's caching
// allocator instead, which orders reuse with the streams. release_buffers() frees them.
class BufferCache {
 public:
  enum Slot { kKey0, kValue0, kKey1, kValue1, kGradKey0, kGradValue0, kGradKey1, kGradValue1,
              kSlots };

  at::Tensor get(Slot slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
    if (options.device().type() != at::kCPU) return at::empty(sizes, options);
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor& t = slots_[slot];
    const bool reusable = t.defined() && t.sizes() == sizes &&
                          t.scalar_type() == options.dtype().toScalarType() &&
                          t.use_count() == 1 && t.storage().use_count() == 1;
    if (!reusable) t = at::empty(sizes, options);
    return t;
  }

  int64_t release() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t bytes = 0;
    for (at::Tensor& t : slots_) {
      if (t.defined()) bytes += t.nbytes();
      t = at::Tensor();
    }
    return bytes;
  }

 private:
  std::mutex mutex_;
  at::Tensor slots_[kSlots];
};

BufferCache& buffer_cache() {
  static BufferCache cache;
  return cache;
}

// The K/V shards a rank holds in turn: its own k, v at step 0 (never copied), then the receive
// buffers, one at W = 2 and two alternating from W = 3 (one is received into while the other is
// computed on). K and V travel as two messages, so the own shard needs no stacked copy.
class KvRing {
 public:
  KvRing(const at::Tensor& k, const at::Tensor& v, int64_t world)
      : own_{k.contiguous(), v.contiguous()} {
    const BufferCache::Slot slots[2][2] = {{BufferCache::kKey0, BufferCache::kValue0},
                                           {BufferCache::kKey1, BufferCache::kValue1}};
    for (int64_t i = 0; i < std::min<int64_t>(world - 1, 2); ++i)
      recv_.push_back({buffer_cache().get(slots[i][0], own_.k.sizes(), own_.k.options()),
                       buffer_cache().get(slots[i][1], own_.v.sizes(), own_.v.options())});
  }
  const KvPair& at_step(int64_t step) const {
    return step == 0 ? own_ : recv_[(step - 1) % recv_.size()];
  }
  // Posts the shift of the shard held at `step` into the buffer of step + 1.
  void post_shift(comm::Transport& t, Shifts& shifts, int64_t step, int64_t tag) const {
    const KvPair &cur = at_step(step), &next = at_step(step + 1);
    shifts.post(t, cur.k, next.k, tag);
    shifts.post(t, cur.v, next.v, tag + 1);
  }
  void release() { recv_.clear(); }

 private:
  KvPair own_;
  std::vector<KvPair> recv_;
};

std::tuple<at::Tensor, at::Tensor> new_state(const at::Tensor& q) {
  const auto f32 = q.options().dtype(at::kFloat);
  return {at::zeros(q.sizes(), f32), at::full({q.size(0), q.size(2), q.size(1)}, -INFINITY, f32)};
}

}  // namespace

at::Tensor ring_stats() {
  return at::tensor({last_stats[0].compute_s, last_stats[0].wait_s, last_stats[1].compute_s,
                     last_stats[1].wait_s},
                    at::kDouble);
}

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
  check_ring_args(q, k, o);
  check_same_kv_shape(k, v);
  check_local_length(q, o, world);
  auto [out, lse] = new_state(q);
  RingStats& stats = last_stats[0];
  stats = {};
  KvRing kv(k, v, world);
  for (int64_t step = 0; step < world; ++step) {
    const KvPair& cur = kv.at_step(step);
    Shifts shifts;
    if (step + 1 < world) kv.post_shift(transport, shifts, step, 2 * step);
    const auto compute_start = Clock::now();
    computing_while_shifting({&shifts}, [&] {
      if (visit) visit(ring_source(rank, step, world), cur.k, cur.v);
      forward_step(q, cur, plan(o, q.size(1), world, rank, step), o, out, lse);
    });
    stats.compute_s += seconds_since(compute_start);
    const auto wait_start = Clock::now();
    shifts.wait();
    stats.wait_s += seconds_since(wait_start);
  }
  kv.release();
  return finish_forward(q, out, lse, o);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    comm::Transport& transport, const RingOptions& o) {
  const int64_t world = transport.world(), rank = transport.rank();
  check_ring_args(q, k, o);
  check_same_kv_shape(k, v);
  check_local_length(q, o, world);
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));

  // K/V go round as in the forward pass. The fp32 dK/dV accumulator of each shard follows it one
  // step behind: at step t a rank sends the accumulator of step t - 1 (`acc`) and receives into
  // `incoming` the accumulator of the shard it now holds; the step's sub-problems add their
  // contributions straight into it once it has arrived (the first kernel runs during the
  // transfer), and the two buffers swap roles.
  KvRing kv(k, v, world);
  const auto f32 = k.options().dtype(at::kFloat);
  auto& cache = buffer_cache();
  KvPair acc{cache.get(BufferCache::kGradKey0, k.sizes(), f32),
             cache.get(BufferCache::kGradValue0, k.sizes(), f32)};
  KvPair incoming;
  if (world > 1)
    incoming = {cache.get(BufferCache::kGradKey1, k.sizes(), f32),
                cache.get(BufferCache::kGradValue1, k.sizes(), f32)};
  acc.k.zero_();
  acc.v.zero_();
  RingStats& stats = last_stats[1];
  stats = {};
  for (int64_t step = 0; step < world; ++step) {
    Shifts kv_shifts, acc_shifts;
    if (step + 1 < world) kv.post_shift(transport, kv_shifts, step, 4 * step);
    if (step > 0) {
      acc_shifts.post(transport, acc.k, incoming.k, 4 * step + 2);
      acc_shifts.post(transport, acc.v, incoming.v, 4 * step + 3);
    }
    double acc_wait = 0;
    const auto compute_start = Clock::now();
    computing_while_shifting({&kv_shifts, &acc_shifts}, [&] {
      const KvPair& target = step > 0 ? incoming : acc;
      backward_step(dout, q, kv.at_step(step), out, lse, dlse,
                    plan(o, q.size(1), world, rank, step), o, dq, target, [&] {
                      const auto wait_start = Clock::now();
                      acc_shifts.wait();
                      acc_wait += seconds_since(wait_start);
                    });
    });
    stats.compute_s += seconds_since(compute_start) - acc_wait;
    const auto wait_start = Clock::now();
    kv_shifts.wait();
    acc_shifts.wait();  // a step without sub-problems
    stats.wait_s += seconds_since(wait_start) + acc_wait;
    if (step > 0) std::swap(acc, incoming);
  }
  kv.release();
  // acc now belongs to the shard of rank + 1: one last hop brings every rank its own. In fp32
  // it lands in the returned dk and dv themselves (new tensors: autograd takes a gradient over
  // without a copy only if nothing else refers to it, and the cache would).
  const bool cast = k.scalar_type() != at::kFloat;
  if (world > 1) {
    const KvPair home = cast ? incoming : KvPair{at::empty_like(acc.k), at::empty_like(acc.v)};
    const auto wait_start = Clock::now();
    Shifts shifts;
    shifts.post(transport, acc.k, home.k, 4 * world);
    shifts.post(transport, acc.v, home.v, 4 * world + 1);
    shifts.wait();
    stats.wait_s += seconds_since(wait_start);
    acc = home;
  } else if (!cast) {
    acc = {acc.k.clone(), acc.v.clone()};
  }
  incoming = {};
  // dk and dv are separate tensors (autograd may accumulate into either, and the op's schema and
  // fake kernel promise that).
  return {dq.to(q.scalar_type()), acc.k.to(k.scalar_type()), acc.v.to(v.scalar_type())};
}

// ---- all-gathered K/V: the same steps against shards that are already local ---------------

namespace {

RingOptions gathered_options(const at::Tensor& q, const at::Tensor& kv_all, int64_t rank,
                             double softmax_scale, bool causal, int64_t window_left,
                             int64_t window_right, int64_t layout,
                             const std::optional<at::Tensor>& doc_lengths, double softcap,
                             const std::optional<at::Tensor>& alibi_slopes,
                             const std::optional<at::Tensor>& sinks, int64_t prefix_len) {
  TORCH_CHECK(kv_all.dim() == 6 && kv_all.size(1) == 2,
              "cpattn: kv_all must be (world, 2, batch, seqlen_local, kv_heads, head_dim), got ",
              kv_all.sizes());
  const int64_t world = kv_all.size(0);
  TORCH_CHECK(rank >= 0 && rank < world, "cpattn: rank ", rank, " is not in a group of ", world);
  RingOptions o = make_ring_options(softmax_scale, causal, window_left, window_right, layout,
                                    doc_lengths, softcap, alibi_slopes, sinks, prefix_len);
  check_ring_args(q, kv_all[0][0], o);
  check_local_length(q, o, world);
  return o;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gathered_fwd(const at::Tensor& q, const at::Tensor& kv_all,
                                                int64_t rank, double softmax_scale, bool causal,
                                                int64_t window_left, int64_t window_right,
                                                int64_t layout,
                                                const std::optional<at::Tensor>& doc_lengths,
                                                double softcap,
                                                const std::optional<at::Tensor>& alibi_slopes,
                                                const std::optional<at::Tensor>& sinks,
                                                int64_t prefix_len) {
  const RingOptions o = gathered_options(q, kv_all, rank, softmax_scale, causal, window_left,
                                         window_right, layout, doc_lengths, softcap,
                                         alibi_slopes, sinks, prefix_len);
  const int64_t world = kv_all.size(0);
  auto [out, lse] = new_state(q);
  for (int64_t step = 0; step < world; ++step) {
    const at::Tensor shard = kv_all[ring_source(rank, step, world)];
    forward_step(q, {shard[0], shard[1]}, plan(o, q.size(1), world, rank, step), o, out, lse);
  }
  return finish_forward(q, out, lse, o);
}

std::tuple<at::Tensor, at::Tensor> gathered_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv_all, const at::Tensor& out,
    const at::Tensor& lse, int64_t rank, double softmax_scale, bool causal, int64_t window_left,
    int64_t window_right, int64_t layout, const std::optional<at::Tensor>& doc_lengths,
    const std::optional<at::Tensor>& dlse, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t prefix_len) {
  const RingOptions o =
      gathered_options(q, kv_all, rank, softmax_scale, causal, window_left, window_right, layout,
                       doc_lengths, softcap, alibi_slopes, std::nullopt, prefix_len);
  const int64_t world = kv_all.size(0);
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor dkv_all = at::zeros(kv_all.sizes(), kv_all.options().dtype(at::kFloat));
  for (int64_t step = 0; step < world; ++step) {
    const int64_t source = ring_source(rank, step, world);
    backward_step(dout, q, {kv_all[source][0], kv_all[source][1]}, out, lse, dlse,
                  plan(o, q.size(1), world, rank, step), o, dq,
                  {dkv_all[source][0], dkv_all[source][1]});
  }
  // dkv_all[s] holds this rank's contribution to shard s; a reduce-scatter sums them.
  return {dq.to(q.scalar_type()), dkv_all};
}

// ---- ops over a torch process group -------------------------------------------------------

// CUDA tensors shift over cpattn's own NCCL communicator (CPATTN_RING_TRANSPORT=c10d: through the
// process group instead); CPU tensors through the process group.
std::unique_ptr<comm::Transport> group_transport(const at::Tensor& q, c10::string_view group_name,
                                                 double timeout_s) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
#ifdef CPATTN_WITH_CUDA
  const char* choice = std::getenv("CPATTN_RING_TRANSPORT");
  if (q.is_cuda() && !(choice && std::string(choice) == "c10d"))
    return comm::make_nccl_transport(std::string(group_name), q.device(), timeout);
#endif
  return comm::make_process_group_transport(std::string(group_name), timeout);
}

at::Tensor ring_shift(const at::Tensor& send, c10::string_view group_name, double timeout_s) {
  auto transport = group_transport(send, group_name, timeout_s);
  const at::Tensor src = send.contiguous();
  at::Tensor recv = at::empty_like(src);
  transport->shift(src, recv, 0)->wait();
  transport->finish();
  return recv;
}

int64_t release_buffers() { return buffer_cache().release(); }

int64_t destroy_communicators() {
#ifdef CPATTN_WITH_CUDA
  return comm::destroy_nccl_communicators();
#else
  return 0;
#endif
}

std::tuple<at::Tensor, at::Tensor> ring_fwd(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, c10::string_view group_name,
                                            double softmax_scale, bool causal,
                                            int64_t window_left, int64_t window_right,
                                            int64_t layout, double timeout_s,
                                            const std::optional<at::Tensor>& doc_lengths,
                                            double softcap,
                                            const std::optional<at::Tensor>& alibi_slopes,
                                            const std::optional<at::Tensor>& sinks,
                                            int64_t prefix_len) {
  auto transport = group_transport(q, group_name, timeout_s);
  auto result = ring_forward(q, k, v, *transport,
                             make_ring_options(softmax_scale, causal, window_left, window_right,
                                               layout, doc_lengths, softcap, alibi_slopes, sinks,
                                               prefix_len));
  transport->finish();
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name,
    double softmax_scale, bool causal, int64_t window_left, int64_t window_right, int64_t layout,
    double timeout_s, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& doc_lengths, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t prefix_len) {
  auto transport = group_transport(q, group_name, timeout_s);
  auto result = ring_backward(dout, q, k, v, out, lse, dlse, *transport,
                              make_ring_options(softmax_scale, causal, window_left, window_right,
                                                layout, doc_lengths, softcap, alibi_slopes,
                                                std::nullopt, prefix_len));
  transport->finish();
  return result;
}

// ---- W emulated ranks in this process: one thread each ------------------------------------

namespace {

// Runs body(rank, transport) on W threads; body returns the tensors it hands back. On CUDA each
// virtual rank computes on its own stream (see make_emulated_cuda_transport).
template <typename Body>
void run_emulated(int64_t world, const at::Tensor& like, Body body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::vector<at::Tensor>> outputs(world);
  const auto timeout = std::chrono::seconds(60);
#ifdef CPATTN_WITH_CUDA
  std::shared_ptr<comm::CudaMailbox> cuda_box;
  if (like.is_cuda()) cuda_box = comm::make_cuda_mailbox(world, like.device());
#endif
  auto mailbox = comm::make_mailbox(world);
  for (int64_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<comm::Transport> transport;
#ifdef CPATTN_WITH_CUDA
        if (cuda_box) transport = comm::make_emulated_cuda_transport(cuda_box, r, timeout);
#endif
        if (!transport) transport = comm::make_emulated_transport(mailbox, r, timeout);
        outputs[r] = body(r, *transport);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
#ifdef CPATTN_WITH_CUDA
  if (cuda_box)
    for (const auto& out : outputs) comm::finish_emulated_cuda(*cuda_box, out);
#endif
}

}  // namespace

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> ring_fwd_emulated(
    at::TensorList q, at::TensorList k, at::TensorList v, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, int64_t layout) {
  const int64_t world = static_cast<int64_t>(q.size());
  TORCH_CHECK(world >= 1 && k.size() == q.size() && v.size() == q.size(),
              "cpattn: emulated ring needs one q, k and v per rank, got ", q.size(), ", ",
              k.size(), ", ", v.size());
  const RingOptions o = make_ring_options(softmax_scale, causal, window_left, window_right, layout, std::nullopt);
  std::vector<at::Tensor> outs(world), lses(world);
  run_emulated(world, q[0], [&](int64_t r, comm::Transport& t) {
    std::tie(outs[r], lses[r]) = ring_forward(q[r], k[r], v[r], t, o);
    return std::vector<at::Tensor>{outs[r], lses[r]};
  });
  return {outs, lses};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
ring_bwd_emulated(at::TensorList dout, at::TensorList q, at::TensorList k, at::TensorList v,
                  at::TensorList out, at::TensorList lse, double softmax_scale, bool causal,
                  int64_t window_left, int64_t window_right, int64_t layout) {
  const int64_t world = static_cast<int64_t>(q.size());
  TORCH_CHECK(world >= 1 && k.size() == q.size() && v.size() == q.size() &&
                  dout.size() == q.size() && out.size() == q.size() && lse.size() == q.size(),
              "cpattn: emulated ring backward needs one of each tensor per rank");
  const RingOptions o = make_ring_options(softmax_scale, causal, window_left, window_right, layout, std::nullopt);
  std::vector<at::Tensor> dq(world), dk(world), dv(world);
  run_emulated(world, q[0], [&](int64_t r, comm::Transport& t) {
    std::tie(dq[r], dk[r], dv[r]) = ring_backward(dout[r], q[r], k[r], v[r], out[r], lse[r], std::nullopt, t, o);
    return std::vector<at::Tensor>{dq[r], dk[r], dv[r]};
  });
  return {dq, dk, dv};
}

at::Tensor ring_loopback_timing(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& dout, int64_t rank, int64_t world,
                                double softmax_scale, bool causal, int64_t window_left,
                                int64_t window_right, int64_t layout) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "cpattn: rank ", rank,
              " is not in a group of ", world);
  auto transport = comm::make_loopback_transport(rank, world);
  const RingOptions o = make_ring_options(softmax_scale, causal, window_left, window_right, layout, std::nullopt);
  auto start = Clock::now();
  auto [out, lse] = ring_forward(q, k, v, *transport, o);
  const double fwd = seconds_since(start);
  start = Clock::now();
  ring_backward(dout, q, k, v, out, lse, std::nullopt, *transport, o);
  return at::tensor({fwd, seconds_since(start)}, at::kDouble);
}

at::Tensor layout_positions(int64_t seqlen, int64_t world, int64_t rank, int64_t layout) {
  const Layout l = checked_layout(layout);
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "cpattn: rank ", rank,
              " is not in a group of ", world);
  const int64_t g = layout_granularity(l, world);
  TORCH_CHECK(seqlen > 0 && seqlen % g == 0, "cpattn: the global sequence length (", seqlen,
              ") must be a positive multiple of ", g, " for the ",
              l == Layout::kZigzag ? "zigzag" : (l == Layout::kStriped ? "striped" : "contiguous"),
              " layout over ", world, " ranks");
  const int64_t local = seqlen / world;
  at::Tensor pos = at::empty({local}, at::kLong);
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < local; ++i) p[i] = global_position(l, seqlen, world, rank, i);
  return pos;
}

}  // namespace cpattn::ops
