// W ranks emulated on one GPU, with the stream and event protocol of the NCCL transport: each
// rank's thread computes on its own stream and receives on its own comm stream; a shift copies
// device to device on the receiver's comm stream, ordered by events only (no host sync):
//   shift:  ready event on the sender's compute stream (send written, its recv buffer free),
//           posted with the send buffer to the receiver's mailbox slot;
//   wait:   receiver's comm stream waits for the sender's ready event and its own, copies,
//           records `copied`; its compute stream waits for `copied` (received -> compute may
//           read), and `copied` goes back to the sender, whose compute stream waits for it
//           (consumed -> the sender may overwrite its send buffer).
// The host only blocks on the mailbox (with a timeout), like a rank waiting for a peer.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <array>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "comm/transport.h"

namespace cpattn::comm {

#define CPATTN_EMU_CUDA_CHECK(call)                                       \
  do {                                                                    \
    const cudaError_t e_ = (call);                                        \
    TORCH_CHECK(e_ == cudaSuccess, "cpattn: emulated CUDA ring: ", #call, \
                " failed: ", cudaGetErrorString(e_));                     \
  } while (0)

class CudaMailbox {
 public:
  enum Kind { kData = 0, kAck = 1 };
  struct Message {
    at::Tensor data;  // the sender's buffer (kData)
    cudaEvent_t event = nullptr;
  };

  CudaMailbox(int64_t world, c10::Device device)
      : world_(world), device_(device), caller_(c10::cuda::getCurrentCUDAStream(device.index())) {
    const c10::cuda::CUDAGuard guard(device_);
    start_ = new_event();
    CPATTN_EMU_CUDA_CHECK(cudaEventRecord(start_, caller_.stream()));
  }
  ~CudaMailbox() {
    const c10::cuda::CUDAGuard guard(device_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }

  int64_t world() const { return world_; }
  const c10::Device& device() const { return device_; }
  const c10::cuda::CUDAStream& caller() const { return caller_; }
  cudaEvent_t start() const { return start_; }

  // Events live as long as the mailbox: a peer may still wait on one after its owner finished.
  cudaEvent_t new_event() {
    cudaEvent_t e = nullptr;
    CPATTN_EMU_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::lock_guard<std::mutex> lock(mutex_);
    events_.push_back(e);
    return e;
  }

  void put(int64_t dst, int64_t tag, Kind kind, Message m) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_[{dst, tag, kind}] = std::move(m);
    }
    ready_.notify_all();
  }
  Message take(int64_t dst, int64_t tag, Kind kind, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto key = std::make_tuple(dst, tag, static_cast<int>(kind));
    const bool arrived = ready_.wait_for(lock, timeout, [&] { return slots_.count(key) > 0; });
    TORCH_CHECK(arrived, "cpattn: emulated CUDA rank ", dst, " timed out after ", timeout.count(),
                " ms waiting for the ring ", kind == kData ? "message" : "acknowledgement",
                " with tag ", tag);
    auto it = slots_.find(key);
    Message m = std::move(it->second);
    slots_.erase(it);
    return m;
  }

 private:
  int64_t world_;
  c10::Device device_;
  c10::cuda::CUDAStream caller_;
  cudaEvent_t start_ = nullptr;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::map<std::tuple<int64_t, int64_t, int>, Message> slots_;
  std::vector<cudaEvent_t> events_;
};

namespace {

class EmulatedCudaTransport;

class EmulatedCudaShift final : public PendingShift {
 public:
  EmulatedCudaShift(EmulatedCudaTransport* t, at::Tensor recv, int64_t tag, int slot)
      : t_(t), recv_(std::move(recv)), tag_(tag), slot_(slot) {}
  void wait() override;

 private:
  EmulatedCudaTransport* t_;
  at::Tensor recv_;
  int64_t tag_;
  int slot_;
};

class EmulatedCudaTransport final : public Transport {
 public:
  static constexpr int kSlots = 8;

