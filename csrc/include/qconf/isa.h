// Run-time choice of the CPU instruction set for the fused kernels.
#pragma once

namespace qconf {

// avx512: F, BW, VL, DQ; avx512vbmi adds byte permutes (vpermt2b) for the 8-bit table lookups
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512vbmi = 3 };

// Best ISA this CPU (and this build) supports.
Isa detect_isa();
// The ISA the kernels use: QCONF_CPU_ISA=scalar|avx2|avx512|avx512vbmi if set (an error if the CPU lacks it),
// else detect_isa(). Read once per call; cheap.
Isa selected_isa();
const char* isa_name(Isa isa);

}  // namespace qconf
