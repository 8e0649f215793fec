// The CPU step kernel compiled for one instruction set (avx512). Everything ISA-specific lives in
// namespace qconf::isa_avx512, so the four builds of the same template never share a symbol.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <cstdint>

#include "qconf/element.h"
#include "qconf/scale_walk.h"
#include "qconf/step_types.h"

#if defined(__x86_64__) || defined(_M_X64)  // elsewhere every build is the portable one
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
#define QCONF_ISA_AVX512
#endif

namespace qconf {
namespace isa_avx512 {
#include "qconf/simd.h"
#include "qconf/step_cpu.h"
}  // namespace isa_avx512
}  // namespace qconf