  EmulatedCudaTransport(std::shared_ptr<CudaMailbox> box, int64_t rank,
                        std::chrono::milliseconds timeout)
      : box_(std::move(box)),
        rank_(rank),
        timeout_(timeout),
        compute_(c10::cuda::getStreamFromPool(false, box_->device().index())),
        comm_(c10::cuda::getStreamFromPool(false, box_->device().index())) {
    guard_.emplace(compute_);  // this thread's current device and stream, for the rank's work
    for (int i = 0; i < kSlots; ++i) {
      ready_[i] = box_->new_event();
      copied_[i] = box_->new_event();
    }
    end_ = box_->new_event();
    // The inputs were written on the caller's stream.
    CPATTN_EMU_CUDA_CHECK(cudaStreamWaitEvent(compute_.stream(), box_->start(), 0));
  }
  ~EmulatedCudaTransport() override {
    // The caller's stream continues after this rank's work.
    cudaEventRecord(end_, compute_.stream());
    cudaStreamWaitEvent(box_->caller().stream(), end_, 0);
  }

  int64_t rank() const override { return rank_; }
  int64_t world() const override { return box_->world(); }
  std::unique_ptr<PendingShift> shift(const at::Tensor& send, const at::Tensor& recv,
                                      int64_t tag) override {
    TORCH_CHECK(send.is_contiguous() && recv.is_contiguous() && send.nbytes() == recv.nbytes(),
                "cpattn: emulated CUDA ring buffers must be contiguous and of one size");
    const int slot = static_cast<int>(next_slot_++ % kSlots);
    CPATTN_EMU_CUDA_CHECK(cudaEventRecord(ready_[slot], compute_.stream()));
    box_->put((rank_ + 1) % world(), tag, CudaMailbox::kData, {send, ready_[slot]});
    return std::make_unique<EmulatedCudaShift>(this, recv, tag, slot);
  }

  void complete(const at::Tensor& recv, int64_t tag, int slot) {
    CudaMailbox::Message m = box_->take(rank_, tag, CudaMailbox::kData, timeout_);
    const cudaStream_t comm = comm_.stream(), compute = compute_.stream();
    CPATTN_EMU_CUDA_CHECK(cudaStreamWaitEvent(comm, m.event, 0));       // sender's data written
    CPATTN_EMU_CUDA_CHECK(cudaStreamWaitEvent(comm, ready_[slot], 0));  // our recv buffer free
    CPATTN_EMU_CUDA_CHECK(cudaMemcpyAsync(recv.data_ptr(), m.data.data_ptr(), recv.nbytes(),
                                          cudaMemcpyDeviceToDevice, comm));
    CPATTN_EMU_CUDA_CHECK(cudaEventRecord(copied_[slot], comm));
    box_->put((rank_ + world() - 1) % world(), tag, CudaMailbox::kAck,
              {at::Tensor(), copied_[slot]});
    CPATTN_EMU_CUDA_CHECK(cudaStreamWaitEvent(compute, copied_[slot], 0));  // received
    const CudaMailbox::Message ack = box_->take(rank_, tag, CudaMailbox::kAck, timeout_);
    CPATTN_EMU_CUDA_CHECK(cudaStreamWaitEvent(compute, ack.event, 0));  // our send consumed
  }

 private:
  std::shared_ptr<CudaMailbox> box_;
  int64_t rank_;
  std::chrono::milliseconds timeout_;
  c10::cuda::CUDAStream compute_, comm_;
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
  std::array<cudaEvent_t, kSlots> ready_{}, copied_{};
  cudaEvent_t end_ = nullptr;
  int64_t next_slot_ = 0;
};

void EmulatedCudaShift::wait() { t_->complete(recv_, tag_, slot_); }

}  // namespace

std::shared_ptr<CudaMailbox> make_cuda_mailbox(int64_t world, c10::Device device) {
  return std::make_shared<CudaMailbox>(world, device);
}

std::unique_ptr<Transport> make_emulated_cuda_transport(std::shared_ptr<CudaMailbox> mailbox,
                                                        int64_t rank,
                                                        std::chrono::milliseconds timeout) {
  return std::make_unique<EmulatedCudaTransport>(std::move(mailbox), rank, timeout);
}

void finish_emulated_cuda(CudaMailbox& mailbox, const std::vector<at::Tensor>& outputs) {
  // The outputs were allocated on the ranks' streams and are used on the caller's from now on.
  for (const at::Tensor& t : outputs)
    if (t.defined() && t.is_cuda()) t.record_stream(mailbox.caller());
}

}  // namespace cpattn::comm
