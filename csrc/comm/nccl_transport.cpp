// Ring shifts over NCCL, for CUDA tensors.
//
// One communicator per (process group, device), bootstrapped through the group itself: rank 0
// draws the unique id, the group broadcasts it (a uint8 tensor on the CPU when the group has a
// CPU backend such as gloo, else on the device), every rank joins with ncclCommInitRank. It uses
// the libnccl that torch loads (the nvidia-nccl wheel; see CMakeLists.txt). Communicators are
// cached per group and destroyed only by destroy_nccl_communicators() (cpattn.destroy_communicators
// in Python), never by a destructor at interpreter exit.
//
// A shift is one grouped ncclSend(rank + 1) / ncclRecv(rank - 1) on a dedicated comm stream:
//   ready event on the compute stream -> comm stream waits (send written, recv no longer read),
//   send/recv on the comm stream -> done event -> the compute stream waits in wait().
// Nothing blocks the host and nothing is allocated on the device, so the ring loop can be
// captured in a CUDA graph. A watchdog thread polls ncclCommGetAsyncError and the last shift's
// completion; a peer that fails, or a shift not done within the timeout, aborts the communicator
// and the next shift / wait raises (the ring's two receive buffers are the driver's; the events
// here order every access to them).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/transport.h"

namespace cpattn::comm {
namespace {

using Clock = std::chrono::steady_clock;

#define CPATTN_NCCL_CHECK(call, what)                                                      \
  do {                                                                                     \
    const ncclResult_t r_ = (call);                                                        \
    TORCH_CHECK(r_ == ncclSuccess, "cpattn: NCCL ", what, " failed: ", ncclGetErrorString(r_), \
                " (", ncclGetLastError(nullptr), ")");                                     \
  } while (0)

#define CPATTN_CUDA_CHECK(call, what)                                                      \
  do {                                                                                     \
    const cudaError_t e_ = (call);                                                         \
    TORCH_CHECK(e_ == cudaSuccess, "cpattn: ", what, " failed: ", cudaGetErrorString(e_)); \
  } while (0)

class NcclCommunicator : public std::enable_shared_from_this<NcclCommunicator> {
 public:
  static constexpr int kSlots = 8;  // event pairs in flight (the driver keeps at most two shifts)

  NcclCommunicator(std::string name, ncclComm_t comm, int rank, int world, c10::Device device)
      : name_(std::move(name)), comm_(comm), rank_(rank), world_(world), device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
    const c10::cuda::CUDAGuard guard(device_);
    for (int i = 0; i < kSlots; ++i) {
      CPATTN_CUDA_CHECK(cudaEventCreateWithFlags(&ready_[i], cudaEventDisableTiming), "event");
      CPATTN_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming), "event");
    }
    CPATTN_CUDA_CHECK(cudaEventCreateWithFlags(&watch_, cudaEventDisableTiming), "event");
    watchdog_ = std::thread([this] { watch(); });
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  const c10::Device& device() const { return device_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_ = t.count(); }

