// Byte counts of the CPU allocator, for memory measurements (python/cpattn/memory.py): a thin
// wrapper around torch's CPU allocator that counts the bytes of every allocation made while
// counting is on, in any thread (kernels, the ring driver, gloo's receives into tensors), and the
// peak of those bytes still alive. RSS cannot give this at small shapes (glibc keeps freed heap
// memory; page-granular first touch). Installed on first use only (a process that never counts
// keeps torch's allocator as it is); once installed, a free looks its pointer up in a table.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace cpattn::ops {
namespace {

std::atomic<bool> counting{false};
// Each counting() block is an epoch: freeing an allocation of an earlier block (e.g. a buffer
// that gloo's thread releases late) does not uncount bytes of this one.
std::atomic<int64_t> epoch{0};
std::atomic<int64_t> current_bytes{0};
std::atomic<int64_t> peak_bytes{0};

// Counted allocations by data pointer: the wrapper's DataPtr has the data as its context (as
// torch's CPU allocator does), so that raw_allocate / raw_deallocate work through it too.
struct Counted {
  c10::DataPtr inner;
  int64_t bytes;
  int64_t epoch;
};
std::mutex table_mutex;
std::unordered_map<void*, Counted> counted;
c10::Allocator* inner_allocator = nullptr;

void delete_counted(void* data) {
  c10::DataPtr inner;  // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto it = counted.find(data);
    if (it == counted.end()) {  // made while counting was off, freed through raw_deallocate
      inner_allocator->raw_deleter()(data);
      return;
    }
    if (it->second.epoch == epoch.load()) current_bytes.fetch_sub(it->second.bytes);
    inner = std::move(it->second.inner);
    counted.erase(it);
  }
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr p = inner_allocator->allocate(n);
    void* data = p.get();
    const c10::Device device = p.device();
    // Every DataPtr of this allocator carries delete_counted (raw_deleter's contract); an
    // uncounted one is freed by torch's CPU allocator's own raw deleter.
    TORCH_INTERNAL_ASSERT(data == p.get_context() && inner_allocator->raw_deleter());
    if (!counting.load(std::memory_order_relaxed) || data == nullptr) {
      p.release_context();
      return {data, data, &delete_counted, device};
    }
    const int64_t bytes = static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(table_mutex);
      counted.emplace(data, Counted{std::move(p), bytes, epoch.load()});
    }
    const int64_t now = current_bytes.fetch_add(bytes) + bytes;
    int64_t peak = peak_bytes.load();
    while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &delete_counted, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    inner_allocator = c10::GetCPUAllocator();
    static CountingAllocator wrapper;
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
