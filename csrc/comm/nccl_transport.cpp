// Ring shifts over NCCL, for CUDA tensors.
//
// One communicator per (process group, device), bootstrapped through the group itself: rank 0
// draws the unique id, the group broadcasts it (a uint8 tensor on the CPU when the group has a
// CPU backend such as gloo, else on the device), every rank joins with ncclCommInitRankConfig.
// It uses the libnccl that torch loads (the nvidia-nccl wheel; see CMakeLists.txt).
// Communicators are cached per (group object, device) and destroyed only by
// destroy_nccl_communicators() (cpattn.destroy_communicators in Python), never by a destructor at
// interpreter exit. A group re-created under the same name (WORLD after destroy / init) is a new
// object and gets a new communicator; the stale one is aborted.
//
// The communicator is non-blocking (config.blocking = 0): no NCCL call blocks the host. A call
// that answers ncclInProgress is polled with ncclCommGetAsyncError until it settles, up to the
// timeout, so a peer that never joins (init) or never connects (the first send / recv) becomes an
// error instead of a hang. Every NCCL call on the communicator, the watchdog's included, holds
// one mutex, and the communicator is aborted exactly once (then never touched again).
//
// A shift is one grouped ncclSend(rank + 1) / ncclRecv(rank - 1) on a dedicated comm stream:
//   ready event on the compute stream -> comm stream waits (send written, recv no longer read),
//   send/recv on the comm stream -> done event -> the compute stream waits in wait().
// Nothing blocks the host inside the ring loop and nothing is allocated on the device. A watchdog
// thread polls ncclCommGetAsyncError and the last shift's completion; a peer that fails, or a
// shift not done within the timeout, aborts the communicator and the next call raises. finish(),
// called by an op after its last wait, raises if a shift has failed so far but does not wait for
// the last one: a failure found later raises at the next ring call (torch's NCCL watchdog
// reports asynchronous errors the same way), so the host can run ahead of the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
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
#include <vector>

#include "comm/transport.h"

