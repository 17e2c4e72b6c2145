// The CPU kernels compiled for AVX-512 with bf16 dot products (flags set in CMakeLists.txt):
// the fp32 kernels as in kernels_avx512.cpp, plus both passes on bf16 operands.
// Micro-tile: 8 rows x 2 vectors of 16 floats. Also the brgemm path (fp32 and bf16 products
// through oneDNN).
#define CPATTN_CPU_ISA avx512bf16
#define CPATTN_MR 8
#define CPATTN_NV 2
#define CPATTN_CPU_BF16_DOT 1
#define CPATTN_CPU_BRGEMM 1
#include "cpu/isa_entry_points.h"
