// The CPU step kernel compiled for one instruction set (avx2). Everything ISA-specific lives in
// namespace qconf::isa_avx2, so the four builds of the same template never share a symbol.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <cstdint>

#include "qconf/element.h"
#include "qconf/scale_walk.h"
#include "qconf/step_types.h"

#if defined(__x86_64__) || defined(_M_X64)  // elsewhere every build is the portable one
#pragma GCC target("avx2,fma,f16c")
#define QCONF_ISA_AVX2
#endif

namespace qconf {
namespace isa_avx2 {
#include "qconf/simd.h"
#include "qconf/step_cpu.h"
}  // namespace isa_avx2
}  // namespace qconf
