#include <nccl.h>

namespace cpattn::comm {

// The NCCL this module was linked against (the one of torch's nvidia-nccl wheel).
int nccl_version() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return -1;
  return version;
}

}  // namespace cpattn::comm
