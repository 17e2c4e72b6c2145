#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpattn/env.h"
#include "cpu/kernels.h"
#include "cpu/onednn_gemm.h"

namespace cpattn::cpu {
namespace {

// What the CPU supports, for the rows of the table below. Every instruction set above generic is
// built with -mavx2 -mfma -mf16c, so each row's predicate includes the one below it.
bool cpu_has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool cpu_has_avx512() {
#if defined(__x86_64__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}
bool cpu_has_avx512bf16() {
#if defined(__x86_64__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}
bool cpu_has_anything() { return true; }

// One instruction set's kernels (kernels_<isa>.cpp); no brgemm entry points below AVX2.
struct IsaKernels {
  void (*fwd)(const FwdParams&);
  void (*bwd)(const BwdParams&);
  void (*fwd_brgemm)(const FwdParams&);
  void (*bwd_brgemm)(const BwdParams&);
  void (*round_split_sums)(uint16_t*, const uint16_t*, int64_t);
  BackwardBands (*backward_bands)(const AttnShape&, int64_t, DType);
};

#define CPATTN_ISA_KERNELS(isa)                                                  \
  IsaKernels {                                                                   \
    &isa::attention_fwd, &isa::attention_bwd, &isa::attention_fwd_brgemm,        \
        &isa::attention_bwd_brgemm, &isa::round_split_sums, &isa::backward_bands \
  }

// A row of the table of instruction sets: its name and operand packing (IsaPath), whether this
// CPU runs it, and its kernels.
struct IsaRow {
  IsaPath path;
  bool (*supported)();
  IsaKernels kernels;
};

// The instruction sets in order of preference; the last row runs everywhere. A new instruction
// set: a kernels_<isa>.cpp (its entry points, CPATTN_DECLARE_ISA in kernels.h) and a row here.
const std::array<IsaRow, 4>& isa_rows() {
  static const std::array<IsaRow, 4> table{{
      {{"avx512bf16", OperandPacking::kBf16Pairs},
       cpu_has_avx512bf16,
       CPATTN_ISA_KERNELS(avx512bf16)},
      {{"avx512", OperandPacking::kFloat32}, cpu_has_avx512, CPATTN_ISA_KERNELS(avx512)},
      {{"avx2", OperandPacking::kFloat32}, cpu_has_avx2, CPATTN_ISA_KERNELS(avx2)},
      {{"generic", OperandPacking::kFloat32},
       cpu_has_anything,
       {&generic::attention_fwd, &generic::attention_bwd, nullptr, nullptr,
        &generic::round_split_sums, &generic::backward_bands}},
  }};
  return table;
}
#undef CPATTN_ISA_KERNELS

struct IsaChoice {
  size_t row = 0;        // of isa_rows()
  bool lowered = false;  // by CPATTN_CPU_ISA
};

// The first row this CPU supports; CPATTN_CPU_ISA may name a later one (it can only lower the
// choice: asking for more than the CPU has would crash; a name that is no row is ignored).
IsaChoice detect() {
  const auto& rows = isa_rows();
  size_t best = 0;
  while (!rows[best].supported()) ++best;
  if (const char* want = env::cpu_isa())
    for (size_t r = best + 1; r < rows.size(); ++r)
      if (!std::strcmp(want, rows[r].path.name)) return {r, true};
  return {best, false};
}

const IsaChoice& isa_choice() {
  static const IsaChoice chosen = detect();
  return chosen;
}
const IsaKernels& kernels() { return isa_rows()[isa_choice().row].kernels; }

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

const char* active_isa() { return active_isa_path().name; }

const IsaPath& active_isa_path() { return isa_rows()[isa_choice().row].path; }

std::vector<IsaPath> isa_paths() {
  std::vector<IsaPath> out;
  for (const IsaRow& row : isa_rows()) out.push_back(row.path);
  return out;
}

void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n) {
  kernels().round_split_sums(high, low, n);
}

BackwardBands backward_bands(const AttnShape& shape, int64_t operand_bytes, DType grad) {
  return kernels().backward_bands(shape, operand_bytes, grad);
}

}  // namespace cpattn::cpu
