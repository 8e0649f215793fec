// Per-element math shared by the CPU kernels (scalar and SIMD) and the CUDA kernels.
//
// Everything here is __host__ __device__ and written against a "float-like" type T: plain float on
// the scalar CPU path and on the GPU, a SIMD vector on the AVX2/AVX-512 paths (simd.h provides the
// same operators and functions for vectors). Every formula is a sequence of individually rounded
// IEEE fp32 operations in the same order as the reference path (qconf/optim/*.py,
// qconf/codec/*.py); the extension is built with -ffp-contract=off (nvcc: --fmad=false) so no
// multiply-add is fused and results are bit-identical to the reference.
#pragma once

#if !defined(__CUDACC_RTC__)  // NVRTC (run-time compiled kernels) has no standard headers
#include <cmath>
#include <cstring>
#endif
#include "qconf/fixed_int.h"

#if defined(__CUDACC__)
#define QCONF_HD __host__ __device__ __forceinline__
// a rarely taken path, kept out of line on the GPU so that the loop around its call stays short
#define QCONF_COLD __host__ __device__ __noinline__
#else
#define QCONF_HD inline __attribute__((always_inline))
#define QCONF_COLD inline
#endif

namespace qconf {

// ---------------------------------------------------------------------------------------------
// bit casts
QCONF_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

QCONF_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// ---------------------------------------------------------------------------------------------
// correctly rounded fp32 operations (simd.h has the same for vectors)
QCONF_HD float qsqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);
#endif
}

QCONF_HD float qdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// 1 / x, correctly rounded: the same value as qdiv(1, x), by the GPU's cheaper IEEE reciprocal.
QCONF_HD float qrcp(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}

// a * b + c rounded once (-ffp-contract=off never fuses on its own, so only where asked)
QCONF_HD float qfma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

// torch.sign: +1, -1, or 0 for +-0 and NaN.
QCONF_HD float qsign(float x) { return static_cast<float>((x > 0.0f) - (x < 0.0f)); }

// ---------------------------------------------------------------------------------------------
// fp32 <-> bf16 / fp16
QCONF_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN with its sign.
QCONF_HD uint16_t f32_to_bf16_rne(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float without hardware support (used on the scalar path; SIMD paths use F16C).
QCONF_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_f32(sign);
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even (the same result as the hardware conversion / torch's .half()).
QCONF_HD uint16_t f32_to_f16_rne(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // nan
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (>= 65520) -> inf
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // round(x / 2^-24) to nearest even by one fp32 addition: the ulp of 0.5 is 2^-24
    const float f = bits_f32(a) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(f) - 0x3f000000u));
  }
  const uint32_t mant_odd = (a >> 13) & 1u;
  const uint32_t r = a + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Stochastic rounding into low-precision parameters (qconf/optim/weights.py). NaN and +-Inf pass
// through, a finite value never becomes infinite (it saturates at the largest finite value).
// bf16: add 16 random bits to the fp32 pattern and truncate (uint32 arithmetic, no overflow:
// the largest pattern 0xFF7FFFFF + 0xFFFF < 2^32).
QCONF_HD uint16_t f32_to_bf16_sr(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7f800000u) == 0x7f800000u)
    return static_cast<uint16_t>((u >> 16) | ((u & 0x7fffffffu) > 0x7f800000u ? 0x40u : 0u));
  uint32_t v = (u + r16) & 0xffff0000u;
  if ((v & 0x7f800000u) == 0x7f800000u) v = (u & 0x80000000u) | 0x7f7f0000u;
  return static_cast<uint16_t>(v >> 16);
}

// fp16: the neighbour away from zero with probability (|x| - |lo|) / ulp, lo = x truncated
// toward zero; all differences are exact in fp32.
QCONF_HD uint16_t f32_to_f16_sr(float x, float u) {
  const uint16_t h = f32_to_f16_rne(x);
  if ((f32_bits(x) & 0x7f800000u) == 0x7f800000u) return h;  // NaN / Inf
  const uint16_t sign = h & 0x8000u, mag = h & 0x7fffu;
  const float ax = bits_f32(f32_bits(x) & 0x7fffffffu);
  const uint16_t lo = f16_to_f32(mag) > ax ? static_cast<uint16_t>(mag - 1) : mag;
  const float lo_v = f16_to_f32(lo);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  if (lo_v == ax || hi >= 0x7c00u) return static_cast<uint16_t>(sign | lo);
  const float p_up = (ax - lo_v) / (f16_to_f32(hi) - lo_v);
  return static_cast<uint16_t>(sign | (u < p_up ? hi : lo));
}

