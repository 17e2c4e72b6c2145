// Shared by g++ and nvcc: marks the header core's functions for host and device.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define CPATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CPATTN_HOST_DEVICE inline
#endif