  // Raises the error the watchdog recorded, if any.
  void check() const {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(error_.empty(), error_);
  }
  bool failed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !error_.empty();
  }

  // Posts the shift on the comm stream behind the compute stream's work; returns its event slot.
  int post(const at::Tensor& send, const at::Tensor& recv, cudaStream_t compute) {
    check();
    const int slot = static_cast<int>(next_slot_++ % kSlots);
    const size_t bytes = send.nbytes();
    const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
    CPATTN_CUDA_CHECK(cudaEventRecord(ready_[slot], compute), "cudaEventRecord");
    CPATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), ready_[slot], 0), "cudaStreamWaitEvent");
    CPATTN_NCCL_CHECK(ncclGroupStart(), "ncclGroupStart");
    CPATTN_NCCL_CHECK(ncclSend(send.data_ptr(), bytes, ncclUint8, next, comm_, stream_.stream()),
                      "ncclSend");
    CPATTN_NCCL_CHECK(ncclRecv(recv.data_ptr(), bytes, ncclUint8, prev, comm_, stream_.stream()),
                      "ncclRecv");
    CPATTN_NCCL_CHECK(ncclGroupEnd(), "ncclGroupEnd");
    CPATTN_CUDA_CHECK(cudaEventRecord(done_[slot], stream_.stream()), "cudaEventRecord");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      CPATTN_CUDA_CHECK(cudaEventRecord(watch_, stream_.stream()), "cudaEventRecord");
      watch_since_ = Clock::now();
      watching_ = true;
    }
    wake_.notify_all();
    return slot;
  }

  // The compute stream waits (on the device) for the shift in `slot`.
  void wait(int slot, cudaStream_t compute) {
    check();
    CPATTN_CUDA_CHECK(cudaStreamWaitEvent(compute, done_[slot], 0), "cudaStreamWaitEvent");
  }

  // Explicit teardown (destroy_nccl_communicators); not from a destructor.
  void destroy() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    const c10::cuda::CUDAGuard guard(device_);
    if (failed()) {
      ncclCommAbort(comm_);
    } else {
      cudaStreamSynchronize(stream_.stream());
      ncclCommDestroy(comm_);
    }
    for (int i = 0; i < kSlots; ++i) {
      cudaEventDestroy(ready_[i]);
      cudaEventDestroy(done_[i]);
    }
    cudaEventDestroy(watch_);
  }

 private:
  // Watchdog: while a shift is outstanding, polls NCCL's async error and the shift's completion;
  // on an error or after the timeout it aborts the communicator (which also unblocks the GPU).
  void watch() {
    c10::cuda::CUDAGuard guard(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (!watching_ || !error_.empty()) {
        wake_.wait(lock);
        continue;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      const cudaError_t q = cudaEventQuery(watch_);
      const double waited =
          std::chrono::duration<double>(Clock::now() - watch_since_).count();
      if (async != ncclSuccess && async != ncclInProgress) {
        error_ = std::string("cpattn: NCCL ring shift failed on rank ") + std::to_string(rank_) +
                 " of group '" + name_ + "': " + ncclGetErrorString(async) +
                 "; the communicator was aborted (cpattn.destroy_communicators() then retry)";
      } else if (q == cudaSuccess) {
        watching_ = false;
      } else if (q != cudaErrorNotReady) {
        error_ = std::string("cpattn: CUDA error while waiting for an NCCL ring shift: ") +
                 cudaGetErrorString(q);
      } else if (waited * 1000.0 > static_cast<double>(timeout_ms_.load())) {
        error_ = "cpattn: NCCL ring shift on rank " + std::to_string(rank_) + " of group '" +
                 name_ + "' not done after " + std::to_string(waited) +
                 " s (a peer is stuck or gone); the communicator was aborted";
      }
      if (!error_.empty()) {
        ncclCommAbort(comm_);
        continue;
      }
      if (watching_) wake_.wait_for(lock, std::chrono::milliseconds(1));
    }
  }

  const std::string name_;
  ncclComm_t comm_;
  const int rank_, world_;
  const c10::Device device_;
  c10::cuda::CUDAStream stream_;
  std::array<cudaEvent_t, kSlots> ready_{}, done_{};
  int64_t next_slot_ = 0;
  std::atomic<int64_t> timeout_ms_{300000};

  mutable std::mutex mutex_;  // guards the fields below and the watch_ event
  std::condition_variable wake_;
  cudaEvent_t watch_ = nullptr;
  Clock::time_point watch_since_;
  bool watching_ = false;
  bool stop_ = false;
  std::string error_;
  std::thread watchdog_;
};

// Cached communicators; leaked on purpose: nothing NCCL runs from static destructors at exit.
std::mutex& cache_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<std::string, std::shared_ptr<NcclCommunicator>>& cache() {
  static auto* c = new std::map<std::string, std::shared_ptr<NcclCommunicator>>;
  return *c;
}