// ---------------------------------------------------------------------------------------------
// counter-based random numbers (qconf/codec/rng.py)
QCONF_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The keys of one random stream, and `offset`: the stream index of the tensor's element 0 (a
// shard's start in its global parameter, so that a shard draws the bits of its global elements;
// 0 for a whole tensor). Element i of the tensor draws element i + offset of the stream.
struct StreamKey {
  uint32_t k0, k1;
  uint64_t offset;
};

// Keys of the random stream for (seed, step, tensor, stream); same chain as rng.stream_key.
QCONF_HD StreamKey stream_key(uint64_t seed, uint64_t step, uint64_t tensor, uint64_t stream) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ step);
  h = splitmix64(h ^ tensor);
  h = splitmix64(h ^ stream);
  return StreamKey{static_cast<uint32_t>(h), static_cast<uint32_t>(h >> 32), 0};
}

// "lowbias32" integer hash (U = uint32_t or a vector of uint32 lanes): mix32_tail(x ^ (x >> 16)).
template <class U>
QCONF_HD U mix32_tail(U x) {  // its last four steps
  x = x * U(0x7feb352du);
  x = x ^ (x >> 15);
  x = x * U(0x846ca68bu);
  return x ^ (x >> 16);
}

template <class U>
QCONF_HD U mix32(U x) {
  return mix32_tail<U>(x ^ (x >> 16));
}

// The stream's hash mix32(mix32(a) ^ b) of element bits a (low word ^ k0) and b (high word + k1),
// with b given as fold_high(b) = b ^ (b >> 16), the same for every element of a run. The inner
// hash ends r ^ (r >> 16) and the outer starts z ^ (z >> 16); for z = r ^ (r >> 16) ^ b,
// z >> 16 = (r >> 16) ^ (b >> 16), so z ^ (z >> 16) = r ^ fold_high(b): four operations fewer.
template <class U>
QCONF_HD U fold_high(U b) {
  return b ^ (b >> 16);
}

template <class U>
QCONF_HD U hash_pair(U a, U b_folded) {
  U r = a ^ (a >> 16);
  r = r * U(0x7feb352du);
  r = r ^ (r >> 15);
  r = r * U(0x846ca68bu);
  return mix32_tail<U>(r ^ b_folded);
}

// 32 random bits of stream element g (qconf/codec/rng.py hash_at).
QCONF_HD uint32_t hash_at(StreamKey k, uint64_t g) {
  return hash_pair<uint32_t>(static_cast<uint32_t>(g) ^ k.k0, fold_high<uint32_t>(static_cast<uint32_t>(g >> 32) + k.k1));
}

// 32 random bits for element i of a tensor: element i + k.offset of its stream.
QCONF_HD uint32_t hash_bits(StreamKey k, uint64_t i) { return hash_at(k, i + k.offset); }

// 16 random bits for element i of a tensor, in the top half (rng.pair_halves): stream element
// g = i + k.offset takes the top half of hash_at(g >> 1) when g is even, its low half when odd,
// so one hash serves two elements (bf16 stochastic rounding needs 16 bits).
QCONF_HD uint32_t half_bits(StreamKey k, uint64_t i) {
  const uint64_t g = i + k.offset;
  const uint32_t h = hash_at(k, g >> 1);
  return (g & 1u) ? h << 16 : h;
}

// The random bits of element i of a parameter's stream (qconf/optim/weights.py param_bits): for
// bf16 half_bits, for fp16 hash_bits (its uniform takes 24 bits).
QCONF_HD uint32_t param_bits(StreamKey k, uint64_t i, bool bf16) { return bf16 ? half_bits(k, i) : hash_bits(k, i); }

// Uniform in [0, 1) with 24-bit resolution (exact in fp32).
QCONF_HD float uniform01(uint32_t bits) { return static_cast<float>(bits >> 8) * 5.9604644775390625e-08f; }

// ---------------------------------------------------------------------------------------------
// Writing an fp32 result into a bf16 / fp16 parameter (qconf/optim/weights.py); `h` is the
// element's random bits of the parameter stream (param_bits: bf16 SR uses the top 16, fp16 SR a
// uniform of 24).
QCONF_HD float half_to_f32(uint16_t v, bool bf16) { return bf16 ? bf16_to_f32(v) : f16_to_f32(v); }