namespace cpattn::comm {
namespace {

using Clock = std::chrono::steady_clock;

#define CPATTN_CUDA_CHECK(call, what)                                                      \
  do {                                                                                     \
    const cudaError_t e_ = (call);                                                         \
    TORCH_CHECK(e_ == cudaSuccess, "cpattn: ", what, " failed: ", cudaGetErrorString(e_)); \
  } while (0)

std::string nccl_error(ncclResult_t r) {
  return std::string(ncclGetErrorString(r)) + " (" + ncclGetLastError(nullptr) + ")";
}

// Polls a non-blocking communicator until the call that answered `r` settles: returns its final
// result, or ncclInProgress if it is still running at `deadline`. A posted send/recv group
// settles within microseconds, so the first 200 us spin (yielding the core) instead of sleeping:
// a 50 us sleep per poll would make every post cost that much host time. Only a slow settle
// (connecting to the peers at the first shift, init) sleeps between polls.
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, Clock::time_point deadline) {
  const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(200);
  while (r == ncclInProgress) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return ncclInProgress;
    if (now < spin_until)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

class NcclCommunicator : public std::enable_shared_from_this<NcclCommunicator> {
 public:
  static constexpr int kSlots = 8;  // event pairs in flight (the driver keeps at most two shifts)

  NcclCommunicator(std::string name, c10::weak_intrusive_ptr<c10d::ProcessGroup> group,
                   ncclComm_t comm, int rank, int world, c10::Device device)
      : name_(std::move(name)),
        group_(std::move(group)),
        comm_(comm),
        rank_(rank),
        world_(world),
        device_(device),
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
  // Whether `group` is the process group object this communicator was made for (a group
  // re-created under the same name is another object).
  bool made_for(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const {
    return group_.lock().get() == group.get();
  }

  // Posts the shift of every (sends[i] -> rank + 1, rank - 1 -> recvs[i]) pair as one NCCL group
  // on the comm stream behind the compute stream's work; returns its event slot.
  int post(const std::vector<at::Tensor>& sends, const std::vector<at::Tensor>& recvs,
           cudaStream_t compute) {
    std::lock_guard<std::mutex> lock(mutex_);
    raise_if_failed();
    const int slot = static_cast<int>(next_slot_++ % kSlots);
    const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
    CPATTN_CUDA_CHECK(cudaEventRecord(ready_[slot], compute), "cudaEventRecord");
    CPATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_.stream(), ready_[slot], 0),
                      "cudaStreamWaitEvent");
    const Clock::time_point deadline = Clock::now() + timeout();
    ncclResult_t r = settle(comm_, ncclGroupStart(), deadline);
    for (size_t i = 0; i < sends.size() && r == ncclSuccess; ++i) {
      const size_t bytes = sends[i].nbytes();
      r = settle(comm_,
                 ncclSend(sends[i].data_ptr(), bytes, ncclUint8, next, comm_, stream_.stream()),
                 deadline);
      if (r == ncclSuccess)
        r = settle(comm_,
                   ncclRecv(recvs[i].data_ptr(), bytes, ncclUint8, prev, comm_, stream_.stream()),
                   deadline);
    }
    // The group is closed whatever happened inside it. A non-blocking communicator answers
    // ncclInProgress while it connects to the peers (the first shift): polled up to the timeout.
    const ncclResult_t end = settle(comm_, ncclGroupEnd(), deadline);
    if (r == ncclSuccess) r = end;
    if (r != ncclSuccess)
      fail(r == ncclInProgress
               ? "posting a ring shift did not finish within the timeout (a peer is stuck, gone "
                 "or never joined)"
               : "posting a ring shift failed: " + nccl_error(r));
    CPATTN_CUDA_CHECK(cudaEventRecord(done_[slot], stream_.stream()), "cudaEventRecord");
    CPATTN_CUDA_CHECK(cudaEventRecord(watch_, stream_.stream()), "cudaEventRecord");
    watch_since_ = Clock::now();
    watching_ = true;
    wake_.notify_all();
    return slot;
  }

  // The compute stream waits (on the device) for the shift in `slot`.
  void wait(int slot, cudaStream_t compute) {
    std::lock_guard<std::mutex> lock(mutex_);
    raise_if_failed();
    CPATTN_CUDA_CHECK(cudaStreamWaitEvent(compute, done_[slot], 0), "cudaStreamWaitEvent");
  }

  // Raises if a shift has failed so far. Does not wait for the last one: the host runs ahead of
  // the device, and a failure the watchdog finds later raises at the next post (the next cpattn
  // ring call), as torch's NCCL watchdog reports an asynchronous error at the next collective.
  void check() {
    std::lock_guard<std::mutex> lock(mutex_);
    raise_if_failed();
  }

  // Explicit teardown (destroy_nccl_communicators); not from a destructor. `stale`: the group is
  // gone, so no collective teardown with its peers is attempted.
  void destroy(bool stale) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    const c10::cuda::CUDAGuard guard(device_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!aborted_) {
        // Destroyed cleanly only when healthy and the comm stream drains within the timeout (a
        // stuck peer would block a plain synchronize forever: the watchdog has stopped).
        const Clock::time_point deadline = Clock::now() + timeout();
        cudaError_t q = cudaErrorNotReady;
        while (!stale && error_.empty() && Clock::now() < deadline &&
               (q = cudaStreamQuery(stream_.stream())) == cudaErrorNotReady)
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        bool clean = !stale && error_.empty() && q == cudaSuccess;
        if (clean)  // finalize flushes the communicator's work; polled like every other call
          clean = settle(comm_, ncclCommFinalize(comm_), Clock::now() + timeout()) == ncclSuccess;
        if (clean)
          ncclCommDestroy(comm_);
        else
          abort();
      }
    }
    for (int i = 0; i < kSlots; ++i) {
      cudaEventDestroy(ready_[i]);
      cudaEventDestroy(done_[i]);
    }
    cudaEventDestroy(watch_);
  }

 private:
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(timeout_ms_.load());
  }

  // Callers hold mutex_.
  void raise_if_failed() const { TORCH_CHECK(error_.empty(), error_); }
  void abort() {
    if (aborted_) return;
    aborted_ = true;
    ncclCommAbort(comm_);  // also unblocks NCCL kernels waiting on the device
  }
  void record_error(const std::string& what) {
    if (error_.empty())
      error_ = "cpattn: NCCL ring on rank " + std::to_string(rank_) + " of group '" + name_ +
               "': " + what +
               "; the communicator was aborted (call "
               "cpattn.destroy_communicators() on every rank, then retry)";
    abort();
    watching_ = false;
  }
  [[noreturn]] void fail(const std::string& what) {
    record_error(what);
    TORCH_CHECK(false, error_);
  }

  // Watchdog: while a shift is outstanding, polls NCCL's async error and the shift's completion;
  // on an error or after the timeout it aborts the communicator (under the same mutex as every
  // other NCCL call, so never in the middle of one).
  void watch() {
    c10::cuda::CUDAGuard guard(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (!watching_) {
        wake_.wait(lock);
        continue;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      const cudaError_t q = cudaEventQuery(watch_);
      const auto waited = Clock::now() - watch_since_;
      if (async != ncclSuccess && async != ncclInProgress) {
        record_error("a ring shift failed: " + nccl_error(async));
      } else if (q == cudaSuccess) {
        watching_ = false;
      } else if (q != cudaErrorNotReady) {
        record_error(std::string("CUDA error while waiting for a ring shift: ") +
                     cudaGetErrorString(q));
      } else if (waited > timeout()) {
        record_error("a ring shift was not done after " +
                     std::to_string(std::chrono::duration<double>(waited).count()) +
                     " s (a peer is stuck or gone)");
      } else {
        wake_.wait_for(lock, std::chrono::milliseconds(1));
      }
    }
  }

  const std::string name_;
  const c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  ncclComm_t comm_;
  const int rank_, world_;
  const c10::Device device_;
  c10::cuda::CUDAStream stream_;
  std::array<cudaEvent_t, kSlots> ready_{}, done_{};
  std::atomic<int64_t> timeout_ms_{300000};

  // Guards every NCCL call on comm_ and the fields below (the watch_ event included).
  mutable std::mutex mutex_;
  std::condition_variable wake_;  // the watchdog: a shift was posted, or stop
  int64_t next_slot_ = 0;
  cudaEvent_t watch_ = nullptr;
  Clock::time_point watch_since_;
  bool watching_ = false;
  bool stop_ = false;
  bool aborted_ = false;
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

bool has_cpu_backend(const c10d::ProcessGroup& group) {
  for (const c10::Device& d : group.getDeviceTypes())  // torch 2.11 .. 2.14
    if (d.is_cpu()) return true;
  return false;
}

std::shared_ptr<NcclCommunicator> bootstrap(const std::string& group_name,
                                            const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                            c10::Device device, std::chrono::milliseconds timeout) {
  const int rank = group->getRank(), world = group->getSize();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    TORCH_CHECK(r == ncclSuccess, "cpattn: ncclGetUniqueId failed: ", nccl_error(r));
  }
  const bool cpu = has_cpu_backend(*group);
  at::Tensor buf =
      at::empty({static_cast<int64_t>(sizeof(id))},
                at::TensorOptions().dtype(at::kByte).device(cpu ? c10::Device(c10::kCPU) : device));
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
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init returns at once; polled below up to the timeout
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (comm != nullptr) r = settle(comm, r, Clock::now() + timeout);
  if (r != ncclSuccess) {
    if (comm != nullptr) ncclCommAbort(comm);
    TORCH_CHECK(false, "cpattn: NCCL communicator for group '", group_name, "' on rank ", rank,
                " of ", world, ": ",
                r == ncclInProgress
                    ? "ncclCommInitRankConfig did not finish within " +
                          std::to_string(timeout.count()) + " ms (a peer never joined)"
                    : "ncclCommInitRankConfig failed: " + nccl_error(r));
  }
  return std::make_shared<NcclCommunicator>(
      group_name, c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), comm, rank, world, device);
}

