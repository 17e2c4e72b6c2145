// The CPU kernels compiled for generic (flags set per file in CMakeLists.txt).
// Micro-tile: 2 rows x 1 vector of 16 floats, sized to the register file of this ISA.
#define CPATTN_CPU_ISA generic
#define CPATTN_MR 2
#define CPATTN_NV 1
#include "cpu/isa_entry_points.h"