QCONF_HD uint16_t round_half(float x, bool bf16, bool sr, uint32_t h) {
  if (bf16) return sr ? f32_to_bf16_sr(x, h >> 16) : f32_to_bf16_rne(x);
  return sr ? f32_to_f16_sr(x, uniform01(h)) : f32_to_f16_rne(x);
}

// Kahan-compensated write: c1 = c + (p_new - p_old); p = round(p_old + c1); c = c1 + (p_old - p),
// so `comp` keeps the part of the update that rounding dropped. Returns the new parameter bits.
QCONF_HD uint16_t kahan_write(float p_new, uint16_t p_old_bits, float& comp, bool bf16, bool sr, uint32_t h) {
  const float po = half_to_f32(p_old_bits, bf16);
  const float c1 = comp + (p_new - po);
  const uint16_t r = round_half(po + c1, bf16, sr, h);
  comp = c1 + (po - half_to_f32(r, bf16));
  return r;
}

// ---------------------------------------------------------------------------------------------
// scales
constexpr float kFltMin = 1.1754943508222875e-38f;  // 2^-126

// |x| as an int for max reductions: for non-negative floats the integer order is the float order.
QCONF_HD uint32_t abs_bits(float x) { return f32_bits(x) & 0x7fffffffu; }

// abs_bits of a finite x, 0 for NaN and +-Inf: a scale is the absmax over the block's finite
// elements only (qconf/codec/scales.py), so one non-finite element never changes the scale, and
// with it the codes, of the other elements of its block.
QCONF_HD uint32_t finite_abs_bits(float x) {
  const uint32_t b = abs_bits(x);
  return b < 0x7f800000u ? b : 0u;
}

// Stored scale from the max of finite_abs_bits over a block (so always finite): a nonzero value
// below FLT_MIN becomes FLT_MIN, so its reciprocal is finite.
QCONF_HD float scale_from_absmax_bits(uint32_t m) {
  const float s = bits_f32(m);
  return (m != 0 && s < kFltMin) ? kFltMin : s;
}

// g * g for a factored second moment's row / column statistics, 0 where it is not finite (the
// square of a NaN / Inf gradient, or of one above ~1.8e19, which overflows): one such element
// leaves the statistics -- shared by its whole row and column -- as if its gradient were 0,
// instead of turning them Inf / NaN (qconf/optim/adam.py).
QCONF_HD float finite_square(float g) {
  const float s = g * g;
  return s <= 3.40282347e+38f ? s : 0.0f;  // FLT_MAX; false for NaN
}

// Two-pass states: the absmax bits of scale j, the max over `parts` partial arrays of
// `num_scales` each (the CPU's threads; the CUDA kernels reduce into one).
QCONF_HD uint32_t combine_partials(const uint32_t* partial, int64_t num_scales, int parts, int64_t j) {
  uint32_t m = 0;
  for (int k = 0; k < parts; ++k) {
    const uint32_t b = partial[k * num_scales + j];
    m = b > m ? b : m;
  }
  return m;
}

// Stored scale j and its reciprocal from the absmax bits `m` of its block's finite new values
// (the FLT_MIN floor of scale_from_absmax_bits is applied here). The split CPU step
// (fused_step_cpu_reduce / _apply) calls it with maxima that may have been combined across ranks.
QCONF_HD void finalize_scale_bits(uint32_t m, int64_t j, float* recip, float* scale) {
  const float s = scale_from_absmax_bits(m);
  recip[j] = qdiv(1.0f, s);
  scale[j] = s;
}

// Two-pass states: stored scale j and its reciprocal from the threads' partial absmax bits.
QCONF_HD void finalize_scale(const uint32_t* partial, int64_t num_scales, int parts, int64_t j, float* recip,
                             float* scale) {
  finalize_scale_bits(combine_partials(partial, num_scales, parts, j), j, recip, scale);
}

// ---------------------------------------------------------------------------------------------
// quantization (scalar forms; simd.h has the vector forms with the same results)

// How nearest rounding finds a code: the binary search over the midpoints, or one of two
// arithmetic shortcuts that the codec table enables only where they are exact for every input
// (the midpoint grid, the octave lines: qconf/codec/native.py). The CPU's FastQuantizer and the
// specialized CUDA step (spec.h) take it as a template parameter.
// (kNearSegments*: the segment lines, qconf/codec/segment_lines.py; only the AVX2 kernels'
// FastQuantizer takes them.)
enum Near : int {
  kNearSearch = 0,
  kNearGrid = 1,
  kNearLinesUnsigned = 2,
  kNearLinesSigned = 3,
  kNearSegmentsUnsigned = 4,
  kNearSegmentsSigned = 5
};
//
// Tables are padded to 256 entries: `mids` holds the L-1 fp32 midpoints then +inf, `qsearch` the
// L map values then +inf, `qmap` the L map values (codes never exceed L-1).

