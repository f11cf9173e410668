#pragma once
// Host/device qualifiers so index math in csrc/common is written once for CPU and CUDA.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define IST_HD __host__ __device__ __forceinline__
#else
#define IST_HD inline
#endif