std::shared_ptr<NcclCommunicator> bootstrap(const std::string& group_name, c10::Device device,
                                            std::chrono::milliseconds timeout) {
  auto group = c10d::resolve_process_group(group_name);
  const int rank = group->getRank(), world = group->getSize();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) CPATTN_NCCL_CHECK(ncclGetUniqueId(&id), "ncclGetUniqueId");
  const bool cpu = group->hasBackendForDeviceType(c10::DeviceType::CPU);
  at::Tensor buf = at::empty({static_cast<int64_t>(sizeof(id))},
                             at::TensorOptions().dtype(at::kByte).device(cpu ? c10::Device(c10::kCPU)
                                                                             : device));
  if (rank == 0) {
    at::Tensor host = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
    std::memcpy(host.data_ptr(), &id, sizeof(id));
    buf.copy_(host);
  }
  std::vector<at::Tensor> tensors{buf};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  opts.timeout = timeout;
  auto work = group->broadcast(tensors, opts);
  TORCH_CHECK(work->wait(timeout), "cpattn: NCCL bootstrap: the unique id broadcast over group '",
              group_name, "' did not finish within ", timeout.count(), " ms");
  const at::Tensor host = buf.cpu();
  std::memcpy(&id, host.data_ptr(), sizeof(id));

  const c10::cuda::CUDAGuard guard(device);
  ncclComm_t comm = nullptr;
  CPATTN_NCCL_CHECK(ncclCommInitRank(&comm, world, id, rank), "ncclCommInitRank");
  return std::make_shared<NcclCommunicator>(group_name, comm, rank, world, device);
}

std::shared_ptr<NcclCommunicator> communicator(const std::string& group_name, c10::Device device,
                                               std::chrono::milliseconds timeout) {
  const std::string key = group_name + "@cuda:" + std::to_string(device.index());
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto it = cache().find(key);
  if (it != cache().end()) {
    // A communicator aborted after an error stays cached (its error raises) until destroyed.
    it->second->set_timeout(timeout);
    return it->second;
  }
  auto comm = bootstrap(group_name, device, timeout);
  comm->set_timeout(timeout);
  cache()[key] = comm;
  return comm;
}

class NcclShift final : public PendingShift {
 public:
  NcclShift(std::shared_ptr<NcclCommunicator> comm, int slot, cudaStream_t compute)
      : comm_(std::move(comm)), slot_(slot), compute_(compute) {}
  ~NcclShift() override {
    // Not waited (an exception unwound the driver): still order the compute stream after the
    // shift, so no later work touches the buffers while NCCL uses them.
    if (!waited_) {
      try {
        comm_->wait(slot_, compute_);
      } catch (...) {
      }
    }
  }
  void wait() override {
    waited_ = true;
    comm_->wait(slot_, compute_);
  }

 private:
  std::shared_ptr<NcclCommunicator> comm_;
  int slot_;
  cudaStream_t compute_;
  bool waited_ = false;
};

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(std::shared_ptr<NcclCommunicator> comm) : comm_(std::move(comm)) {}
  int64_t rank() const override { return comm_->rank(); }
  int64_t world() const override { return comm_->world(); }
  std::unique_ptr<PendingShift> shift(const at::Tensor& send, const at::Tensor& recv,
                                      int64_t tag) override {
    TORCH_CHECK(send.is_cuda() && recv.is_cuda() && send.device() == comm_->device() &&
                    recv.device() == comm_->device(),
                "cpattn: NCCL ring buffers must be on ", comm_->device(), ", got ", send.device(),
                " and ", recv.device());
    TORCH_CHECK(send.is_contiguous() && recv.is_contiguous() && send.nbytes() == recv.nbytes(),
                "cpattn: NCCL ring buffers must be contiguous and of one size, got ",
                send.sizes(), " and ", recv.sizes());
    const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(comm_->device().index()).stream();
    const int slot = comm_->post(send, recv, compute);
    return std::make_unique<NcclShift>(comm_, slot, compute);
  }

 private:
  std::shared_ptr<NcclCommunicator> comm_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const std::string& group_name, c10::Device device,
                                               std::chrono::milliseconds timeout) {
  TORCH_CHECK(device.is_cuda() && device.has_index(), "cpattn: NCCL transport needs a CUDA device "
              "with an index, got ", device);
  return std::make_unique<NcclTransport>(communicator(group_name, device, timeout));
}

int64_t destroy_nccl_communicators() {
  std::lock_guard<std::mutex> lock(cache_mutex());
  int64_t n = 0;
  for (auto& [key, comm] : cache()) {
    comm->destroy();
    ++n;
  }
  cache().clear();
  return n;
}

}  // namespace cpattn::comm