// #{k : t[k] < n} (LE = false) or #{k : t[k] <= n} (LE = true) over a sorted table of 2^bits
// entries (padded with +inf) by a branchless binary search. T: a pointer, or a table view with
// the same arithmetic (the specialized CUDA step's shared-memory tables, spec_octet.h). The
// search walks the view: each probe is at a constant offset from it, so on the GPU a probe is one
// load with an immediate offset, a compare and a select.
template <bool LE, class T>
QCONF_HD int search_count(float n, const T& table, int bits) {
  const auto first = table + 0;  // (an array decays to its pointer)
  auto t = first;
  for (int step = 1 << (bits - 1); step > 0; step >>= 1) {
    const float v = t[step - 1];
    t = t + ((LE ? v <= n : v < n) ? step : 0);
  }
  return static_cast<int>(t - first);
}

// Nearest: #{k : mids[k] < n}. NaN -> 0.
template <class T>
QCONF_HD int quantize_nearest(float n, const T& mids, int bits) {
  return search_count<false>(n, mids, bits);
}

// Stochastic rounding of n between the bracketing codes, with probability proportional to
// proximity, given count_le(x) = #{k : qsearch[k] <= x} (any exact search of the map padded with
// +inf) and the map qmap (any table with operator[]).
template <class T, class CountLe>
QCONF_HD int stochastic_code(float n, float u, const T& qmap, int levels, const CountLe& count_le) {
  if (n != n) return 0;
  const float lo_v = qmap[0], hi_v = qmap[levels - 1];
  n = n < lo_v ? lo_v : n;
  n = n > hi_v ? hi_v : n;
  int lo = count_le(n) - 1;
  lo = lo < 0 ? 0 : lo;
  lo = lo > levels - 2 ? levels - 2 : lo;
  const float q_lo = qmap[lo], q_hi = qmap[lo + 1];
  const float p_up = (n - q_lo) / (q_hi - q_lo);  // zero-width interval: NaN, never rounds up
  return lo + (u < p_up ? 1 : 0);
}

// count_le of stochastic_code by the binary search of a table
template <class T>
struct SearchLe {
  const T& t;
  int bits;
  QCONF_HD int operator()(float x) const { return search_count<true>(x, t, bits); }
};

// Stochastic: round between the bracketing codes with probability proportional to proximity.
template <class T>
QCONF_HD int quantize_stochastic(float n, float u, const T& qmap, const T& qsearch, int levels, int bits) {
  return stochastic_code(n, u, qmap, levels, SearchLe<T>{qsearch, bits});
}

// kNearGrid (scalar form of the CPU's FastQuantizer): midpoints exactly (k + c) / L with L a
// power of two, so the nearest code of a normalized n is ceil(n * L - c) clamped to [0, top],
// each step exact in fp32 (docs/kernels.md, "Code search"). A NaN n gets code 0, as 0 does on
// these maps (mids[0] > 0), so the normalizer need not map NaN to 0 first.
QCONF_HD int quantize_grid(float n, float L, float c, float top) {
  float y = n * L - c;
#if defined(__CUDA_ARCH__)
  y = fminf(fmaxf(y, 0.0f), top);  // fmaxf(NaN, 0) = 0
  return __float2int_ru(y);
#else
  y = __builtin_fminf(__builtin_fmaxf(y, 0.0f), top);
  return static_cast<int>(__builtin_ceilf(y));
#endif
}

// kNearLines* (scalar form): per octave of |n| the smaller of two lines estimates the code within
// one below the answer (qconf/codec/octave_lines.py proves it for every float32), one probe of
// the midpoints finishes it. line_octave gives a = |n| (signed maps) or n (unsigned), capped
// below 2 and floored at 2^-31, and its octave (biased exponent mod 32) in the line tables.
template <bool SIGNED>
QCONF_HD int line_octave(float n, float& a) {
  if (SIGNED) {  // the octave of max(a, 2^-31): the exponent floored at 96, without an integer max
    const float m = bits_f32(f32_bits(n) & 0x7fffffffu);
    a = 1.99999988f < m ? 1.99999988f : m;
    const float floored = a > 4.65661287e-10f ? a : 4.65661287e-10f;
    return static_cast<int>((f32_bits(floored) >> 23) & 31u);
  }
  a = n > 4.65661287e-10f ? n : 4.65661287e-10f;
  a = 1.99999988f < a ? 1.99999988f : a;
  return static_cast<int>((f32_bits(a) >> 23) & 31u);
}

