// Every environment variable the C++ side reads, in one place (docs/environment.md lists them;
// Python's are in python/cpattn/core/validation.py). Read when called: callers cache what they
// need.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace cpattn::env {

inline bool flag(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '1';
}

// CPATTN_POISON=1 (tests): new outputs are filled with NaN, so an unwritten element shows.
inline bool poison_outputs() { return flag("CPATTN_POISON"); }

// CPATTN_CPU_ISA=generic|avx2|avx512: lowers the CPU kernels' instruction set (never raises it).
inline const char* cpu_isa() { return std::getenv("CPATTN_CPU_ISA"); }

// CPATTN_CPU_GEMM=auto|brgemm|micro, or per operand type "float32:micro,bfloat16:brgemm": how
// the CPU kernels run their matrix products (oneDNN's brgemm or the hand-written micro-kernels),
// where the CPU and torch can; auto (or unset, or a type not named): the default of this CPU
// kind (cpu/dispatch.cpp).
inline const char* cpu_gemm() { return std::getenv("CPATTN_CPU_GEMM"); }

// CPATTN_RING_TRANSPORT=c10d: CUDA ring shifts through the process group, not cpattn's NCCL.
inline bool ring_transport_c10d() {
  const char* v = std::getenv("CPATTN_RING_TRANSPORT");
  return v && std::strcmp(v, "c10d") == 0;
}

// CPATTN_DETERMINISTIC=1: the CUDA backward's dQ by a separate pass, not fp32 atomics (as under
// torch.use_deterministic_algorithms(True)).
inline bool deterministic() { return flag("CPATTN_DETERMINISTIC"); }

// CPATTN_BWD_HEAD_SPLITS=n (tests): forces the CUDA dK/dV pass's head splits.
inline std::optional<int64_t> bwd_head_splits() {
  const char* v = std::getenv("CPATTN_BWD_HEAD_SPLITS");
  if (!v) return std::nullopt;
  return std::atoll(v);
}

}  // namespace cpattn::env
