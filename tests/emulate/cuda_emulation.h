// Host emulation of the CUDA subset the attention kernels use, so that the kernels themselves
// (csrc/cuda/*.cuh, compiled with CPATTN_CUDA_EMULATE) run on a CPU in tests.
//
// Every CUDA thread of a block is a fiber (ucontext) on one OS thread; fibers switch only at
// __syncthreads and at warp collectives (ldmatrix, mma.sync, shfl), which a warp barrier makes
// collective: each lane publishes its operands, and once all 32 have arrived each lane computes
// its result from the PTX ISA's definition of the instruction (fragment tables of
// mma.m16n8k16, ldmatrix's row / column distribution). The scheduler resumes runnable fibers in
// a random order, and each cp.async lands either at once or only at the next cp.async.wait_group
// (at random), so a missing barrier or wait shows up as wrong results. Shared memory starts each
// block as NaN bytes and every shared / cp.async access is bounds- and alignment-checked.
//
// Not emulated: timing, memory-model subtleties beyond the above, and anything the kernels do not
// use. One block runs at a time (blocks only interact through atomicAdd, which is exact here).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// ---- CUDA keywords and built-in variables --------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n)
#define __shared__

struct EmuDim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace cpattn::cuda {
constexpr int kEmuSmemBytes = 256 * 1024;
// The kernels' `extern __shared__ unsigned char smem_raw[]` binds to this.
alignas(128) unsigned char smem_raw[kEmuSmemBytes];
}  // namespace cpattn::cuda

namespace emu {

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error("emu: " + what); }

struct Barrier {
  int count = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

struct PendingCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  unsigned tid = 0;
  bool done = false;
  Barrier* wait = nullptr;
  uint64_t wait_gen = 0;
  std::vector<PendingCopy> pending;  // cp.async copies not landed yet
};

struct Warp {
  Barrier bar;
  uint32_t buf[2][32][8];  // operands of the current collective, double-buffered by generation
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier bar;
  ucontext_t sched;
  int current = -1;
  std::function<void()> body;
  std::exception_ptr error;
  int smem_bytes = 0;
};

struct State {
  Block* block = nullptr;
  EmuDim3 block_idx, grid_dim, block_dim;
  std::mt19937_64 rng{12345};
  int64_t collectives = 0;
};
inline State& state() {
  static State s;
  return s;
}

inline Fiber& self() { return state().block->fibers[state().block->current]; }
inline EmuDim3 thread_idx() { return {self().tid, 0, 0}; }
inline int lane() { return static_cast<int>(self().tid & 31); }
inline Warp& my_warp() { return state().block->warps[self().tid >> 5]; }

inline void yield() {
  Block& b = *state().block;
  swapcontext(&b.fibers[b.current].ctx, &b.sched);
}

inline void barrier_wait(Barrier& bar) {
  const uint64_t gen = bar.generation;
  if (++bar.arrived == bar.count) {
    bar.arrived = 0;
    ++bar.generation;
    return;
  }
  Fiber& f = self();
  f.wait = &bar;
  f.wait_gen = gen;
  yield();
}

// Each lane publishes n words; returns all 32 lanes' words once every lane has published.
inline const uint32_t (&exchange(const uint32_t* mine, int n))[32][8] {
  Warp& w = my_warp();
  const int slot = static_cast<int>(w.bar.generation & 1);
  std::memcpy(w.buf[slot][lane()], mine, 4 * n);
  ++state().collectives;
  barrier_wait(w.bar);
  return w.buf[slot];
}

inline void check_smem(uint32_t addr, int bytes, int align, const char* what) {
  const int limit = state().block->smem_bytes;
  if (addr % align != 0 || static_cast<int64_t>(addr) + bytes > limit) {
    std::ostringstream os;
    os << what << ": shared address " << addr << " (+" << bytes << ") misaligned or beyond the "
       << limit << " bytes of the launch (thread " << self().tid << ")";
    fail(os.str());
  }
}

inline void land(const PendingCopy& c) {
  if (c.valid)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
}

inline void trampoline() {
  Block& b = *state().block;
  try {
    b.body();
  } catch (...) {
    if (!b.error) b.error = std::current_exception();
  }
  b.fibers[b.current].done = true;
}

// Runs body on `threads` fibers as one thread block.
inline void run_block(int threads, int smem_bytes, const std::function<void()>& body) {
  if (threads % 32 != 0) fail("block size must be a multiple of 32");
  if (smem_bytes > cpattn::cuda::kEmuSmemBytes) fail("too much shared memory");
  constexpr size_t kStack = 128 * 1024;
  Block b;
  b.body = body;
  b.smem_bytes = smem_bytes;
  b.bar.count = threads;
  b.warps.resize(threads / 32);
  for (Warp& w : b.warps) w.bar.count = 32;
  b.fibers.resize(threads);
  std::memset(cpattn::cuda::smem_raw, 0xff, smem_bytes);  // NaN bytes: unwritten data shows
  state().block = &b;
  for (int i = 0; i < threads; ++i) {
    Fiber& f = b.fibers[i];
    f.tid = static_cast<unsigned>(i);
    f.stack.reset(new char[kStack]);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &b.sched;
    makecontext(&f.ctx, trampoline, 0);
  }
  std::vector<int> order(threads);
  for (int i = 0; i < threads; ++i) order[i] = i;
  for (;;) {
    std::shuffle(order.begin(), order.end(), state().rng);
    bool alive = false, progressed = false;
    for (int i : order) {
      Fiber& f = b.fibers[i];
      if (f.done) continue;
      alive = true;
      if (f.wait && f.wait->generation == f.wait_gen) continue;
      f.wait = nullptr;
      b.current = i;
      swapcontext(&b.sched, &f.ctx);
      progressed = true;
      if (b.error) break;
    }
    if (b.error || !alive) break;
    if (!progressed) {
      state().block = nullptr;
      fail("deadlock: every live thread waits at a barrier that cannot complete");
    }
  }
  state().block = nullptr;
  if (b.error) std::rethrow_exception(b.error);
}

