// The CPU step kernel compiled for one instruction set (scalar). Everything ISA-specific lives in
// namespace qconf::isa_scalar, so the four builds of the same template never share a symbol.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <cstdint>

#include "qconf/element.h"
#include "qconf/scale_walk.h"
#include "qconf/step_types.h"

// (no `#pragma GCC target` and no QCONF_ISA_*: simd.h's portable Isa)
namespace qconf {
namespace isa_scalar {
#include "qconf/simd.h"
#include "qconf/step_cpu.h"
}  // namespace isa_scalar
}  // namespace qconf
