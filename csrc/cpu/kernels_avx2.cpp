// The CPU kernels compiled for avx2 (flags set per file in CMakeLists.txt).
// Micro-tile: 6 rows x 1 vector of 16 floats (12 ymm accumulators, 2 for B, 1 broadcast: 15 of
// the 16 registers), the classic AVX2 shape. Also the brgemm path (fp32 products through oneDNN).
#define CPATTN_CPU_ISA avx2
#define CPATTN_MR 6
#define CPATTN_NV 1
#define CPATTN_CPU_BRGEMM 1
#include "cpu/isa_entry_points.h"
