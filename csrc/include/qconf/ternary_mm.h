// The int8 x ternary matrix product of BitLinear's forward (qconf::ternary_mm): the packed weight
// layout shared by the driver (csrc/cpu/ternary_mm.cpp) and the AVX2 kernel
// (csrc/cpu/ternary_mm_avx2.cpp).
//
// out[m, n] = fp32(sum_k x[m, k] * w[n, k]) for int8 x [M, K] and int8 w [N, K] in {-1, 0, +1}.
// vpmaddubsw multiplies unsigned by signed bytes, so the kernel multiplies u = w + 1 in {0, 1, 2}
// by x and subtracts x's row sums: sum_k u x - sum_k x = sum_k w x, exactly, in integers.
#pragma once

#include <cstdint>

namespace qconf {

// Weights are packed in panels of kTernaryPanel output columns; within a panel, for each group of
// kTernaryGroup consecutive k, the group's bytes of every column in turn: panel[g][column][k % 4],
// u = w + 1, zero past N and past K. One 32-byte load is 8 columns x 4 k.
constexpr int kTernaryPanel = 16;
constexpr int kTernaryGroup = 4;
constexpr int64_t kTernaryPanelGroupBytes = kTernaryPanel * kTernaryGroup;
// A pair sum of vpmaddubsw is at most 2 * 2 * 128 = 512 in magnitude, so 64 of them add up exactly
// in int16 ([-32768, 32512]); the kernel widens to int32 every kTernaryInt16Groups groups.
constexpr int64_t kTernaryInt16Groups = 64;
// The int32 accumulators hold |sum_k u x| <= 2 * 128 * K: K up to 2**22 is far from overflow.
constexpr int64_t kTernaryMaxK = int64_t{1} << 22;

struct TernaryMmArgs {
  const int8_t* x;        // [M, K] row-major, any int8
  const uint8_t* packed;  // the packed weight: panels * groups * kTernaryPanelGroupBytes bytes
  const int32_t* row_sums;  // [M]: sum_k x[m, k]
  float* out;             // [M, N] row-major; also the int32 partial sums between k blocks
  int64_t M, K, N, groups, panels;
};

namespace isa_avx2 {
// Rows [m0, m1) x panels [p0, p1) of out, all of K. Needs AVX2.
void ternary_mm_block(const TernaryMmArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1);
}  // namespace isa_avx2

}  // namespace qconf
