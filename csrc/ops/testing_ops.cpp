// Test- and benchmark-only ops, in their own library (libcpattn_testing, torch.ops.cpattn_testing,
// loaded by cpattn.testing only) so the shipped module holds only the real ops: the ring driver
// over W ranks emulated in this process, one transport shift, the ring's work timed without
// communication, the backward's accumulation step and the CPU backward's byte budget.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <exception>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/transport.h"
#include "cpu/kernels.h"
#include "ops/backend.h"
#include "ops/checks.h"
#include "ops/options.h"
#include "ops/ring.h"

namespace cpattn::ops {
namespace {

// Runs body(rank, transport) on W threads; body returns the tensors it hands back. On CUDA each
// virtual rank computes on its own stream (see make_emulated_cuda_transport).
template <typename Body>
void run_emulated(int64_t world, [[maybe_unused]] const at::Tensor& like, Body body) {
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

// The same driver over W ranks emulated in this process (one list entry per rank).
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> ring_fwd_emulated(
    at::TensorList q, at::TensorList k, at::TensorList v, int64_t layout, CPATTN_OPTION_PARAMS) {
  const int64_t world = static_cast<int64_t>(q.size());
  TORCH_CHECK(world >= 1 && k.size() == q.size() && v.size() == q.size(),
              "cpattn: emulated ring needs one q, k and v per rank, got ", q.size(), ", ", k.size(),
              ", ", v.size());
  const RingOptions o =
      make_ring_options(CPATTN_OPTIONS, layout, std::nullopt, std::nullopt, std::nullopt);
  std::vector<at::Tensor> outs(world), lses(world);
  run_emulated(world, q[0], [&](int64_t r, comm::Transport& t) {
    std::tie(outs[r], lses[r]) = ring_forward(q[r], k[r], v[r], t, o);
    return std::vector<at::Tensor>{outs[r], lses[r]};
  });
  return {outs, lses};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
ring_bwd_emulated(at::TensorList dout, at::TensorList q, at::TensorList k, at::TensorList v,
                  at::TensorList out, at::TensorList lse, int64_t layout, CPATTN_OPTION_PARAMS) {
  const int64_t world = static_cast<int64_t>(q.size());
  TORCH_CHECK(world >= 1 && k.size() == q.size() && v.size() == q.size() &&
                  dout.size() == q.size() && out.size() == q.size() && lse.size() == q.size(),
              "cpattn: emulated ring backward needs one of each tensor per rank");
  const RingOptions o =
      make_ring_options(CPATTN_OPTIONS, layout, std::nullopt, std::nullopt, std::nullopt);
  std::vector<at::Tensor> dq(world), dk(world), dv(world);
  run_emulated(world, q[0], [&](int64_t r, comm::Transport& t) {
    std::tie(dq[r], dk[r], dv[r]) =
        ring_backward(dout[r], q[r], k[r], v[r], out[r], lse[r], std::nullopt, t, o);
    return std::vector<at::Tensor>{dq[r], dk[r], dv[r]};
  });
  return {dq, dk, dv};
}

at::Tensor ring_loopback_timing(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& dout, int64_t rank, int64_t world, int64_t layout,
                                CPATTN_OPTION_PARAMS) {
  check_rank(rank, world);
  auto transport = comm::make_loopback_transport(rank, world);
  const RingOptions o =
      make_ring_options(CPATTN_OPTIONS, layout, std::nullopt, std::nullopt, std::nullopt);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto [out, lse] = ring_forward(q, k, v, *transport, o);
  const auto t1 = Clock::now();
  ring_backward(dout, q, k, v, out, lse, std::nullopt, *transport, o);
  const std::chrono::duration<double> fwd = t1 - t0, bwd = Clock::now() - t1;
  return at::tensor({fwd.count(), bwd.count()}, at::kDouble);
}

// One ring shift of `send` (to rank + 1, from rank - 1) through the transport the ring ops use
// for its device: a test of the transport itself (at W = 1, NCCL send / recv to self).
at::Tensor ring_shift(const at::Tensor& send, c10::string_view group_name, double timeout_s) {
  auto transport = group_transport(send, group_name, timeout_s);
  const at::Tensor src = send.contiguous();
  at::Tensor recv = at::empty_like(src);
  transport->shift(src, recv, 0)->wait();
  transport->finish();
  return recv;
}

// Host microseconds per post and per wait of `shifts` ring shifts of `send` through the transport
// the ring ops use (GPU: the cost of posting to NCCL; at W = 1 a send / recv to self). A CPU
// tensor of two doubles.
at::Tensor ring_post_timing(const at::Tensor& send, c10::string_view group_name, int64_t shifts,
                            double timeout_s) {
  TORCH_CHECK(shifts >= 1, "cpattn: ring_post_timing needs shifts >= 1, got ", shifts);
  using Clock = std::chrono::steady_clock;
  auto transport = group_transport(send, group_name, timeout_s);
  const at::Tensor src = send.contiguous();
  at::Tensor recv = at::empty_like(src);
  double post_s = 0, wait_s = 0;
  for (int64_t i = 0; i < shifts; ++i) {
    const auto t0 = Clock::now();
    auto pending = transport->shift(src, recv, i);
    const auto t1 = Clock::now();
    pending->wait();
    post_s += std::chrono::duration<double>(t1 - t0).count();
    wait_s += std::chrono::duration<double>(Clock::now() - t1).count();
  }
  transport->finish();
  at::Tensor result = at::empty({2}, at::kDouble);
  result[0] = post_s * 1e6 / static_cast<double>(shifts);
  result[1] = wait_s * 1e6 / static_cast<double>(shifts);
  return result;
}

// The ring's sub-problem backward, adding into given gradients (ops.h attention_bwd_add_scored),
// bottom-right aligned like cpattn.attention, no score options.
void attention_bwd_add(const at::Tensor& dq, const std::optional<at::Tensor>& dq_low,
                       const at::Tensor& dk, const at::Tensor& dv, const at::Tensor& dout,
                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& out, const at::Tensor& lse, double softmax_scale,
                       bool causal) {
  const Mask m =
      bottom_right_mask(causal, normalized_window(-1), normalized_window(-1), q.size(1), k.size(1));
  attention_bwd_add_scored(dq, dk, dv, dout, q, k, v, out, lse, softmax_scale, m, ScoreArgs{},
                           std::nullopt, dq_low);
}

// The CPU kernels' calls per (path, operands, pass) since the process started (kernels.h
// path_calls): which path ran.
std::vector<int64_t> cpu_kernel_calls() { return cpu::path_calls(); }
int64_t cpu_amx_tasks() { return cpu::amx_tasks(); }
int64_t checks_run() { return attention_checks_run(); }

}  // namespace

void impl_no_tensor_testing_ops(torch::Library& m) {
  m.impl("set_cpu_backward_group_bytes", &exchange_cpu_backward_group_bytes);
  m.impl("cpu_kernel_calls", &cpu_kernel_calls);
  m.impl("cpu_amx_tasks", &cpu_amx_tasks);
  m.impl("attention_checks_run", &checks_run);
}

void impl_testing_ops(torch::Library& m) {
  m.impl("ring_fwd_emulated", &ring_fwd_emulated);
  m.impl("ring_bwd_emulated", &ring_bwd_emulated);
  m.impl("ring_shift", &ring_shift);
  m.impl("ring_post_timing", &ring_post_timing);
  m.impl("ring_loopback_timing", &ring_loopback_timing);
  m.impl("attention_bwd_add", &attention_bwd_add);
  m.impl("round_split_", &round_split_);
}

}  // namespace cpattn::ops

TORCH_LIBRARY(cpattn_testing, m) {
  using cpattn::ops::with_options;
  m.def(with_options("ring_fwd_emulated(Tensor[] q, Tensor[] k, Tensor[] v, int layout",
                     "(Tensor[] out, Tensor[] lse)"));
  m.def(with_options(
      "ring_bwd_emulated(Tensor[] dout, Tensor[] q, Tensor[] k, Tensor[] v, Tensor[] out, "
      "Tensor[] lse, int layout",
      "(Tensor[] dq, Tensor[] dk, Tensor[] dv)"));
  // One shift of `send` over the group (NCCL for CUDA tensors).
  m.def("ring_shift(Tensor send, str group_name, float timeout_s) -> Tensor");
  // Host microseconds per post and per wait over `shifts` shifts: (post_us, wait_us), CPU.
  m.def("ring_post_timing(Tensor send, str group_name, int shifts, float timeout_s) -> Tensor");
  // The CPU backward's byte budget per kernel call; returns the previous one.
  m.def("set_cpu_backward_group_bytes(int bytes) -> int");
  // (forward s, backward s) of one rank's ring work without communication.
  m.def(with_options(
      "ring_loopback_timing(Tensor q, Tensor k, Tensor v, Tensor dout, int rank, int world, "
      "int layout",
      "Tensor"));
  // The backward adding into dq (fp32, or bf16 split sums with int16 dq_low), dk, dv (fp32), and
  // the rounding of split sums: the ring's accumulation step.
  m.def(
      "attention_bwd_add(Tensor(a!) dq, Tensor(b!)? dq_low, Tensor(c!) dk, Tensor(d!) dv, "
      "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
      "bool causal) -> ()");
  m.def("round_split_(Tensor(a!) high, Tensor low) -> ()");
  // CPU kernel calls per (path row brgemm / micro, operands fp32 / bf16, pass fwd / bwd),
  // flattened in that order (cpu/kernels.h path_calls), and parallel tasks that used AMX tiles.
  m.def("cpu_kernel_calls() -> int[]");
  m.def("cpu_amx_tasks() -> int");
  // How many local attention calls' arguments have been checked (ops.h attention_checks_run):
  // the ring checks once per call, not once per sub-problem.
  m.def("attention_checks_run() -> int");
}

// No tensor argument to dispatch on.
TORCH_LIBRARY_IMPL(cpattn_testing, CompositeExplicitAutograd, m) {
  cpattn::ops::impl_no_tensor_testing_ops(m);
}

TORCH_LIBRARY_IMPL(cpattn_testing, CPU, m) { cpattn::ops::impl_testing_ops(m); }
#ifdef CPATTN_WITH_CUDA
TORCH_LIBRARY_IMPL(cpattn_testing, CUDA, m) { cpattn::ops::impl_testing_ops(m); }
#endif