// The nearest code of a normalized n (not NaN) from the octave's lines (s1, a1), (s2, a2) and the
// mirror K of signed maps.
template <bool SIGNED, class T>
QCONF_HD int quantize_lines(float n, float a, float s1, float a1, float s2, float a2, float mirror, const T& mids) {
  const float j1 = qfma(a, s1, a1), j2 = qfma(a, s2, a2);
#if defined(__CUDA_ARCH__)
  float j = fminf(j1, j2);  // (a is never NaN, so neither is j: fminf is j1 < j2 ? j1 : j2)
#else
  float j = j1 < j2 ? j1 : j2;
#endif
  if (SIGNED && n < 0.0f) j = mirror - j;
#if defined(__CUDA_ARCH__)
  int r = __float2int_rn(j);
#else
  int r = static_cast<int>(__builtin_rintf(j));
#endif
  // a signed map's mirror of a value just below -1 (x * (1 / x) may round one ulp past 1) or of
  // -inf lands below 0: code 0, as the CPU's vector form clamps it
  if (SIGNED) r = r > 0 ? r : 0;
  return r + (mids[r] < n ? 1 : 0);
}

// Normalize with a reciprocal scale: r = inf marks a zero scale (the block's finite elements are
// all zero); a NaN element normalizes to 0, so it takes the code nearest 0 (+-Inf elements give
// +-Inf: the end codes).
QCONF_HD float normalize(float x, float r) {
  const float n = f32_bits(r) == 0x7f800000u ? 0.0f : x * r;
  return n != n ? 0.0f : n;
}

// fmin/fmax that ignore NaN (like torch.fmin/fmax): used to combine rank-1 per-dim scales.
QCONF_HD float fmin_nan(float a, float b) { return a != a ? b : (b != b ? a : (b < a ? b : a)); }
QCONF_HD float fmax_nan(float a, float b) { return a != a ? b : (b != b ? a : (b > a ? b : a)); }

// ---------------------------------------------------------------------------------------------
// update rules: one correctly rounded fp32 operation per step, in the reference order.
// T is float (scalar CPU path, CUDA) or a SIMD vector.

struct Scalars {
  float lr, b1, omb1, b2, omb2, eps, wd, decay, step_size, inv_bc2_sqrt, momentum, omdamp;
  // Muon's two lerps (step_host.h set_muon_lerps): weight, weight - 1, whether |weight| < 0.5
  float buf_w, buf_wm1, nes_w, nes_wm1;
  int32_t maximize, has_wd, decoupled, nesterov, has_momentum, first, buf_small, nes_small;
};

// Adam / AdamW. With a factored second moment `v` is the reconstructed value and is not stored.
// Each rule: kStates states; apply() updates p and the states in place. A state's new value
// depends only on the gradient, the parameter and that state (the two-pass reduction relies on
// it: it recomputes one state without the others).
struct AdamRule {
  static constexpr int kStates = 2;
  template <class T>
  QCONF_HD static void apply(T& p, T g, T& m, T& v, const Scalars& h, bool update_v = true) {
    if (h.maximize) g = -g;
    if (h.has_wd) {
      if (h.decoupled) p = p * T(h.decay);
      else g = g + p * T(h.wd);
    }
    moments_and_step(p, g, m, v, h, update_v);
  }
  // Whether apply_plain gives apply's results: no maximize, no coupled L2 decay, v updated.
  static constexpr bool kHasPlain = true;
  QCONF_HD static bool plain(const Scalars& h, bool update_v) {
    return !h.maximize && !(h.has_wd && !h.decoupled) && update_v;
  }
  // apply() without its branches, for a loop that checked plain() once: p * decay is p itself
  // without weight decay (decay = 1 - lr * 0 = 1 exactly, and x * 1 = x for every float).
  template <class T>
  QCONF_HD static void apply_plain(T& p, T g, T& m, T& v, const Scalars& h) {
    p = p * T(h.decay);
    moments_and_step(p, g, m, v, h, true);
  }
  // The moments' update and the step, after the gradient and the decay (apply, apply_plain).
  template <class T>
  QCONF_HD static void moments_and_step(T& p, T g, T& m, T& v, const Scalars& h, bool update_v) {
    m = m * T(h.b1) + g * T(h.omb1);
    if (update_v) v = v * T(h.b2) + (g * g) * T(h.omb2);
    const T d = qsqrt(v) * T(h.inv_bc2_sqrt) + T(h.eps);
    p = p - qdiv(m, d) * T(h.step_size);
  }
  // Whether the states' new values read the parameter (coupled L2 decay adds p * wd to g).
  QCONF_HD static bool states_read_param(const Scalars& h) { return h.has_wd && !h.decoupled; }
  // The gradient the second moment sees (for the factored statistics).
  template <class T>
  QCONF_HD static T effective_grad(T p, T g, const Scalars& h) {
    if (h.maximize) g = -g;
    if (h.has_wd && !h.decoupled) g = g + p * T(h.wd);
    return g;
  }
};

