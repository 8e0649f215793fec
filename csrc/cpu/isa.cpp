// CPU feature detection and the QCONF_CPU_ISA override.
#include "qconf/isa.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace qconf {

Isa detect_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
#ifndef QCONF_NO_AVX512  // (a build without the AVX-512 kernels: tests/sanitize.py on a CPU that lacks them)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vbmi") ? Isa::avx512vbmi : Isa::avx512;
#endif
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::avx2;
#endif
  return Isa::scalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512vbmi: return "avx512vbmi";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "scalar";
  }
}

Isa selected_isa() {
  const Isa best = detect_isa();
  const char* env = std::getenv("QCONF_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  Isa want;
  if (std::strcmp(env, "scalar") == 0) want = Isa::scalar;
  else if (std::strcmp(env, "avx2") == 0) want = Isa::avx2;
  else if (std::strcmp(env, "avx512") == 0) want = Isa::avx512;
  else if (std::strcmp(env, "avx512vbmi") == 0) want = Isa::avx512vbmi;
  else
    throw std::invalid_argument(std::string("QCONF_CPU_ISA=") + env +
                                " is not one of scalar, avx2, avx512, avx512vbmi");
  if (static_cast<int>(want) > static_cast<int>(best))
    throw std::invalid_argument(std::string("QCONF_CPU_ISA=") + env +
                                " but this CPU (and this build) supports at most " + isa_name(best));
  return want;
}

}  // namespace qconf
