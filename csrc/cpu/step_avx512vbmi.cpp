// The CPU step kernel compiled for AVX-512 with VBMI (byte permutes: the 8-bit table lookups
// take byte planes, 64 lanes per permute). Everything ISA-specific lives in namespace
// qconf::isa_avx512vbmi, so the four builds of the same template never share a symbol.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <cstdint>

#include "qconf/element.h"
#include "qconf/scale_walk.h"
#include "qconf/step_types.h"

#if defined(__x86_64__) || defined(_M_X64)  // elsewhere every build is the portable one
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,f16c")
#define QCONF_ISA_AVX512
#define QCONF_ISA_VBMI
#endif

namespace qconf {
namespace isa_avx512vbmi {
#include "qconf/simd.h"
#include "qconf/step_cpu.h"
}  // namespace isa_avx512vbmi
}  // namespace qconf