std::shared_ptr<NcclCommunicator> communicator(const std::string& group_name, c10::Device device,
                                               std::chrono::milliseconds timeout) {
  const std::string key = group_name + "@cuda:" + std::to_string(device.index());
  auto group = c10d::resolve_process_group(group_name);
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto it = cache().find(key);
  if (it != cache().end()) {
    if (it->second->made_for(group)) {
      // A communicator aborted after an error stays cached (its error raises) until destroyed.
      it->second->set_timeout(timeout);
      return it->second;
    }
    it->second->destroy(/*stale=*/true);  // the group was re-created under the same name
    cache().erase(it);
  }
  auto comm = bootstrap(group_name, group, device, timeout);
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
    return shift_all({send}, {recv}, tag);
  }
  // One NCCL group for every pair: one post, one event (NCCL orders the messages of one
  // communicator: no tag needed to tell them apart).
  std::unique_ptr<PendingShift> shift_all(const std::vector<at::Tensor>& sends,
                                          const std::vector<at::Tensor>& recvs,
                                          int64_t /*tag*/) override {
    for (size_t i = 0; i < sends.size(); ++i) {
      const at::Tensor &send = sends[i], &recv = recvs[i];
      TORCH_CHECK(send.is_cuda() && recv.is_cuda() && send.device() == comm_->device() &&
                      recv.device() == comm_->device(),
                  "cpattn: NCCL ring buffers must be on ", comm_->device(), ", got ", send.device(),
                  " and ", recv.device());
      TORCH_CHECK(send.is_contiguous() && recv.is_contiguous() && send.nbytes() == recv.nbytes(),
                  "cpattn: NCCL ring buffers must be contiguous and of one size, got ",
                  send.sizes(), " and ", recv.sizes());
    }
    const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(comm_->device().index()).stream();
    // A captured post would record the watchdog's event in the graph (where it can never be
    // queried) and abort the communicator: refused, on every rank alike (they capture alike).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TORCH_CHECK(cudaStreamIsCapturing(compute, &capture) == cudaSuccess &&
                    capture == cudaStreamCaptureStatusNone,
                "cpattn: the NCCL ring cannot be captured in a CUDA graph: run this layer "
                "eagerly (torch.compile's mode=\"reduce-overhead\" leaves cpattn's ring ops out "
                "of its graphs: they are tagged cudagraph_unsafe)");
    const int slot = comm_->post(sends, recvs, compute);
    return std::make_unique<NcclShift>(comm_, slot, compute);
  }
  void finish() override { comm_->check(); }

 private:
  std::shared_ptr<NcclCommunicator> comm_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const std::string& group_name, c10::Device device,
                                               std::chrono::milliseconds timeout) {
  TORCH_CHECK(device.is_cuda() && device.has_index(),
              "cpattn: NCCL transport needs a CUDA device "
              "with an index, got ",
              device);
  return std::make_unique<NcclTransport>(communicator(group_name, device, timeout));
}

int64_t destroy_nccl_communicators() {
  std::lock_guard<std::mutex> lock(cache_mutex());
  int64_t n = 0;
  for (auto& [key, comm] : cache()) {
    comm->destroy(/*stale=*/false);
    ++n;
  }
  cache().clear();
  return n;
}

}  // namespace cpattn::comm
