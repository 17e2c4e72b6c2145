// In-process emulation of W ranks: rank r's shift copies its buffer into a mailbox slot keyed by
// (destination, tag); the destination's wait() takes it from there. Sends never block, like a
// buffered network; receives wait with a timeout.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <utility>

#include "comm/transport.h"

namespace cpattn::comm {

class Mailbox {
 public:
  explicit Mailbox(int64_t world) : world_(world) {}
  int64_t world() const { return world_; }

  void put(int64_t dst, int64_t tag, at::Tensor message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_[{dst, tag}] = std::move(message);
    }
    ready_.notify_all();
  }
  at::Tensor take(int64_t dst, int64_t tag, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool arrived = ready_.wait_for(lock, timeout, [&] { return slots_.count({dst, tag}); });
    TORCH_CHECK(arrived, "cpattn: emulated rank ", dst, " timed out after ", timeout.count(),
                " ms waiting for the ring message with tag ", tag);
    auto it = slots_.find({dst, tag});
    at::Tensor message = std::move(it->second);
    slots_.erase(it);
    return message;
  }

 private:
  int64_t world_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::map<std::pair<int64_t, int64_t>, at::Tensor> slots_;
};

namespace {

class EmulatedShift final : public PendingShift {
 public:
  EmulatedShift(std::shared_ptr<Mailbox> mailbox, int64_t rank, int64_t tag, at::Tensor recv,
                std::chrono::milliseconds timeout)
      : mailbox_(std::move(mailbox)),
        rank_(rank),
        tag_(tag),
        recv_(std::move(recv)),
        timeout_(timeout) {}
  void wait() override { recv_.copy_(mailbox_->take(rank_, tag_, timeout_)); }

 private:
  std::shared_ptr<Mailbox> mailbox_;
  int64_t rank_, tag_;
  at::Tensor recv_;
  std::chrono::milliseconds timeout_;
};

class EmulatedTransport final : public Transport {
 public:
  EmulatedTransport(std::shared_ptr<Mailbox> mailbox, int64_t rank,
                    std::chrono::milliseconds timeout)
      : mailbox_(std::move(mailbox)), rank_(rank), timeout_(timeout) {}
  int64_t rank() const override { return rank_; }
  int64_t world() const override { return mailbox_->world(); }
  std::unique_ptr<PendingShift> shift(const at::Tensor& send, const at::Tensor& recv,
                                      int64_t tag) override {
    mailbox_->put((rank_ + 1) % world(), tag, send.clone());
    return std::make_unique<EmulatedShift>(mailbox_, rank_, tag, recv, timeout_);
  }

 private:
  std::shared_ptr<Mailbox> mailbox_;
  int64_t rank_;
  std::chrono::milliseconds timeout_;
};

class CopiedShift final : public PendingShift {
 public:
  void wait() override {}
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(int64_t rank, int64_t world) : rank_(rank), world_(world) {}
  int64_t rank() const override { return rank_; }
  int64_t world() const override { return world_; }
  // A copy to itself: nothing else is in flight, so no tag to tell messages apart.
  std::unique_ptr<PendingShift> shift(const at::Tensor& send, const at::Tensor& recv,
                                      int64_t /*tag*/) override {
    recv.copy_(send);
    return std::make_unique<CopiedShift>();
  }

 private:
  int64_t rank_, world_;
};

}  // namespace

std::unique_ptr<Transport> make_loopback_transport(int64_t rank, int64_t world) {
  return std::make_unique<LoopbackTransport>(rank, world);
}

std::shared_ptr<Mailbox> make_mailbox(int64_t world) { return std::make_shared<Mailbox>(world); }

std::unique_ptr<Transport> make_emulated_transport(std::shared_ptr<Mailbox> mailbox, int64_t rank,
                                                   std::chrono::milliseconds timeout) {
  return std::make_unique<EmulatedTransport>(std::move(mailbox), rank, timeout);
}

}  // namespace cpattn::comm
