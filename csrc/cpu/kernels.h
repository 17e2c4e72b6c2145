// Entry points of the CPU kernels. The instruction set is chosen at run time (dispatch.cpp), and
// so is the way the matrix products run: a table of kernel paths (KernelPath), in order of
// preference, one per way of running the products (the hand-written micro-kernels, oneDNN's
// brgemm), each with its entry points and the packing it needs from the op layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu/params.h"

namespace cpattn::cpu {

// The kernels' operand type: bf16 where the instruction set's packing is kBf16Pairs and the
// inputs are bf16; fp32 otherwise (fp32 and fp16 inputs, and bf16 on the other instruction sets).
enum class Operands { kFloat32 = 0, kBFloat16 = 1 };

// How the op layer packs a call's operands for a path (params.h says where each goes):
// - kMicro: the forward's V as rows (fp32) or with key pairs interleaved (bf16, v16), and for
//   a bf16 backward with dQ, K with key pairs interleaved (k16_pairs);
// - kBrgemm: the forward's V transposed in panels of kValuePanelKeys keys (vt / vt16); no K
//   pairs.
enum class Packing { kMicro, kBrgemm };

// One row of the table of kernel paths.
struct KernelPath {
  const char* name;  // "micro" or "brgemm"
  int index;         // its row (path_calls)
  Packing packing;
  void (*fwd_entry)(const FwdParams&);
  void (*bwd_entry)(const BwdParams&);
  // Run the path (and count the call: path_calls).
  void fwd(const FwdParams& p) const;
  void bwd(const BwdParams& p) const;
};

// The path a call with these operands takes. Chosen once per process per operand type: the
// path that CPATTN_CPU_GEMM (auto, brgemm, micro) forces where it runs here, else the first
// row of the table that runs here and is preferred on this CPU kind (dispatch.cpp). A call in
// invariant mode (fixed_order) always takes the micro-kernels (its fixed orders of summation are
// theirs), and so does every call while torch.backends.mkldnn.enabled is False.
const KernelPath& kernel_path(Operands o, bool fixed_order = false);
// The micro-kernel path of the active instruction set (what bench/cpp drives directly).
const KernelPath& micro_path();

// The path kernel_path(o) takes and how it runs, for cpattn.build_info(): "micro-<isa>",
// "brgemm-amx", "brgemm-avx512bf16" (bf16 operands) or "brgemm" (fp32).
std::string path_report(Operands o);
// Whether the bf16 products run on AMX tiles (oneDNN reaches AMX in this process), and whether
// the CPU has AMX-BF16 at all.
bool amx_usable();
bool amx_on_cpu();

// Test-only counters since the process started: kernel calls per (path row, operands, pass
// 0 forward / 1 backward), flattened in that order, and parallel tasks that used AMX tiles.
std::vector<int64_t> path_calls();
int64_t amx_tasks();

// Rounds n split fp32 sums (BwdParams::dq_low) to the nearest bf16, in place in `high`.
void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n);

// How an instruction set's kernels take bf16 inputs: as fp32 operands like every other input
// (kFloat32), or as bf16 operands through bf16 dot products (kBf16Pairs: FwdParams::q16...,
// params.h; V of the forward and K of the backward's dQ with key pairs interleaved).
enum class OperandPacking { kFloat32, kBf16Pairs };

// A row of the table of instruction sets (dispatch.cpp, in order of preference): "avx512bf16",
// "avx512", "avx2", "generic".
struct IsaPath {
  const char* name;
  OperandPacking packing;
};

// The instruction set the kernels run with: the first row of the table this CPU supports. The
// environment variable CPATTN_CPU_ISA may name a later one (tests use it to cover every path).
const IsaPath& active_isa_path();
const char* active_isa();  // its name
// Every row, in order of preference (for cpattn.build_info()).
std::vector<IsaPath> isa_paths();

// How the backward of a call of shape `shape` cuts its work (attention_kernel.h): the splits of
// the key blocks per (batch, kv head) pair, each with its own dQ buffer, the query rows per
// band, and the bytes of its buffers (backward_buffer_bytes) with operands packed in elements of
// operand_bytes and dK, dV wanted in `grad`. For the cost model's memory figures (cpattn.plan).
struct BackwardBands {
  int64_t key_splits = 0;
  int64_t band_rows = 0;
  int64_t buffer_bytes = 0;
};
BackwardBands backward_bands(const AttnShape& shape, int64_t operand_bytes, DType grad);

// Each instruction set's entry points (kernels_<isa>.cpp); the brgemm path's where its file
// builds it (AVX2 and up).
#define CPATTN_DECLARE_ISA(isa)                                                            \
  namespace isa {                                                                          \
  void attention_fwd(const FwdParams& params);                                             \
  void attention_bwd(const BwdParams& params);                                             \
  void attention_fwd_brgemm(const FwdParams& params);                                      \
  void attention_bwd_brgemm(const BwdParams& params);                                      \
  void round_split_sums(uint16_t* high, const uint16_t* low, int64_t n);                   \
  BackwardBands backward_bands(const AttnShape& shape, int64_t operand_bytes, DType grad); \
  }
CPATTN_DECLARE_ISA(avx512bf16)
CPATTN_DECLARE_ISA(avx512)
CPATTN_DECLARE_ISA(avx2)
CPATTN_DECLARE_ISA(generic)
#undef CPATTN_DECLARE_ISA

}  // namespace cpattn::cpu
