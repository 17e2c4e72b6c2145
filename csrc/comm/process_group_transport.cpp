// Ring shifts over a torch.distributed process group (gloo on CPU; NCCL with
// CPATTN_RING_TRANSPORT=c10d), through c10d's point-to-point send / recv. On a backend that
// coalesces (NCCL) every send and receive of a shift is one group, as batch_isend_irecv does: two
// separate NCCL ops, a recv then a send to the same peer (W = 2), would deadlock, each rank's
// stream waiting in its recv. Work::wait with a timeout turns a stuck peer into an error.
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/transport.h"

namespace cpattn::comm {
namespace {

class ProcessGroupShift final : public PendingShift {
 public:
  ProcessGroupShift(c10::intrusive_ptr<c10d::Work> send, c10::intrusive_ptr<c10d::Work> recv,
                    std::chrono::milliseconds timeout)
      : send_(std::move(send)), recv_(std::move(recv)), timeout_(timeout) {}
  void wait() override {
    recv_->wait(timeout_);
    send_->wait(timeout_);
  }

 private:
  c10::intrusive_ptr<c10d::Work> send_, recv_;
  std::chrono::milliseconds timeout_;
};

// The one Work of a coalesced group of sends and receives.
class CoalescedShift final : public PendingShift {
 public:
  CoalescedShift(c10::intrusive_ptr<c10d::Work> work, std::chrono::milliseconds timeout)
      : work_(std::move(work)), timeout_(timeout) {}
  void wait() override { work_->wait(timeout_); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::chrono::milliseconds timeout_;
};

class ProcessGroupTransport final : public Transport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group,
                        std::chrono::milliseconds timeout)
      : group_(std::move(group)), timeout_(timeout) {}
  int64_t rank() const override { return group_->getRank(); }
  int64_t world() const override { return group_->getSize(); }
  std::unique_ptr<PendingShift> shift(const at::Tensor& send, const at::Tensor& recv,
                                      int64_t tag) override {
    if (coalesces(send)) return coalesced({send}, {recv});
    std::vector<at::Tensor> send_list{send}, recv_list{recv};
    // Post the receive first so that a rendezvous-style backend never waits on itself.
    auto r = group_->recv(recv_list, prev(), static_cast<int>(tag));
    auto s = group_->send(send_list, next(), static_cast<int>(tag));
    return std::make_unique<ProcessGroupShift>(std::move(s), std::move(r), timeout_);
  }
  std::unique_ptr<PendingShift> shift_all(const std::vector<at::Tensor>& sends,
                                          const std::vector<at::Tensor>& recvs,
                                          int64_t tag) override {
    if (!sends.empty() && coalesces(sends[0])) return coalesced(sends, recvs);
    return Transport::shift_all(sends, recvs, tag);
  }

 private:
  int next() const { return static_cast<int>((rank() + 1) % world()); }
  int prev() const { return static_cast<int>((rank() + world() - 1) % world()); }
  bool coalesces(const at::Tensor& t) const {
    return group_->getBackend(t.device().type())->supportsCoalescing();
  }
  std::unique_ptr<PendingShift> coalesced(const std::vector<at::Tensor>& sends,
                                          const std::vector<at::Tensor>& recvs) {
    const c10::DeviceType type = sends[0].device().type();
    group_->startCoalescing(type);
    for (size_t i = 0; i < sends.size(); ++i) {
      std::vector<at::Tensor> send_list{sends[i]}, recv_list{recvs[i]};
      group_->recv(recv_list, prev(), 0);
      group_->send(send_list, next(), 0);
    }
    return std::make_unique<CoalescedShift>(group_->endCoalescing(type), timeout_);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<Transport> make_process_group_transport(const std::string& group_name,
                                                        std::chrono::milliseconds timeout) {
  return std::make_unique<ProcessGroupTransport>(c10d::resolve_process_group(group_name), timeout);
}

// Read here rather than through Python's backend objects: a Python reference to a gloo backend or
// its options, kept alive by a traceback or a cache, would keep gloo's threads running past
// destroy_process_group and abort the interpreter's exit.
double group_timeout_seconds(const std::string& group_name) {
  const auto group = c10d::resolve_process_group(group_name);
  double shortest = 0;
  for (const c10::Device& device : group->getDeviceTypes()) {
    double seconds = 0;
    try {
      seconds = std::chrono::duration<double>(
                    group->getBackend(device.type())->getBackendOptions()->timeout)
                    .count();
    } catch (const c10::Error&) {  // a backend without options (a fake or custom one)
      continue;
    }
    if (seconds > 0 && (shortest == 0 || seconds < shortest)) shortest = seconds;
  }
  return shortest;
}

}  // namespace cpattn::comm
