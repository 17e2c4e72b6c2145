// The Python module cpattn._C: importing it registers the ops (registration.cpp); it also
// reports how it was built.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "cpattn/mask.h"
#include "cpu/kernels.h"
#include "ops/checks.h"

#ifdef CPATTN_WITH_CUDA
namespace cpattn::comm {
int nccl_version();
}
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpattn compiled ops";
  // The limits the op layer checks, read by python/cpattn/core/validation.py (defined once, here).
  m.attr("MAX_HEAD_DIM") = cpattn::ops::kMaxHeadDim;
  m.attr("UNBOUNDED_POSITION") = cpattn::kUnbounded;  // a window side this large: unbounded
  m.def("cpu_isa", &cpattn::cpu::active_isa,
        "Instruction set the CPU kernels run with (the first of cpu_isa_paths() this CPU "
        "supports, or a later one that CPATTN_CPU_ISA names)");
  m.def(
      "cpu_isa_paths",
      [] {
        std::vector<std::pair<std::string, std::string>> rows;
        for (const cpattn::cpu::IsaPath& p : cpattn::cpu::isa_paths())
          rows.emplace_back(p.name, p.packing == cpattn::cpu::OperandPacking::kBf16Pairs
                                        ? "bfloat16"
                                        : "float32");
        return rows;
      },
      "The CPU kernels' instruction sets in order of preference: (name, the operand type "
      "bfloat16 inputs take: bfloat16 through bf16 dot products, or float32)");
  m.def(
      "cpu_gemm",
      [](const std::string& dtype) {
        using cpattn::cpu::Operands;
        const bool bf16 = dtype == "bfloat16" && cpattn::cpu::active_isa_path().packing ==
                                                     cpattn::cpu::OperandPacking::kBf16Pairs;
        return cpattn::cpu::path_report(bf16 ? Operands::kBFloat16 : Operands::kFloat32);
      },
      "How the CPU kernels run the products of inputs of this dtype (float32, float16, "
      "bfloat16): micro-<isa>, brgemm-amx, brgemm-avx512bf16 or brgemm (fp32)");
  m.def("cpu_amx_on_cpu", &cpattn::cpu::amx_on_cpu, "Whether the CPU has AMX-BF16 tiles");
  m.def("cpu_amx_usable", &cpattn::cpu::amx_usable,
        "Whether oneDNN runs bf16 products on AMX tiles in this process");
  m.def(
      "nccl_version",
      [] {
#ifdef CPATTN_WITH_CUDA
        return cpattn::comm::nccl_version();
#else
        return 0;
#endif
      },
      "NCCL version linked (e.g. 23007), 0 when built without CUDA");
}
