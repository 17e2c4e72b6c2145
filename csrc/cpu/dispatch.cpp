#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpattn/env.h"
#include "cpu/kernels.h"
#include "cpu/onednn_gemm.h"

namespace cpattn::cpu {
namespace {

enum class Isa { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

struct IsaChoice {
  Isa isa = Isa::kGeneric;
  bool lowered = false;  // by CPATTN_CPU_ISA
};

IsaChoice detect() {
  Isa best = Isa::kGeneric;
#if defined(__x86_64__)
  __builtin_cpu_init();
  // every variant above generic is built with -mavx2 -mfma -mf16c
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    best = Isa::kAvx2;
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    best = Isa::kAvx512;
  if (best == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16")) best = Isa::kAvx512Bf16;
#endif
  // CPATTN_CPU_ISA can only lower the choice: asking for more than the CPU has would crash.
  if (const char* want = env::cpu_isa()) {
    Isa asked = best;
    if (!std::strcmp(want, "generic")) asked = Isa::kGeneric;
    if (!std::strcmp(want, "avx2")) asked = Isa::kAvx2;
    if (!std::strcmp(want, "avx512")) asked = Isa::kAvx512;
    if (asked < best) return {asked, true};
  }
  return {best, false};
}

const IsaChoice& isa_choice() {
  static const IsaChoice chosen = detect();
  return chosen;
}
Isa isa() { return isa_choice().isa; }

// One instruction set's kernels (kernels_<isa>.cpp); no brgemm entry points below AVX2.
struct IsaKernels {
  void (*fwd)(const FwdParams&);
  void (*bwd)(const BwdParams&);
  void (*fwd_brgemm)(const FwdParams&);
  void (*bwd_brgemm)(const BwdParams&);
  void (*round_split_sums)(uint16_t*, const uint16_t*, int64_t);
  BackwardChunking (*backward_chunking)(const AttnShape&);
};

const IsaKernels& kernels() {
  static const IsaKernels k = [] {
    namespace a512b = avx512bf16;
    namespace a512 = avx512;
    switch (isa()) {
      case Isa::kAvx512Bf16:
        return IsaKernels{&a512b::attention_fwd,        &a512b::attention_bwd,
                          &a512b::attention_fwd_brgemm, &a512b::attention_bwd_brgemm,
                          &a512b::round_split_sums,     &a512b::backward_chunking};
      case Isa::kAvx512:
        return IsaKernels{&a512::attention_fwd,        &a512::attention_bwd,
                          &a512::attention_fwd_brgemm, &a512::attention_bwd_brgemm,
                          &a512::round_split_sums,     &a512::backward_chunking};
      case Isa::kAvx2:
        return IsaKernels{&avx2::attention_fwd,        &avx2::attention_bwd,
                          &avx2::attention_fwd_brgemm, &avx2::attention_bwd_brgemm,
                          &avx2::round_split_sums,     &avx2::backward_chunking};
      default:
        return IsaKernels{&generic::attention_fwd,    &generic::attention_bwd,    nullptr, nullptr,
                          &generic::round_split_sums, &generic::backward_chunking};
    }
  }();
  return k;
}

// Whether oneDNN's brgemm runs the products of operands `o` here: the instruction set builds the
// path, the build's torch has the products, mkldnn is on, and the probe passed (onednn_gemm.h).
bool brgemm_runs(Operands o) {
  if (!kernels().fwd_brgemm) return false;
  return o == Operands::kBFloat16 ? onednn::runs_bf16() : onednn::runs_f32();
}

// Where brgemm is the default (measured: bench/RESULTS.md, "CPU GEMM paths"). fp32: wherever it
// runs (AMD Zen 4: as fast as the micro-kernels forward, 5-9 % faster backward; AVX2 kernels
// with oneDNN capped at AVX2 on that CPU: 10-27 % faster). bf16: on AMX tiles, which the
// hand-written micro-kernels cannot use; on AVX512-BF16 alone the micro-kernels stay (Zen 4:
// within a few per cent of brgemm, mostly ahead). A lowered CPATTN_CPU_ISA keeps the
// micro-kernels, so that asking for an instruction set never runs oneDNN's wider code instead.
bool brgemm_preferred(Operands o) {
  if (isa_choice().lowered) return false;
  return o == Operands::kFloat32 || onednn::amx_usable();
}

bool always(Operands) { return true; }

// A row of the table: the path, where it runs, and whether the automatic choice takes it.
struct PathRow {
  KernelPath path;
  bool (*runs)(Operands);
  bool (*preferred)(Operands);
};

constexpr int kBrgemmRow = 0, kMicroRow = 1, kRows = 2;

// The table of kernel paths in order of preference; the last row runs everywhere.
const std::array<PathRow, kRows>& paths() {
  static const std::array<PathRow, kRows> table{{
      {{"brgemm", kBrgemmRow, Packing::kBrgemm, kernels().fwd_brgemm, kernels().bwd_brgemm},
       brgemm_runs,
       brgemm_preferred},
      {{"micro", kMicroRow, Packing::kMicro, kernels().fwd, kernels().bwd}, always, always},
  }};
  return table;
}

// The path CPATTN_CPU_GEMM asks for operands o: "brgemm" or "micro" for all of them, or per
// operand type, "float32:micro,bfloat16:brgemm". Empty for auto, unset, a type not named or a
// name that is no path (ignored, as CPATTN_CPU_ISA ignores what it does not know).
std::string forced_path(Operands o) {
  const char* v = env::cpu_gemm();
  std::string value = v ? v : "";
  if (value.find(':') != std::string::npos) {
    const std::string key = (o == Operands::kBFloat16 ? "bfloat16:" : "float32:");
    std::string named;
    for (size_t at = 0; at < value.size();) {
      const size_t end = std::min(value.find(',', at), value.size());
      const std::string item = value.substr(at, end - at);
      if (item.rfind(key, 0) == 0) named = item.substr(key.size());
      at = end + 1;
    }
    value = named;
  }
  for (const PathRow& row : paths())
    if (value == row.path.name) return value;
  return "";
}

int choose(Operands o) {
  const std::string forced = forced_path(o);
  for (const PathRow& row : paths()) {
    if (!row.runs(o)) continue;
    if (forced.empty() ? row.preferred(o) : forced == row.path.name) return row.path.index;
  }
  return kMicroRow;
}

std::array<std::atomic<int64_t>, kRows * 2 * 2> calls{};

void count(int index, bool bf16, int pass) {
  calls[(index * 2 + (bf16 ? 1 : 0)) * 2 + pass].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

void KernelPath::fwd(const FwdParams& p) const {
  count(index, p.q16 != nullptr, 0);
  fwd_entry(p);
}

void KernelPath::bwd(const BwdParams& p) const {
  count(index, p.q16 != nullptr, 1);
  bwd_entry(p);
}

const KernelPath& kernel_path(Operands o, bool fixed_order) {
  // -1: not chosen yet. Not chosen while mkldnn is off, so that switching it off before the
  // first call does not keep brgemm away for the rest of the process.
  static std::array<std::atomic<int>, 2> chosen{-1, -1};
  std::atomic<int>& row = chosen[static_cast<int>(o)];
  if (fixed_order || !onednn::mkldnn_enabled()) return micro_path();
  if (row.load() < 0) row.store(choose(o));
  const PathRow& r = paths()[row.load()];
  return r.runs(o) ? r.path : micro_path();
}

const KernelPath& micro_path() { return paths()[kMicroRow].path; }

std::string path_report(Operands o) {
  const KernelPath& path = kernel_path(o);
  std::string name = path.name;
  if (path.index != kBrgemmRow) return name + "-" + active_isa();
  if (o == Operands::kBFloat16) return name + (onednn::amx_usable() ? "-amx" : "-avx512bf16");
  return name;  // fp32: oneDNN picks the instruction set of its kernels itself
}

bool amx_usable() { return onednn::amx_usable(); }
bool amx_on_cpu() { return onednn::amx_on_cpu(); }

std::vector<int64_t> path_calls() {
  std::vector<int64_t> out;
  for (const auto& c : calls) out.push_back(c.load());
  return out;
}

int64_t amx_tasks() { return onednn::amx_tasks(); }

const char* active_isa() {
  switch (isa()) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

bool has_bf16_dot() { return isa() == Isa::kAvx512Bf16; }

void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n) {
  kernels().round_split_sums(high, low, n);
}

BackwardChunking backward_chunking(const AttnShape& shape) {
  return kernels().backward_chunking(shape);
}

}  // namespace cpattn::cpu
