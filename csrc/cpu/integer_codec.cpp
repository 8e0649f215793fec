// The integer-grid codec's elementwise passes (qconf/codec/integer.py is the specification; BitNet
// b1.58's quantizer), one pass each with no temporaries, on fp32 [R, C] rows:
//   absmax_rows(x)              -> fp32 [R]:    max |x[r, :]| over the finite elements (0 if none)
//   round_levels(x, f, mrq)     -> int8 [R, C]: clamp(round_half_even(fp32(x * f[r])), -mrq, mrq), NaN -> 0
//   divide_levels(k, f)         -> fp32 [R, C]: fp32(k / f[r])
// f holds one factor per row ([R]) or one for all ([1]). AVX2 vectors where the CPU has them (the
// same IEEE operations as the scalar code, which also does every row's tail); results are
// independent of the ISA and the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QCONF_INT_AVX2 __attribute__((target("avx2")))
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qconf/isa.h"

namespace qconf {
namespace {

inline float finite_abs(float v) { return std::isfinite(v) ? std::fabs(v) : 0.0f; }

inline int8_t round_level(float v, float f, float mrq) {
  const float t = std::nearbyint(v * f);  // the default rounding mode: half to even
  return std::isnan(t) ? int8_t{0} : static_cast<int8_t>(std::min(std::max(t, -mrq), mrq));
}

#ifdef QCONF_INT_AVX2
// Each returns how many leading elements it did (a multiple of its vector width); the scalar code
// does the rest.
QCONF_INT_AVX2 int64_t absmax_avx2(const float* x, int64_t n, float& out) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
  __m256 m = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude);
    m = _mm256_max_ps(m, _mm256_and_ps(a, _mm256_cmp_ps(a, inf, _CMP_LT_OQ)));  // NaN, +-Inf -> 0
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  out = *std::max_element(lanes, lanes + 8);
  return i;
}

QCONF_INT_AVX2 int64_t round_avx2(const float* x, int64_t n, float f, float mrq, int8_t* k) {
  const __m256 fv = _mm256_set1_ps(f), lo = _mm256_set1_ps(-mrq), hi = _mm256_set1_ps(mrq);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i q[4];
    for (int j = 0; j < 4; ++j) {
      __m256 t = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), fv),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 ordered = _mm256_cmp_ps(t, t, _CMP_ORD_Q);
      t = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(t, lo), hi), ordered);  // clamp; NaN -> 0
      q[j] = _mm256_cvtps_epi32(t);
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(k + i), _mm256_permutevar8x32_epi32(b, order));
  }
  return i;
}

QCONF_INT_AVX2 int64_t divide_avx2(const int8_t* k, int64_t n, float f, float* y) {
  const __m256 fv = _mm256_set1_ps(f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k + i));
    _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), fv));
  }
  return i;
}
#else  // no AVX2 code: use_avx2() is false and these are never called
int64_t absmax_avx2(const float*, int64_t, float&) { return 0; }
int64_t round_avx2(const float*, int64_t, float, float, int8_t*) { return 0; }
int64_t divide_avx2(const int8_t*, int64_t, float, float*) { return 0; }
#endif

bool use_avx2() {
#ifdef QCONF_INT_AVX2
  return static_cast<int>(selected_isa()) >= static_cast<int>(Isa::avx2);
#else
  return false;
#endif
}

void check_rows(const char* op, const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 2, "qconf::", op, ": ", name,
              " must be a 2-D ", dtype, " CPU tensor, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

const float* row_factors(const char* op, const at::Tensor& f, int64_t rows) {
  TORCH_CHECK(f.device().is_cpu() && f.scalar_type() == at::kFloat && f.dim() == 1 && f.is_contiguous() &&
                  (f.size(0) == rows || f.size(0) == 1),
              "qconf::", op, ": factors must be a contiguous 1-D float32 CPU tensor of ", rows, " or 1 values, got ",
              f.scalar_type(), " ", f.sizes());
  return f.data_ptr<float>();
}

// fn(r) for every row r, in parallel over rows (~64K elements per task)
template <class Fn>
void for_rows(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

at::Tensor absmax_rows(const at::Tensor& x_) {
  check_rows("absmax_rows", x_, at::kFloat, "x");
  const at::Tensor x = x_.contiguous();
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor out = at::empty({R}, x.options());
  const bool avx2 = use_avx2();
  for_rows(R, C, [&](int64_t r) {
    const float* row = x.data_ptr<float>() + r * C;
    float m = 0.0f;
    for (int64_t i = avx2 ? absmax_avx2(row, C, m) : 0; i < C; ++i) m = std::max(m, finite_abs(row[i]));
    out.data_ptr<float>()[r] = m;
  });
  return out;
}

// out[r, :] = one elementwise pass over in[r, :] with row r's factor, for every row in parallel:
// vector(row, C, f, out_row) does a prefix where the CPU has AVX2 and returns its length,
// scalar(value, f) the rest.
template <class In, class Out, class Vector, class Scalar>
at::Tensor map_rows(const char* op, const at::Tensor& in_, const at::Tensor& factors, at::ScalarType out_dtype,
                    Vector vector, Scalar scalar) {
  const at::Tensor in = in_.contiguous();
  const int64_t R = in.size(0), C = in.size(1);
  const float* f = row_factors(op, factors, R);
  const bool each = factors.size(0) == R, avx2 = use_avx2();
  at::Tensor out = at::empty({R, C}, in.options().dtype(out_dtype));
  for_rows(R, C, [&](int64_t r) {
    const In* row = in.data_ptr<In>() + r * C;
    Out* dst = out.data_ptr<Out>() + r * C;
    const float fr = f[each ? r : 0];
    for (int64_t i = avx2 ? vector(row, C, fr, dst) : 0; i < C; ++i) dst[i] = scalar(row[i], fr);
  });
  return out;
}

at::Tensor round_levels(const at::Tensor& x, const at::Tensor& factors, int64_t mrq) {
  check_rows("round_levels", x, at::kFloat, "x");
  TORCH_CHECK(mrq >= 1 && mrq <= 127, "qconf::round_levels: mrq must be in 1..127, got ", mrq);
  const float m = static_cast<float>(mrq);
  return map_rows<float, int8_t>(
      "round_levels", x, factors, at::kChar,
      [m](const float* row, int64_t n, float f, int8_t* k) { return round_avx2(row, n, f, m, k); },
      [m](float v, float f) { return round_level(v, f, m); });
}

at::Tensor divide_levels(const at::Tensor& k, const at::Tensor& factors) {
  check_rows("divide_levels", k, at::kChar, "levels");
  return map_rows<int8_t, float>("divide_levels", k, factors, at::kFloat, &divide_avx2,
                                 [](int8_t v, float f) { return static_cast<float>(v) / f; });
}

}  // namespace
}  // namespace qconf

TORCH_LIBRARY_FRAGMENT(qconf, m) {
  m.def("absmax_rows(Tensor x) -> Tensor");
  m.def("round_levels(Tensor x, Tensor factors, int mrq) -> Tensor");
  m.def("divide_levels(Tensor levels, Tensor factors) -> Tensor");
}

TORCH_LIBRARY_IMPL(qconf, CPU, m) {
  m.impl("absmax_rows", &qconf::absmax_rows);
  m.impl("round_levels", &qconf::round_levels);
  m.impl("divide_levels", &qconf::divide_levels);
}