// SGD with momentum / dampening / Nesterov; state 0 is the momentum buffer.
struct SgdRule {
  static constexpr int kStates = 1;
  static constexpr bool kHasPlain = false;  // (AdamRule::apply_plain)
  QCONF_HD static bool states_read_param(const Scalars& h) { return h.has_wd; }
  template <class T>
  QCONF_HD static void apply(T& p, T g, T& b, T& /*unused*/, const Scalars& h, bool = true) {
    if (h.maximize) g = -g;
    if (h.has_wd) g = g + p * T(h.wd);
    if (h.has_momentum) {
      if (h.first) b = g;
      else b = b * T(h.momentum) + g * T(h.omdamp);
      if (h.nesterov) g = g + b * T(h.momentum);
      else g = b;
    }
    p = p - g * T(h.lr);
  }
};

// Lion; state 0 is the momentum.
struct LionRule {
  static constexpr int kStates = 1;
  static constexpr bool kHasPlain = false;
  QCONF_HD static bool states_read_param(const Scalars&) { return false; }
  template <class T>
  QCONF_HD static void apply(T& p, T g, T& m, T& /*unused*/, const Scalars& h, bool = true) {
    if (h.maximize) g = -g;
    if (h.has_wd) p = p * T(h.decay);
    const T c = m * T(h.b1) + g * T(h.omb1);
    p = p - qsign(c) * T(h.lr);
    m = m * T(h.b2) + g * T(h.omb2);
  }
};

// torch.lerp(start, end, w) as torch's CPU kernel computes it (vectorized and scalar loops alike):
// d = end - start, then fma(w, d, start) for |w| < 0.5, else fma(w - 1, d, end) (w, w - 1 fp32).
template <class T>
QCONF_HD T lerp_as_torch(T start, T end, float w, float wm1, int32_t small) {
  const T d = end - start;
  return small ? qfma(T(w), d, start) : qfma(T(wm1), d, end);
}

// Muon, first call: state 0 is the momentum buffer, and `p` receives the update that
// Newton-Schulz orthogonalizes (the caller passes a scratch tensor as the parameter: the rule
// never reads it). torch.optim.Muon: buf.lerp_(g, 1 - momentum); update = g.lerp(buf, momentum)
// with Nesterov, else buf.
struct MuonMomentumRule {
  static constexpr int kStates = 1;
  static constexpr bool kHasPlain = false;
  QCONF_HD static bool states_read_param(const Scalars&) { return false; }
  template <class T>
  QCONF_HD static void apply(T& p, T g, T& b, T& /*unused*/, const Scalars& h, bool = true) {
    b = lerp_as_torch(b, g, h.buf_w, h.buf_wm1, h.buf_small);
    if (h.nesterov) p = lerp_as_torch(g, b, h.nes_w, h.nes_wm1, h.nes_small);
    else p = b;
  }
};

// Muon, second call: `g` is the orthogonalized update O; decoupled decay with the group's lr,
// then the step with the shape-adjusted lr, as torch's param.mul_(1 - lr * wd) and
// param.add_(O, alpha=-adjusted_lr) (a fused multiply-add in torch's CPU kernel).
struct MuonUpdateRule {
  static constexpr int kStates = 1;  // (none present: the Kahan buffer only)
  static constexpr bool kHasPlain = false;
  QCONF_HD static bool states_read_param(const Scalars&) { return false; }
  template <class T>
  QCONF_HD static void apply(T& p, T g, T& /*unused*/, T& /*unused*/, const Scalars& h, bool = true) {
    p = p * T(h.decay);
    p = qfma(g, T(-h.step_size), p);
  }
};

}  // namespace qconf
