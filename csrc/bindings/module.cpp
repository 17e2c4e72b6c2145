// The Python module cpattn._C: importing it registers the ops (registration.cpp); it also
// reports how it was built.
#include <pybind11/pybind11.h>

#include "cpu/kernels.h"

#ifdef CPATTN_WITH_CUDA
namespace cpattn::comm {
int nccl_version();
}
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpattn compiled ops";
  m.def("cpu_isa", &cpattn::cpu::active_isa,
        "Instruction set of the CPU kernels: avx512, avx2 or generic");
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
