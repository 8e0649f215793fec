// The specs whose kernels the extension compiles ahead of time (csrc/cuda/spec_aot.cu): AdamW
// (decoupled weight decay) with the shipped configs most runs use -- default.yml (2-D parameters:
// rank-1 exp_avg_sq; 1-D ones: group scales, as 2nd_moment_group_128.yml), 8bit.yml, and fp32
// states (fp32.yml, and every parameter at or below a config's min_numel) -- for float32 and
// bfloat16 parameters (gradients of the same dtype). Every other spec is compiled at its first use
// with NVRTC. tests/test_spec_host.py checks that these are the specs those configs give.
#pragma once

#include "qconf/spec.h"

namespace qconf {
namespace spec {
namespace aot {

constexpr int kAdamW = kFlagWeightDecay | kFlagDecoupled;
using None = State<kNone>;
using Fp32 = State<kFp32>;
using M4 = State<kQuant, 4, kBlock, 128, kNearSearch>;       // 4-bit nonlinear, group 128
using V4Rank1 = State<kQuant, 4, kRank1, 0, kNearGrid>;      // 4-bit power-1, rank-1
using V4 = State<kQuant, 4, kBlock, 128, kNearGrid>;         // 4-bit power-1, group 128
using M8 = State<kQuant, 8, kBlock, 256, kNearLinesSigned>;  // 8-bit nonlinear, group 256
using V8 = State<kQuant, 8, kBlock, 256, kNearLinesUnsigned>;

template <int D, class S0, class S1>
using AdamW = Spec<kRuleAdam, kAdamW, D, D, 0, S0, S1, None>;

using DefaultF32 = AdamW<kF32, M4, V4Rank1>;
using Group128F32 = AdamW<kF32, M4, V4>;
using EightBitF32 = AdamW<kF32, M8, V8>;
using Fp32F32 = AdamW<kF32, Fp32, Fp32>;
using DefaultBF16 = AdamW<kBF16, M4, V4Rank1>;
using Group128BF16 = AdamW<kBF16, M4, V4>;
using EightBitBF16 = AdamW<kBF16, M8, V8>;
using Fp32BF16 = AdamW<kBF16, Fp32, Fp32>;

}  // namespace aot
}  // namespace spec
}  // namespace qconf

// X(spec) for each ahead-of-time spec
#define QCONF_AOT_SPECS(X)                                                                                  \
  X(qconf::spec::aot::DefaultF32)                                                                            \
  X(qconf::spec::aot::Group128F32)                                                                           \
  X(qconf::spec::aot::EightBitF32)                                                                           \
  X(qconf::spec::aot::Fp32F32)                                                                               \
  X(qconf::spec::aot::DefaultBF16)                                                                           \
  X(qconf::spec::aot::Group128BF16)                                                                          \
  X(qconf::spec::aot::EightBitBF16)                                                                          \
  X(qconf::spec::aot::Fp32BF16)