// kernel<<<grid, threads, smem>>>: blocks one after another.
inline void launch(EmuDim3 grid, int threads, int smem_bytes, const std::function<void()>& body) {
  State& s = state();
  s.grid_dim = grid;
  s.block_dim = {static_cast<unsigned>(threads), 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        s.block_idx = {x, y, z};
        run_block(threads, smem_bytes, body);
      }
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::state().block_idx)
#define gridDim (::emu::state().grid_dim)
#define blockDim (::emu::state().block_dim)

inline void __syncthreads() { emu::barrier_wait(emu::state().block->bar); }

// ---- 16-bit float types (bit patterns; round to nearest even) ------------------------------
struct __nv_bfloat16 {
  uint16_t x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half {
  uint16_t x;
};
struct __half2 {
  __half x, y;
};
struct float2 {
  float x, y;
};
inline float2 make_float2(float a, float b) { return {a, b}; }

inline float __bfloat162float(__nv_bfloat16 h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h.x) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return {0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float __half2float(__half h) { return static_cast<float>(std::bit_cast<_Float16>(h.x)); }
inline __half __float2half_rn(float f) {
  return {std::bit_cast<uint16_t>(static_cast<_Float16>(f))};
}
inline __half2 __floats2half2_rn(float a, float b) {
  return {__float2half_rn(a), __float2half_rn(b)};
}
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline float atomicAdd(float* p, float v) {  // one OS thread: exact, any order
  const float old = *p;
  *p = old + v;
  return old;
}

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int lane_mask) {
  const uint32_t mine = std::bit_cast<uint32_t>(v);
  const auto& all = emu::exchange(&mine, 1);
  const uint32_t other = all[emu::lane() ^ lane_mask][0];
  return std::bit_cast<float>(other);
}

// ---- the PTX wrappers of csrc/cuda/ptx.cuh -------------------------------------------------
namespace cpattn::cuda {

inline uint32_t smem_u32(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < smem_raw || c >= smem_raw + kEmuSmemBytes) emu::fail("smem_u32 of a non-shared pointer");
  return static_cast<uint32_t>(c - smem_raw);
}

inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  emu::check_smem(smem_u32(smem_dst), 16, 16, "cp.async destination");
  if (valid && reinterpret_cast<uintptr_t>(gmem_src) % 16 != 0)
    emu::fail("cp.async: misaligned source");
  const emu::PendingCopy c{smem_dst, gmem_src, valid};
  if (emu::state().rng() & 1)
    emu::land(c);
  else
    emu::self().pending.push_back(c);
}
inline void cp_async_commit() {}
template <int kPending>
inline void cp_async_wait() {
  static_assert(kPending == 0, "the emulation lands every pending copy");
  for (const emu::PendingCopy& c : emu::self().pending) emu::land(c);
  emu::self().pending.clear();
}

inline uint32_t emu_ld16(uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, smem_raw + addr, 2);
  return v;
}

inline void emu_ldmatrix(uint32_t (&r)[4], uint32_t addr, bool trans) {
  emu::check_smem(addr, 16, 16, "ldmatrix row");
  const auto& all = emu::exchange(&addr, 1);
  const int l = emu::lane();
  for (int i = 0; i < 4; ++i) {
    if (!trans) {
      const uint32_t row = all[8 * i + l / 4][0];
      r[i] = emu_ld16(row + 4 * (l % 4)) | (emu_ld16(row + 4 * (l % 4) + 2) << 16);
    } else {
      const uint32_t r0 = all[8 * i + 2 * (l % 4)][0], r1 = all[8 * i + 2 * (l % 4) + 1][0];
      r[i] = emu_ld16(r0 + 2 * (l / 4)) | (emu_ld16(r1 + 2 * (l / 4)) << 16);
    }
  }
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row) { emu_ldmatrix(r, smem_row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_row) {
  emu_ldmatrix(r, smem_row, true);
}

template <typename Elem>
inline float emu_decode(uint32_t bits16);
template <>
inline float emu_decode<__nv_bfloat16>(uint32_t b) {
  return __bfloat162float({static_cast<uint16_t>(b)});
}
template <>
inline float emu_decode<__half>(uint32_t b) {
  return __half2float({static_cast<uint16_t>(b)});
}

// d += A B, A 16x16 and B 16x8 gathered from the warp's registers by the PTX fragment tables.
template <typename Elem>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const auto& all = emu::exchange(mine, 6);
  const int l = emu::lane(), g = l / 4, t = l % 4;
  auto half_of = [](uint32_t reg, int k) { return (reg >> (16 * (k % 2))) & 0xffffu; };
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double acc = d[e];
    for (int k = 0; k < 16; ++k) {
      const uint32_t a_reg = all[4 * (row % 8) + (k % 8) / 2][(row / 8) + 2 * (k / 8)];
      const uint32_t b_reg = all[4 * col + (k % 8) / 2][4 + k / 8];
      acc += static_cast<double>(emu_decode<Elem>(half_of(a_reg, k))) *
             static_cast<double>(emu_decode<Elem>(half_of(b_reg, k)));
    }
    d[e] = static_cast<float>(acc);
  }
}

inline float fast_exp2(float x) { return std::exp2(x); }

}  // namespace cpattn::cuda
