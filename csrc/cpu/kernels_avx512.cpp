// The CPU kernels compiled for avx512 (flags set per file in CMakeLists.txt).
// Micro-tile: 8 rows x 2 vectors of 16 floats, sized to the register file of this ISA. Also the
// brgemm path (fp32 products through oneDNN).
#define CPATTN_CPU_ISA avx512
#define CPATTN_MR 8
#define CPATTN_NV 2
#define CPATTN_CPU_BRGEMM 1
#include "cpu/isa_entry_points.h"
