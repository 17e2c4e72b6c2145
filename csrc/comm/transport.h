// What the ring driver needs from a communication backend: a ring shift. Every rank sends one
// buffer to rank + 1 and receives one of the same size from rank - 1; the call only posts the
// exchange, so compute can run before wait(). Implementations: the torch process group (gloo on
// CPU), an in-process emulation of W ranks, and (with the CUDA backend) NCCL.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace cpattn::comm {

class PendingShift {
 public:
  virtual ~PendingShift() = default;
  // Blocks until both the send and the receive are done; throws on error or timeout.
  virtual void wait() = 0;
};

// Several pending shifts waited for together: every one is waited for, and the first error is
// rethrown after (so that no posted exchange is left behind).
class PendingShifts final : public PendingShift {
 public:
  explicit PendingShifts(std::vector<std::unique_ptr<PendingShift>> parts)
      : parts_(std::move(parts)) {}
  void wait() override {
    std::exception_ptr first;
    for (auto& p : parts_) {
      try {
        p->wait();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

 private:
  std::vector<std::unique_ptr<PendingShift>> parts_;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t world() const = 0;
  // Posts send -> rank + 1 and rank - 1 -> recv (same shape and dtype). `tag` tells successive
  // shifts apart. `send` must stay untouched and `recv` unread until wait() returns.
  virtual std::unique_ptr<PendingShift> shift(const at::Tensor& send, const at::Tensor& recv,
                                              int64_t tag) = 0;
  // The shifts of several buffer pairs at once (one step's K and V, say): sends[i] -> rank + 1,
  // rank - 1 -> recvs[i], with tags tag, tag + 1, ...; waited for together. NCCL posts them as
  // one group; the default posts them one by one.
  virtual std::unique_ptr<PendingShift> shift_all(const std::vector<at::Tensor>& sends,
                                                  const std::vector<at::Tensor>& recvs,
                                                  int64_t tag);
  // Called by an op after its last wait(), before it returns: raises if a shift has failed so far
  // (NCCL: wait() only orders the device, so an error can surface later; this does not wait for
  // the last shift, whose failure then raises at the next call). A no-op where wait() knows.
  virtual void finish() {}
};

inline std::unique_ptr<PendingShift> Transport::shift_all(const std::vector<at::Tensor>& sends,
                                                          const std::vector<at::Tensor>& recvs,
                                                          int64_t tag) {
  TORCH_CHECK(sends.size() == recvs.size(), "cpattn: shift_all needs one receive per send");
  std::vector<std::unique_ptr<PendingShift>> parts;
  for (size_t i = 0; i < sends.size(); ++i)
    parts.push_back(shift(sends[i], recvs[i], tag + static_cast<int64_t>(i)));
  return std::make_unique<PendingShifts>(std::move(parts));
}

// The process group registered under `group_name` (ProcessGroup.group_name in Python).
std::unique_ptr<Transport> make_process_group_transport(const std::string& group_name,
                                                        std::chrono::milliseconds timeout);

// The shortest timeout (seconds) of the backends of process group `group_name`; 0 where none
// reports its options.
double group_timeout_seconds(const std::string& group_name);

// W virtual ranks in one process, each driven from its own thread; shifts go through a shared
// mailbox (a copy per message).
class Mailbox;
std::shared_ptr<Mailbox> make_mailbox(int64_t world);
std::unique_ptr<Transport> make_emulated_transport(std::shared_ptr<Mailbox> mailbox, int64_t rank,
                                                   std::chrono::milliseconds timeout);

// CUDA builds only (csrc/comm/nccl_transport.cpp): NCCL send/recv on a dedicated stream, with a
// communicator per (group, device) bootstrapped through the process group `group_name` and cached
// until destroy_nccl_communicators(), which returns how many it destroyed.
std::unique_ptr<Transport> make_nccl_transport(const std::string& group_name, c10::Device device,
                                               std::chrono::milliseconds timeout);
int64_t destroy_nccl_communicators();

// CUDA builds only (csrc/comm/emulated_cuda_transport.cpp): W virtual ranks on one GPU, each with
// its own compute and comm streams (the thread's current stream while its transport lives),
// copies on the comm stream ordered by events. The mailbox captures the caller's current stream
// when made; after the rank threads finish, finish_emulated_cuda marks the outputs as used on it.
class CudaMailbox;
std::shared_ptr<CudaMailbox> make_cuda_mailbox(int64_t world, c10::Device device);
std::unique_ptr<Transport> make_emulated_cuda_transport(std::shared_ptr<CudaMailbox> mailbox,
                                                        int64_t rank,
                                                        std::chrono::milliseconds timeout);
void finish_emulated_cuda(CudaMailbox& mailbox, const std::vector<at::Tensor>& outputs);

// For benchmarks: plays `rank` of `world` but every shift is a local copy of the send buffer.
// The driver then does exactly the per-rank work of the real ring (the schedule depends on rank
// and step only) without communication; the values are not those of a real ring.
std::unique_ptr<Transport> make_loopback_transport(int64_t rank, int64_t world);

}  // namespace cpattn::comm
