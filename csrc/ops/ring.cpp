// The ring driver, written once against comm::Transport. Per step it posts the shift of the next
// K/V shard, computes the sub-problems that the schedule (cpattn/schedule.h) gives for the shard
// it holds, merges them into the running fp32 (out, lse), then waits for the shift.
// Below it, the ring's ops over a torch process group (and their all-gathered variant, local
// varlen attention): op arguments -> RingOptions, a transport for the group, the driver; and the
// ops on layouts and the ring's timing that take no tensor.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <string>

#include "comm/transport.h"
#include "cpattn/env.h"
#include "cpattn/schedule.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/ring.h"

namespace cpattn::ops {
namespace {

// K and V of one shard, or their fp32 gradient accumulators: two tensors (B, L, Hkv, D) and
// (B, L, Hkv, Dv), so that neither the caller's k, v nor the returned dk, dv need a stacked copy,
// and v may have its own head dim Dv (MLA-style models).
struct KvPair {
  at::Tensor k, v;
};

at::Tensor rows(const at::Tensor& t, const Run& run) {  // (B, S, ...) -> the run's tokens
  return t.narrow(1, run.local_begin, run.length);
}
at::Tensor lse_rows(const at::Tensor& lse, const Run& run) {  // (B, H, S)
  return lse.narrow(2, run.local_begin, run.length);
}

// Checks before any message: every rank raises here alike, no shift is left pending.
void check_ring_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const RingOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4,
              "cpattn: ring q and k must be (batch, seqlen_local, "
              "heads, head_dim), got ",
              q.sizes(), " and ", k.sizes());
  // K and V travel as two messages: v may have its own head dim.
  TORCH_CHECK(v.dim() == 4 && k.sizes().slice(0, 3) == v.sizes().slice(0, 3),
              "cpattn.ring_attention: v must have k's shape but for the head dim, got k ",
              k.sizes(), " and v ", v.sizes());
  // Relays carry K and V in one buffer of one dtype.
  TORCH_CHECK(k.scalar_type() == v.scalar_type(),
              "cpattn.ring_attention: k and v must have the same dtype, got k ", k.scalar_type(),
              " and v ", v.scalar_type());
  check_options("ring_attention", o, q.size(2), q.device());
  check_per_head("ring_attention", "sinks", o.sinks, q.size(2), q.device());
  TORCH_CHECK(q.size(1) == k.size(1),
              "cpattn: ring attention needs q and k/v shards of the same "
              "length, got ",
              q.size(1), " and ", k.size(1));
  const int64_t local = q.size(1);
  if (o.layout == Layout::kZigzag && o.doc_lengths.empty())
    TORCH_CHECK(local % 2 == 0,
                "cpattn: the zigzag layout holds two equal segments per rank, so the "
                "local sequence length must be even, got ",
                local);
}

// What the kernels need of a call's tensors (q, the K/V shard as the ring holds it, and for the
// backward dout, out, lse, dlse), checked once per call before any message: every sub-problem is
// a run of tokens of these tensors (or of received shards like k, v), so the kernels are called
// through the unchecked entries (ops.h attention_fwd_unchecked), not checked again per
// sub-problem. Without local tokens there is no sub-problem to check for.
void check_kernel_args(const at::Tensor& q, const KvPair& shard) {
  if (q.size(1) > 0) check_qkv(q, shard.k, shard.v);
}
void check_kernel_args(const at::Tensor& q, const KvPair& shard, const at::Tensor& dout,
                       const at::Tensor& out, const at::Tensor& lse,
                       const std::optional<at::Tensor>& dlse) {
  if (q.size(1) == 0) return;
  check_bwd_args(dout, q, out, lse, dlse, at::kFloat, check_qkv(q, shard.k, shard.v));
}

