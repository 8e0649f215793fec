// The AVX2 kernel of qconf::ternary_mm (csrc/include/qconf/ternary_mm.h has the math and layout).
// Blocked for the caches: for each block of kKBlockGroups groups (1 KiB of k), for each weight
// panel (16 KiB of it, in L1), for each tile of kRows rows: kRows x 16 int16 sums in 8 registers.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#pragma GCC target("avx2")
#endif
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qconf/ternary_mm.h"

namespace qconf {
namespace isa_avx2 {
#if defined(__x86_64__) || defined(_M_X64)
namespace {

constexpr int kRows = 4, kVectors = kTernaryPanel / 8;
constexpr int64_t kKBlockGroups = 256;

// acc[r][j] += the int16 pair sums of group g: panel bytes u (8 columns x 4 k per vector) times
// the 4 bytes x[r, 4g .. 4g+3] of each row r, broadcast to every column.
template <int R>
inline void madd_group(__m256i (&acc)[R][kVectors], const uint8_t* u, const int8_t* x, int64_t ldx) {
  __m256i uv[kVectors];
  for (int j = 0; j < kVectors; ++j) uv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 32 * j));
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, x + r * ldx, kTernaryGroup);
    const __m256i xv = _mm256_set1_epi32(four);
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(uv[j], xv));
  }
}

// c32 += the product of rows x[0..R) and one panel over groups [g0, g1); x's last group may be
// partial (K % 4 != 0): its missing bytes count as 0.
template <int R>
void tile_groups(const int8_t* x, int64_t ldx, int64_t K, const uint8_t* panel, int64_t g0, int64_t g1,
                 int32_t (&c32)[R][kTernaryPanel]) {
  const int64_t whole = K / kTernaryGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p0 = g0; p0 < g1; p0 += kTernaryInt16Groups) {
    const int64_t p1 = std::min(g1, p0 + kTernaryInt16Groups), full_end = std::min(p1, whole);
    __m256i acc[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm256_setzero_si256();
    for (int64_t g = p0; g < full_end; ++g)
      madd_group<R>(acc, panel + g * kTernaryPanelGroupBytes, x + kTernaryGroup * g, ldx);
    if (full_end < p1) {  // the partial group, from a zero-padded copy
      int8_t tail[R][kTernaryGroup] = {};
      for (int r = 0; r < R; ++r) std::memcpy(tail[r], x + r * ldx + kTernaryGroup * whole, K % kTernaryGroup);
      madd_group<R>(acc, panel + whole * kTernaryPanelGroupBytes, &tail[0][0], kTernaryGroup);
    }
    for (int r = 0; r < R; ++r)  // int16 pair sums -> int32 column sums (the two pairs of a column)
      for (int j = 0; j < kVectors; ++j) {
        __m256i* c = reinterpret_cast<__m256i*>(&c32[r][8 * j]);
        _mm256_storeu_si256(c, _mm256_add_epi32(_mm256_loadu_si256(c), _mm256_madd_epi16(acc[r][j], ones)));
      }
  }
}

// One tile of R rows and `cols` columns of out over groups [g0, g1): the partial sums live in out as
// int32 between k blocks; the last block subtracts the row sums and converts to fp32 (exact below
// 2**24, else rounded once to nearest even).
template <int R>
void tile(const TernaryMmArgs& a, int64_t m, int64_t p, int64_t g0, int64_t g1) {
  const int cols = static_cast<int>(std::min<int64_t>(kTernaryPanel, a.N - p * kTernaryPanel));
  float* out = a.out + m * a.N + p * kTernaryPanel;
  alignas(32) int32_t c32[R][kTernaryPanel] = {};
  if (g0 > 0)
    for (int r = 0; r < R; ++r) std::memcpy(c32[r], out + r * a.N, cols * sizeof(int32_t));
  tile_groups<R>(a.x + m * a.K, a.K, a.K, a.packed + p * a.groups * kTernaryPanelGroupBytes, g0, g1, c32);
  if (g1 < a.groups) {
    for (int r = 0; r < R; ++r) std::memcpy(out + r * a.N, c32[r], cols * sizeof(int32_t));
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < cols; ++c) out[r * a.N + c] = static_cast<float>(c32[r][c] - a.row_sums[m + r]);
}

template <int R>
void rows_tail(const TernaryMmArgs& a, int64_t m, int64_t rows, int64_t p, int64_t g0, int64_t g1) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R>(a, m, p, g0, g1);
    rows_tail<R - 1>(a, m, rows, p, g0, g1);
  }
}

}  // namespace

void ternary_mm_block(const TernaryMmArgs& a, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  for (int64_t g0 = 0; g0 < a.groups; g0 += kKBlockGroups) {
    const int64_t g1 = std::min(a.groups, g0 + kKBlockGroups);
    for (int64_t p = p0; p < p1; ++p) {
      int64_t m = m0;
      for (; m + kRows <= m1; m += kRows) tile<kRows>(a, m, p, g0, g1);
      if (m < m1) rows_tail<kRows - 1>(a, m, m1 - m, p, g0, g1);
    }
  }
}
#else
void ternary_mm_block(const TernaryMmArgs&, int64_t, int64_t, int64_t, int64_t) {}
#endif

}  // namespace isa_avx2
}  // namespace qconf
