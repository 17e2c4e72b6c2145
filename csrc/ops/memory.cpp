// Byte counts of the CPU allocator, for memory measurements (python/cpattn/memory.py): a thin
// wrapper around torch's CPU allocator that counts the bytes of every allocation made while
// counting is on, in any thread (kernels, the ring driver, gloo's receives into tensors), and the
// peak of those bytes still alive. RSS cannot give this at small shapes (glibc keeps freed heap
// memory; page-granular first touch). Installed on first use only; off, it adds one atomic load
// per allocation.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

namespace cpattn::ops {
namespace {

std::atomic<bool> counting{false};
// Each counting() block is an epoch: freeing an allocation of an earlier block (e.g. a buffer
// that gloo's thread releases late) does not uncount bytes of this one.
std::atomic<int64_t> epoch{0};
std::atomic<int64_t> current_bytes{0};
std::atomic<int64_t> peak_bytes{0};

// The allocation the wrapper hands out owns the inner one; freeing it uncounts its bytes.
struct Counted {
  c10::DataPtr inner;
  int64_t bytes;
  int64_t epoch;
};

void delete_counted(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  if (c->epoch == epoch.load()) current_bytes.fetch_sub(c->bytes);
  delete c;
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr p = inner_->allocate(n);
    if (!counting.load(std::memory_order_relaxed)) return p;
    void* data = p.get();
    const c10::Device device = p.device();
    auto* c = new Counted{std::move(p), static_cast<int64_t>(n), epoch.load()};
    const int64_t now = current_bytes.fetch_add(c->bytes) + c->bytes;
    int64_t peak = peak_bytes.load();
    while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
    }
    return {data, c, &delete_counted, device};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator wrapper(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&wrapper, /*priority=*/1);
  });
}

// Turns counting on (from 0 bytes: only allocations made from now on are counted) or off.
void memory_counting(bool on) {
  install_once();
  if (on) {
    epoch.fetch_add(1);
    current_bytes.store(0);
    peak_bytes.store(0);
  }
  counting.store(on);
}

// [bytes of counted allocations alive now, their peak since counting started or the last reset]
std::vector<int64_t> memory_counts() { return {current_bytes.load(), peak_bytes.load()}; }

void reset_memory_peak() { peak_bytes.store(current_bytes.load()); }

}  // namespace
}  // namespace cpattn::ops

TORCH_LIBRARY_FRAGMENT(cpattn, m) {
  m.def("memory_counting(bool on) -> ()", &cpattn::ops::memory_counting);
  m.def("memory_counts() -> int[]", &cpattn::ops::memory_counts);
  m.def("reset_memory_peak() -> ()", &cpattn::ops::reset_memory_peak);
}