// The all-gather backward's dK/dV sums of a shard lie side by side along the head dim,
// (B, L, Hkv, D + Dv), so that one reduce-scatter sends them: those of keys of head dim d.
KvPair split_kv(const at::Tensor& kv, int64_t d) {
  return {kv.narrow(-1, 0, d), kv.narrow(-1, d, kv.size(-1) - d)};
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
std::vector<SubProblem> sub_problems(const RingOptions& o, int64_t local_len, int64_t world,
                                     int64_t rank, int64_t step) {
  const Mask global = global_mask(o);
  std::vector<SubProblem> items;
  if (o.doc_lengths.empty()) {
    const StepSchedule p = schedule_step(o.layout, local_len * world, world, rank, step, global);
    items.assign(p.items, p.items + p.count);
  } else {
    schedule_step_varlen(
        o.layout, o.doc_lengths.data(), static_cast<int64_t>(o.doc_lengths.size()), world, rank,
        step, global, [&](const SubProblem& sp) { items.push_back(sp); },
        o.doc_prefix_lens.empty() ? nullptr : o.doc_prefix_lens.data());
  }
  return items;
}

// The score options of every sub-problem of a call, made once per call (after its checks): the
// ALiBi slopes in fp32, as the kernels read them; never the sinks (they join once, after the
// last merge: finish_forward).
ScoreArgs ring_score_args(const RingOptions& o) {
  ScoreArgs a = score_args(o);
  if (a.alibi_slopes) a.alibi_slopes = a.alibi_slopes->to(at::kFloat).contiguous();
  return a;
}

// The score options of a sub-problem: ALiBi on the runs' global positions (the sub-problem's
// mask may use shifted local positions, the striped layout).
ScoreArgs sub_problem_score(const ScoreArgs& call, const SubProblem& sp) {
  ScoreArgs a = call;
  a.alibi_q_begin = sp.q.global_begin;
  a.alibi_k_begin = sp.k.global_begin;
  a.alibi_stride = sp.q.global_stride;
  return a;
}

// One step of the forward pass: every sub-problem against the K/V shard `kv`, merged into the
// running fp32 (out, lse).
void forward_step(const at::Tensor& q, const KvPair& kv, const std::vector<SubProblem>& items,
                  const RingOptions& o, const ScoreArgs& score, const at::Tensor& out,
                  const at::Tensor& lse) {
  for (const SubProblem& sp : items) {
    auto [part_out, part_lse] =
        attention_fwd_unchecked(rows(q, sp.q), rows(kv.k, sp.k), rows(kv.v, sp.k), o.softmax_scale,
                                sp.mask, sub_problem_score(score, sp), at::kFloat);
    merge_into(rows(out, sp.q), lse_rows(lse, sp.q), part_out, part_lse);
  }
}

// After the last merge: the sinks join every row once; out in the asked dtype.
std::tuple<at::Tensor, at::Tensor> finish_forward(const at::Tensor& q, at::Tensor out,
                                                  at::Tensor lse, const RingOptions& o) {
  if (o.sinks) apply_sinks_(out, lse, *o.sinks);
  return {out.to(o.out_dtype.value_or(q.scalar_type())), lse};
}

// dQ summed over the steps in fp32. With bf16 inputs on a backend that adds into split sums, split:
// the high halves in the bf16 result itself, the low halves beside, rounded in place at the end,
// so that an fp32 dQ and its bf16 copy never exist together; else an fp32 tensor.
struct DqSums {
  at::Tensor sums, low;
  explicit DqSums(const at::Tensor& q) {
    const bool split = q.scalar_type() == at::kBFloat16 && split_sums_supported(q.device());
    sums = at::zeros(q.sizes(), q.options().dtype(split ? at::kBFloat16 : at::kFloat));
    if (split) low = at::zeros(q.sizes(), q.options().dtype(at::kShort));
  }
  std::optional<at::Tensor> low_rows(const Run& run) const {
    return low.defined() ? std::optional<at::Tensor>(rows(low, run)) : std::nullopt;
  }
  at::Tensor result(at::ScalarType dtype) {
    if (!low.defined()) return sums.to(dtype);
    round_split_(sums, low);
    low = at::Tensor();
    return sums;
  }
};

// One step of the backward pass: adds the sub-problems' dQ to dq and their dK/dV to the fp32
// accumulators dkv, from the global out / lse (and dlse) of the queries; the kernels add into
// them directly. When there is a before_add(), it runs before anything is added into dkv (the
// ring waits there for that accumulator to arrive): the step's first sub-problem adds its dK/dV
// into zeroed temporaries instead, added to dkv after the wait, so that its kernel overlaps the
// transfer.
void backward_step(const at::Tensor& dout, const at::Tensor& q, const KvPair& kv,
                   const at::Tensor& out, const at::Tensor& lse,
                   const std::optional<at::Tensor>& dlse, const std::vector<SubProblem>& items,
                   const RingOptions& o, const ScoreArgs& score, const DqSums& dq,
                   const KvPair& dkv, const std::function<void()>& before_add = {}) {
  bool arrived = !before_add;
  for (const SubProblem& sp : items) {
    const at::Tensor dk = rows(dkv.k, sp.k), dv = rows(dkv.v, sp.k);
    const auto add_into = [&](const at::Tensor& dk_target, const at::Tensor& dv_target) {
      attention_bwd_add_unchecked(
          rows(dq.sums, sp.q), dk_target, dv_target, rows(dout, sp.q), rows(q, sp.q),
          rows(kv.k, sp.k), rows(kv.v, sp.k), rows(out, sp.q), lse_rows(lse, sp.q), o.softmax_scale,
          sp.mask, sub_problem_score(score, sp),
          dlse ? std::optional<at::Tensor>(lse_rows(*dlse, sp.q)) : std::nullopt,
          dq.low_rows(sp.q));
    };
    if (arrived) {
      add_into(dk, dv);
      continue;
    }
    const at::Tensor dk_part = at::zeros(dk.sizes(), dk.options()),
                     dv_part = at::zeros(dv.sizes(), dv.options());
    add_into(dk_part, dv_part);
    before_add();
    arrived = true;
    dk.add_(dk_part);
    dv.add_(dv_part);
  }
}

// Shifts posted and not waited for yet; wait() waits for each once.
struct Shifts {
  std::vector<std::unique_ptr<comm::PendingShift>> pending;
  void post(comm::Transport& t, const at::Tensor& send, const at::Tensor& recv, int64_t tag) {
    pending.push_back(t.shift(send, recv, tag));
  }
  // Several buffers in one shift (tags tag, tag + 1, ...): on NCCL one group, one post.
  void post(comm::Transport& t, const std::vector<at::Tensor>& sends,
            const std::vector<at::Tensor>& recvs, int64_t tag) {
    pending.push_back(t.shift_all(sends, recvs, tag));
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
  enum Slot { kKv0, kKv1, kGradKv0, kGradKv1, kSlots };

  at::Tensor get(Slot slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
    if (options.device().type() != at::kCPU) return at::empty(sizes, options);
    std::lock_guard<std::mutex> lock(mutex_);
    at::Tensor& t = slots_[slot];
    const bool reusable = t.defined() && t.sizes() == sizes &&
                          t.scalar_type() == options.dtype().toScalarType() && t.use_count() == 1 &&
                          t.storage().use_count() == 1;
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

// A ring buffer of one shard's K and V (or their gradients) in one allocation: kv.k and kv.v are
// contiguous views of `both` (k's elements, then v's), so that a relay moves the pair as one
// message.
struct KvBuffer {
  at::Tensor both;
  KvPair kv;
};

KvBuffer kv_buffer(BufferCache::Slot slot, const at::Tensor& k, const at::Tensor& v,
                   const at::TensorOptions& options) {
  const int64_t nk = k.numel();
  at::Tensor both = buffer_cache().get(slot, {nk + v.numel()}, options);
  return {both,
          {both.narrow(0, 0, nk).view(k.sizes()), both.narrow(0, nk, v.numel()).view(v.sizes())}};
}

// The K/V shards a rank holds in turn: its own k, v at step 0 (never copied), then the receive
// buffers, one at W = 2 and two alternating from W = 3 (one is received into while the other is
// computed on). The own shard travels as one shift of two buffers (K and V; no stacked copy),
// every relay after it as one buffer.
class KvRing {
 public:
  KvRing(const at::Tensor& k, const at::Tensor& v, int64_t world)
      : own_{k.contiguous(), v.contiguous()} {
    const BufferCache::Slot slots[2] = {BufferCache::kKv0, BufferCache::kKv1};
    for (int64_t i = 0; i < std::min<int64_t>(world - 1, 2); ++i)
      recv_.push_back(kv_buffer(slots[i], own_.k, own_.v, own_.k.options()));
  }
  const KvPair& at_step(int64_t step) const { return step == 0 ? own_ : held(step).kv; }
  // Posts the shift of the shard held at `step` into the buffer of step + 1.
  void post_shift(comm::Transport& t, Shifts& shifts, int64_t step, int64_t tag) const {
    const KvBuffer& next = held(step + 1);
    if (step == 0) {
      shifts.post(t, {own_.k, own_.v}, {next.kv.k, next.kv.v}, tag);
    } else {
      shifts.post(t, held(step).both, next.both, tag);
    }
  }
  void release() { recv_.clear(); }

 private:
  const KvBuffer& held(int64_t step) const { return recv_[(step - 1) % recv_.size()]; }

  KvPair own_;
  std::vector<KvBuffer> recv_;
};

// The running fp32 (out, lse) of q's rows for values of head dim dv.
std::tuple<at::Tensor, at::Tensor> new_state(const at::Tensor& q, int64_t dv) {
  const auto f32 = q.options().dtype(at::kFloat);
  return {at::zeros({q.size(0), q.size(1), q.size(2), dv}, f32),
          at::full({q.size(0), q.size(2), q.size(1)}, -INFINITY, f32)};
}

}  // namespace

const RingStats* last_ring_stats() { return last_stats; }

RingOptions make_ring_options(const AttentionOptions& options, int64_t layout,
                              const std::optional<at::Tensor>& doc_lengths,
                              const std::optional<at::Tensor>& doc_prefix_lens,
                              const std::optional<at::Tensor>& sinks) {
  RingOptions o;
  static_cast<AttentionOptions&>(o) = options;
  o.window_left = normalized_window(options.window_left);
  o.window_right = normalized_window(options.window_right);
  o.layout = checked_layout(layout);
  TORCH_CHECK(o.prefix_len >= 0, "cpattn.ring_attention: prefix_len must be >= 0 (0: none), got ",
              o.prefix_len);
  o.sinks = sinks;
  const bool prefixes = doc_prefix_lens && doc_prefix_lens->defined();
  if (doc_lengths && doc_lengths->defined()) {
    TORCH_CHECK(doc_lengths->dim() == 1 && doc_lengths->scalar_type() == at::kLong,
                "cpattn: doc_lengths must be a (D,) int64 tensor, got ", doc_lengths->sizes(), " ",
                doc_lengths->scalar_type());
    const at::Tensor l = doc_lengths->cpu().contiguous();
    o.doc_lengths.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
    for (int64_t n : o.doc_lengths)
      TORCH_CHECK(n >= 0, "cpattn: document lengths must be >= 0, got ", n);
  }
  if (prefixes) {
    TORCH_CHECK(doc_prefix_lens->dim() == 1 && doc_prefix_lens->scalar_type() == at::kLong &&
                    doc_prefix_lens->size(0) == static_cast<int64_t>(o.doc_lengths.size()) &&
                    !o.doc_lengths.empty(),
                "cpattn: doc_prefix_lens must be a (D,) int64 tensor, one prefix per document of "
                "doc_lengths (",
                o.doc_lengths.size(), "), got ", doc_prefix_lens->sizes(), " ",
                doc_prefix_lens->scalar_type());
    TORCH_CHECK(o.prefix_len == 0, "cpattn: give prefix_len or a prefix per document, not both");
    const at::Tensor p = doc_prefix_lens->cpu().contiguous();
    o.doc_prefix_lens.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
    for (int64_t n : o.doc_prefix_lens)
      TORCH_CHECK(n >= 0, "cpattn: document prefix lengths must be >= 0, got ", n);
  }
  return o;
}

namespace {

void check_local_length(const at::Tensor& q, const RingOptions& o, int64_t world) {
  if (o.doc_lengths.empty()) return;
  const int64_t local = padded_documents_length(o.layout, o.doc_lengths.data(),
                                                static_cast<int64_t>(o.doc_lengths.size()), world) /
                        world;
  TORCH_CHECK(q.size(1) == local, "cpattn: with these documents every rank holds ", local,
              " tokens (each document padded to a multiple of ",
              layout_granularity(o.layout, world), ", split over ", world, " ranks), got ",
              q.size(1));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ring_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, comm::Transport& transport,
                                                const RingOptions& o, const ShardVisitor& visit) {
  const int64_t world = transport.world(), rank = transport.rank();
  check_ring_args(q, k, v, o);
  check_local_length(q, o, world);
  KvRing kv(k, v, world);
  check_kernel_args(q, kv.at_step(0));
  const ScoreArgs score = ring_score_args(o);
  auto [out, lse] = new_state(q, v.size(3));
  RingStats& stats = last_stats[0];
  stats = {};
  for (int64_t step = 0; step < world; ++step) {
    const KvPair& cur = kv.at_step(step);
    Shifts shifts;
    if (step + 1 < world) kv.post_shift(transport, shifts, step, 2 * step);
    const auto compute_start = Clock::now();
    computing_while_shifting({&shifts}, [&] {
      if (visit) visit(ring_source(rank, step, world), cur.k, cur.v);
      forward_step(q, cur, sub_problems(o, q.size(1), world, rank, step), o, score, out, lse);
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
  check_ring_args(q, k, v, o);
  check_local_length(q, o, world);
  KvRing kv(k, v, world);
  check_kernel_args(q, kv.at_step(0), dout, out, lse, dlse);
  const ScoreArgs score = ring_score_args(o);
  DqSums dq(q);

  // K/V go round as in the forward pass. The fp32 dK/dV accumulator of each shard follows it one
  // step behind: at step t a rank sends the accumulator of step t - 1 (`acc`) and receives into
  // `incoming` the accumulator of the shard it now holds; the step's sub-problems add their
  // contributions straight into it once it has arrived (the first kernel runs during the
  // transfer), and the two buffers swap roles.
  // Each accumulator pair is one buffer, so it travels as one message.
  const auto f32 = k.options().dtype(at::kFloat);
  KvBuffer acc = kv_buffer(BufferCache::kGradKv0, k, v, f32);
  KvBuffer incoming;
  if (world > 1) incoming = kv_buffer(BufferCache::kGradKv1, k, v, f32);
  acc.both.zero_();
  RingStats& stats = last_stats[1];
  stats = {};
  for (int64_t step = 0; step < world; ++step) {
    Shifts kv_shifts, acc_shifts;
    // The accumulator first: the step waits for it, and on a FIFO comm stream (NCCL) a K/V shift
    // posted before it would be in the way.
    if (step > 0) acc_shifts.post(transport, acc.both, incoming.both, 4 * step + 2);
    if (step + 1 < world) kv.post_shift(transport, kv_shifts, step, 4 * step);
    double acc_wait = 0;
    const auto compute_start = Clock::now();
    computing_while_shifting({&kv_shifts, &acc_shifts}, [&] {
      const KvPair& target = step > 0 ? incoming.kv : acc.kv;
      const auto wait_for_acc = [&] {
        const auto wait_start = Clock::now();
        acc_shifts.wait();
        acc_wait += seconds_since(wait_start);
      };
      backward_step(dout, q, kv.at_step(step), out, lse, dlse,
                    sub_problems(o, q.size(1), world, rank, step), o, score, dq, target,
                    step > 0 ? std::function<void()>(wait_for_acc) : std::function<void()>());
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
  // without a copy only if nothing else refers to it, and the cache would), as one shift of
  // two buffers; otherwise in `incoming`, as one, and is cast from there.
  const bool cast = k.scalar_type() != at::kFloat;
  KvPair grads = acc.kv;
  if (world > 1) {
    const auto wait_start = Clock::now();
    Shifts shifts;
    if (cast) {
      shifts.post(transport, acc.both, incoming.both, 4 * world);
      grads = incoming.kv;
    } else {
      grads = {at::empty_like(acc.kv.k), at::empty_like(acc.kv.v)};
      shifts.post(transport, {acc.kv.k, acc.kv.v}, {grads.k, grads.v}, 4 * world);
    }
    shifts.wait();
    stats.wait_s += seconds_since(wait_start);
  } else if (!cast) {
    grads = {acc.kv.k.clone(), acc.kv.v.clone()};
  }
  acc = incoming = {};
  // dk and dv are separate tensors (autograd may accumulate into either, and the op's schema and
  // fake kernel promise that).
  return {dq.result(q.scalar_type()), grads.k.to(k.scalar_type()), grads.v.to(v.scalar_type())};
}

// ---- all-gathered K/V: the same steps against shards that are already local ---------------

namespace {

void check_gathered_args(const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all,
                         int64_t rank, const RingOptions& o) {
  TORCH_CHECK(k_all.dim() == 5 && v_all.dim() == 5 && q.dim() == 4 &&
                  k_all.sizes().slice(0, 4) == v_all.sizes().slice(0, 4),
              "cpattn: k_all and v_all must be (world, batch, seqlen_local, kv_heads, head_dim) "
              "and (..., v_head_dim) for q (batch, seqlen_local, heads, head_dim), got ",
              k_all.sizes(), ", ", v_all.sizes(), " and ", q.sizes());
  const int64_t world = k_all.size(0);
  check_rank(rank, world);
  check_ring_args(q, k_all[0], v_all[0], o);
  check_local_length(q, o, world);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gathered_forward(const at::Tensor& q, const at::Tensor& k_all,
                                                    const at::Tensor& v_all, int64_t rank,
                                                    const RingOptions& o) {
  check_gathered_args(q, k_all, v_all, rank, o);
  const int64_t world = k_all.size(0);
  check_kernel_args(q, {k_all[0], v_all[0]});
  const ScoreArgs score = ring_score_args(o);
  auto [out, lse] = new_state(q, v_all.size(4));
  for (int64_t step = 0; step < world; ++step) {
    const int64_t source = ring_source(rank, step, world);
    forward_step(q, {k_all[source], v_all[source]}, sub_problems(o, q.size(1), world, rank, step),
                 o, score, out, lse);
  }
  return finish_forward(q, out, lse, o);
}

std::tuple<at::Tensor, at::Tensor> gathered_backward(const at::Tensor& dout, const at::Tensor& q,
                                                     const at::Tensor& k_all,
                                                     const at::Tensor& v_all, const at::Tensor& out,
                                                     const at::Tensor& lse,
                                                     const std::optional<at::Tensor>& dlse,
                                                     int64_t rank, const RingOptions& o) {
  check_gathered_args(q, k_all, v_all, rank, o);
  const int64_t world = k_all.size(0);
  check_kernel_args(q, {k_all[0], v_all[0]}, dout, out, lse, dlse);
  const ScoreArgs score = ring_score_args(o);
  DqSums dq(q);
  at::Tensor dkv_all =
      at::zeros({world, k_all.size(1), k_all.size(2), k_all.size(3), k_all.size(4) + v_all.size(4)},
                k_all.options().dtype(at::kFloat));
  for (int64_t step = 0; step < world; ++step) {
    const int64_t source = ring_source(rank, step, world);
    backward_step(dout, q, {k_all[source], v_all[source]}, out, lse, dlse,
                  sub_problems(o, q.size(1), world, rank, step), o, score, dq,
                  split_kv(dkv_all[source], q.size(3)));
  }
  // dkv_all[s] holds this rank's contribution to shard s; a reduce-scatter sums them.
  return {dq.result(q.scalar_type()), dkv_all};
}

int64_t release_buffers() { return buffer_cache().release(); }

// The ring's ops.

// CUDA tensors shift over cpattn's own NCCL communicator (CPATTN_RING_TRANSPORT=c10d: through the
// process group instead); CPU tensors through the process group.
std::unique_ptr<comm::Transport> group_transport([[maybe_unused]] const at::Tensor& q,
                                                 c10::string_view group_name, double timeout_s) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
#ifdef CPATTN_WITH_CUDA
  if (q.is_cuda() && !env::ring_transport_c10d())
    return comm::make_nccl_transport(std::string(group_name), q.device(), timeout);
#endif
  return comm::make_process_group_transport(std::string(group_name), timeout);
}

namespace {

std::tuple<at::Tensor, at::Tensor> ring_fwd(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, c10::string_view group_name,
                                            int64_t layout, double timeout_s,
                                            const std::optional<at::Tensor>& doc_lengths,
                                            const std::optional<at::Tensor>& doc_prefix_lens,
                                            const std::optional<at::Tensor>& sinks,
                                            CPATTN_OPTION_PARAMS) {
  auto transport = group_transport(q, group_name, timeout_s);
  auto result =
      ring_forward(q, k, v, *transport,
                   make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, sinks));
  transport->finish();
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ring_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view group_name, int64_t layout,
    double timeout_s, const std::optional<at::Tensor>& doc_lengths,
    const std::optional<at::Tensor>& doc_prefix_lens, const std::optional<at::Tensor>& dlse,
    CPATTN_OPTION_PARAMS) {
  auto transport = group_transport(q, group_name, timeout_s);
  auto result = ring_backward(
      dout, q, k, v, out, lse, dlse, *transport,
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, std::nullopt));
  transport->finish();
  return result;
}

std::tuple<at::Tensor, at::Tensor> gathered_fwd(const at::Tensor& q, const at::Tensor& k_all,
                                                const at::Tensor& v_all, int64_t rank,
                                                int64_t layout,
                                                const std::optional<at::Tensor>& doc_lengths,
                                                const std::optional<at::Tensor>& doc_prefix_lens,
                                                const std::optional<at::Tensor>& sinks,
                                                CPATTN_OPTION_PARAMS) {
  return gathered_forward(
      q, k_all, v_all, rank,
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, sinks));
}

std::tuple<at::Tensor, at::Tensor> gathered_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all,
    const at::Tensor& out, const at::Tensor& lse, int64_t rank, int64_t layout,
    const std::optional<at::Tensor>& doc_lengths, const std::optional<at::Tensor>& doc_prefix_lens,
    const std::optional<at::Tensor>& dlse, CPATTN_OPTION_PARAMS) {
  return gathered_backward(
      dout, q, k_all, v_all, out, lse, dlse, rank,
      make_ring_options(CPATTN_OPTIONS, layout, doc_lengths, doc_prefix_lens, std::nullopt));
}

// Attention over packed documents held whole by this process (cpattn.attention_varlen): the
// gathered steps over one rank, whose one shard is the whole sequence (contiguous layout: no
// padding), k and v as they are.
std::tuple<at::Tensor, at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& doc_lengths,
                                              const std::optional<at::Tensor>& doc_prefix_lens,
                                              const std::optional<at::Tensor>& sinks,
                                              CPATTN_OPTION_PARAMS) {
  return gathered_forward(
      q, k.unsqueeze(0), v.unsqueeze(0), 0,
      make_ring_options(CPATTN_OPTIONS, static_cast<int64_t>(Layout::kContiguous), doc_lengths,
                        doc_prefix_lens, sinks));
}

// Its backward: dq, dk, dv in the inputs' dtypes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& doc_lengths,
    const std::optional<at::Tensor>& doc_prefix_lens, const std::optional<at::Tensor>& dlse,
    CPATTN_OPTION_PARAMS) {
  auto [dq, dkv] =
      gathered_backward(dout, q, k.unsqueeze(0), v.unsqueeze(0), out, lse, dlse, 0,
                        make_ring_options(CPATTN_OPTIONS, static_cast<int64_t>(Layout::kContiguous),
                                          doc_lengths, doc_prefix_lens, std::nullopt));
  const int64_t d = k.size(3);
  return {dq, dkv[0].narrow(-1, 0, d).to(k.scalar_type()).contiguous(),
          dkv[0].narrow(-1, d, dkv.size(-1) - d).to(v.scalar_type()).contiguous()};
}

// float64 (fwd compute, fwd wait, bwd compute, bwd wait) of the last ring calls on this thread.
at::Tensor ring_stats() {
  const RingStats* s = last_ring_stats();
  return at::tensor({s[0].compute_s, s[0].wait_s, s[1].compute_s, s[1].wait_s}, at::kDouble);
}

// Destroys the NCCL communicators the CUDA ring cached (one per process group and device);
// returns how many (0 in a CPU build).
int64_t destroy_communicators() {
#ifdef CPATTN_WITH_CUDA
  return comm::destroy_nccl_communicators();
#else
  return 0;
#endif
}

// Global positions (int64) of the local tokens of `rank`.
at::Tensor layout_positions(int64_t seqlen, int64_t world, int64_t rank, int64_t layout) {
  const Layout l = checked_layout(layout);
  check_rank(rank, world);
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

// (D, 3) int64: each document's padded length, its start in the padded packed sequence and in
// every rank's shard (cpattn/layout.h document_shard, the one home of the rule).
at::Tensor document_shards(at::IntArrayRef lengths, int64_t world, int64_t layout) {
  const Layout l = checked_layout(layout);
  TORCH_CHECK(world >= 1, "cpattn: world must be >= 1, got ", world);
  const int64_t docs = static_cast<int64_t>(lengths.size());
  at::Tensor result = at::empty({docs, 3}, at::kLong);
  int64_t* row = result.data_ptr<int64_t>();
  int64_t global_begin = 0;
  for (int64_t d = 0; d < docs; ++d, row += 3) {
    TORCH_CHECK(lengths[d] >= 0, "cpattn: document lengths must be >= 0, got ", lengths[d]);
    const DocumentShard doc = document_shard(l, lengths[d], world, 0, global_begin);
    row[0] = doc.padded;
    row[1] = doc.global_begin;
    row[2] = doc.local_begin;
    global_begin += doc.padded;
  }
  return result;
}

double group_timeout(c10::string_view group_name) {
  return comm::group_timeout_seconds(std::string(group_name));
}

}  // namespace

void impl_ring_ops(torch::Library& m) {
  m.impl("ring_fwd", &ring_fwd);
  m.impl("ring_bwd", &ring_bwd);
  m.impl("gathered_fwd", &gathered_fwd);
  m.impl("gathered_bwd", &gathered_bwd);
  m.impl("attention_varlen_fwd", &varlen_fwd);
  m.impl("attention_varlen_bwd", &varlen_bwd);
}

}  // namespace cpattn::ops

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn, CompositeExplicitAutograd, m) {
  m.impl("layout_positions", &cpattn::ops::layout_positions);
  m.impl("document_shards", &cpattn::ops::document_shards);
  m.impl("ring_stats", &cpattn::ops::ring_stats);
  m.impl("destroy_communicators", &cpattn::ops::destroy_communicators);
  m.impl("release_buffers", &cpattn::ops::release_buffers);
  m.impl("group_timeout", &cpattn::ops::group_timeout);
}
