// The fixed-width integer types for every compiler of the native code: <cstdint> for the host
// compilers and nvcc, and the same names defined here for NVRTC, which compiles the specialized
// CUDA kernels at run time (csrc/include/qconf/spec_kernel.cuh) and has no standard headers.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
typedef unsigned long size_t;
#else
#include <cstddef>
#include <cstdint>
#endif
