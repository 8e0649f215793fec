// One thread's work in the specialized CUDA step (spec.h): its octet of elements loaded,
// dequantized, updated by the rule, and quantized and stored again. Every function here is
// __host__ __device__ and calls element.h for every arithmetic step, so the host tests
// (tests/test_spec_host.py) run exactly what a GPU thread runs; only the exchanges between
// threads (group and row maxima, spec_kernel.cuh) are device code, and the host emulator models
// them.
//
// FULL: the octet has kElems elements or none (a thread past its unit's rows), and loads and
// stores are 16-byte vectors on the GPU; otherwise the last octet of a tensor, cnt < kElems, one
// element at a time.
#pragma once

#include "qconf/spec.h"

#if !defined(__CUDACC_RTC__) && !defined(__CUDA_ARCH__)
#include <stdexcept>
#include <string>
#endif

namespace qconf {
namespace spec {

// ---------------------------------------------------------------------------------------------
// what only a GPU would notice, checked by the host model (tests/test_spec_host.py): a vector
// access needs its width's alignment (the host copies with memcpy, which takes any), and a warp
// shuffle (Lanes16) must be executed by every lane of the warp (the host runs threads in turn).
// Both are nothing on the GPU.

#if !defined(__CUDA_ARCH__)
// Warp shuffles this host thread has modelled (Lanes16 lookups); spec_emulate.h compares the
// counts of a warp's lanes.
inline uint64_t& host_shuffles() {
  static thread_local uint64_t n = 0;
  return n;
}
#endif

// A vector access of BYTES bytes at p (a GPU needs p aligned to BYTES).
template <int BYTES>
QCONF_HD void expect_aligned(const void* p) {
#if !defined(__CUDA_ARCH__)
  if ((reinterpret_cast<uintptr_t>(p) & (BYTES - 1)) != 0)
    throw std::runtime_error("spec kernels: a " + std::to_string(BYTES) + "-byte vector access at an address " +
                             std::to_string(reinterpret_cast<uintptr_t>(p) & 15u) +
                             " bytes past 16-byte alignment (a misaligned address on the GPU)");
#else
  (void)p;
#endif
}

// ---------------------------------------------------------------------------------------------
// memory: N (4 or 8) values of a float32 / bfloat16 / float16 tensor, and the packed codes of an
// octet. `cnt` is the number of elements that exist from e on. FULL: cnt is at least N, or at most
// 0 for a thread without elements, which reads the unit's first octet instead (valid memory, its
// results unused) and stores nothing; the GPU accesses are whole vectors. Otherwise one element at
// a time, up to cnt.

// A word of type W at p (any alignment on the host; the kernels' addresses are W-aligned).
template <class W>
QCONF_HD W load_word(const void* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const W*>(p);
#else
  expect_aligned<sizeof(W)>(p);
  W w;
  std::memcpy(&w, p, sizeof(W));
  return w;
#endif
}

template <class W>
QCONF_HD void store_word(void* p, W w) {
#if defined(__CUDA_ARCH__)
  *static_cast<W*>(p) = w;
#else
  expect_aligned<sizeof(W)>(p);
  std::memcpy(p, &w, sizeof(W));
#endif
}

// Whole-octet (FULL) accesses are vector loads and stores on the GPU (the `if constexpr (FULL)`
// branches inside #if __CUDA_ARCH__), element loops on the host.

// N 16-bit patterns from element e (zero past cnt).
template <int N, bool FULL>
QCONF_HD void load_bits16(const void* base, int64_t e, int cnt, uint16_t out[N]) {
  const uint16_t* s = static_cast<const uint16_t*>(base) + e;
  if constexpr (FULL) expect_aligned<2 * N>(s);
#if defined(__CUDA_ARCH__)
  if constexpr (FULL) {
    uint32_t w[N / 2];
    if constexpr (N == 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(s);
      w[0] = v.x; w[1] = v.y; w[N / 2 - 2] = v.z; w[N / 2 - 1] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(s);
      w[0] = v.x; w[1] = v.y;
    }
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      out[2 * j] = static_cast<uint16_t>(w[j] & 0xffffu);
      out[2 * j + 1] = static_cast<uint16_t>(w[j] >> 16);
    }
  } else
#endif
  {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = j < cnt ? s[j] : static_cast<uint16_t>(0);
  }
}

// N values of a float32 / bfloat16 / float16 tensor from element e as fp32 (zero past cnt).
template <int DT, int N, bool FULL>
QCONF_HD void load_values(const void* base, int64_t e, int cnt, float out[N]) {
  if constexpr (DT == kF32) {
    const float* s = static_cast<const float*>(base) + e;
    if constexpr (FULL) expect_aligned<16>(s);
#if defined(__CUDA_ARCH__)
    if constexpr (FULL) {
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        const float4 v = reinterpret_cast<const float4*>(s)[q];
        out[4 * q] = v.x; out[4 * q + 1] = v.y; out[4 * q + 2] = v.z; out[4 * q + 3] = v.w;
      }
    } else
#endif
    {
#pragma unroll
      for (int j = 0; j < N; ++j) out[j] = j < cnt ? s[j] : 0.0f;
    }
  } else {
    uint16_t h[N];
    load_bits16<N, FULL>(base, e, cnt, h);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = half_to_f32(h[j], DT == kBF16);
  }
}

// N fp32 values stored to an fp32 tensor, or N 16-bit patterns to a 16-bit one (up to cnt;
// nothing for a thread without elements).
template <int N, bool FULL>
QCONF_HD void store_f32(void* base, int64_t e, int cnt, const float in[N]) {
  float* d = static_cast<float*>(base) + e;
  if constexpr (FULL)
    if (cnt > 0) expect_aligned<16>(d);
#if defined(__CUDA_ARCH__)
  if constexpr (FULL) {
    if (cnt <= 0) return;
#pragma unroll
    for (int q = 0; q < N / 4; ++q)
      reinterpret_cast<float4*>(d)[q] = make_float4(in[4 * q], in[4 * q + 1], in[4 * q + 2], in[4 * q + 3]);
  } else
#endif
  {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < cnt) d[j] = in[j];
  }
}

template <int N, bool FULL>
QCONF_HD void store_u16(void* base, int64_t e, int cnt, const uint16_t in[N]) {
  uint16_t* d = static_cast<uint16_t*>(base) + e;
  if constexpr (FULL)
    if (cnt > 0) expect_aligned<2 * N>(d);
#if defined(__CUDA_ARCH__)
  if constexpr (FULL) {
    uint32_t w[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) w[j] = static_cast<uint32_t>(in[2 * j]) | (static_cast<uint32_t>(in[2 * j + 1]) << 16);
    if (cnt <= 0) return;
    if constexpr (N == 8) *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[N / 2 - 2], w[N / 2 - 1]);
    else *reinterpret_cast<uint2*>(d) = make_uint2(w[0], w[1]);
  } else
#endif
  {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < cnt) d[j] = in[j];
  }
}

// The 16-bit patterns (nearest even) of N fp32 values in dtype DT, two per word (value 2i in the
// low half of word i), by element.h's conversions.
template <int DT, int N>
QCONF_HD void round_words_exact(const float in[N], uint32_t out[N / 2]) {
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    const uint16_t a = DT == kBF16 ? f32_to_bf16_rne(in[2 * j]) : f32_to_f16_rne(in[2 * j]);
    const uint16_t b = DT == kBF16 ? f32_to_bf16_rne(in[2 * j + 1]) : f32_to_f16_rne(in[2 * j + 1]);
    out[j] = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
  }
}

// round_words_exact of four values, out of line on the GPU: the rare values the hardware
// conversion does not take (below).
template <int DT>
QCONF_COLD uint64_t round4_cold(float a, float b, float c, float d) {
  const float in[4] = {a, b, c, d};
  uint32_t w[2];
  round_words_exact<DT, 4>(in, w);
  return static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 32);
}

// round_words_exact, on the GPU by the hardware's conversion (two values per instruction), which
// gives the same bits for every value but NaN, whose sign and payload element.h keeps: a quad
// holding a NaN takes element.h.
template <int DT, int N>
QCONF_HD void round_words(const float in[N], uint32_t out[N / 2]) {
#if defined(__CUDA_ARCH__)
  static_assert(N % 4 == 0, "whole quads");
#pragma unroll
  for (int q = 0; q < N; q += 4) {
    uint32_t lo, hi;  // the upper half converts the first operand
    if (DT == kBF16) {
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(in[q + 1]), "f"(in[q]));
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(in[q + 3]), "f"(in[q + 2]));
    } else {
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(in[q + 1]), "f"(in[q]));
      asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(in[q + 3]), "f"(in[q + 2]));
    }
    uint32_t nan;  // whether the quad holds a NaN: two unordered compares of pairs
    asm("{\n .reg .pred p;\n setp.nan.f32 p, %1, %2;\n setp.nan.or.f32 p, %3, %4, p;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(nan) : "f"(in[q]), "f"(in[q + 1]), "f"(in[q + 2]), "f"(in[q + 3]));
    if (nan) {
      const uint64_t w = round4_cold<DT>(in[q], in[q + 1], in[q + 2], in[q + 3]);
      lo = static_cast<uint32_t>(w);
      hi = static_cast<uint32_t>(w >> 32);
    }
    out[q / 2] = lo;
    out[q / 2 + 1] = hi;
  }
#else
  round_words_exact<DT, N>(in, out);
#endif
}

// N 16-bit patterns, two per word, stored from element e (up to cnt; nothing for a thread without
// elements).
template <int N, bool FULL>
QCONF_HD void store_words(void* base, int64_t e, int cnt, const uint32_t w[N / 2]) {
  uint16_t* d = static_cast<uint16_t*>(base) + e;
  if constexpr (FULL)
    if (cnt > 0) expect_aligned<2 * N>(d);
#if defined(__CUDA_ARCH__)
  if constexpr (FULL) {
    if (cnt <= 0) return;
    if constexpr (N == 8) *reinterpret_cast<uint4*>(d) = make_uint4(w[0], w[1], w[N / 2 - 2], w[N / 2 - 1]);
    else *reinterpret_cast<uint2*>(d) = make_uint2(w[0], w[1]);
  } else
#endif
  {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (j < cnt) d[j] = static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2)));
  }
}

// The word type of an octet of BITS-bit codes where it is one (1, 2, 4 or 8 bytes: kWhole).
template <int BITS>
struct CodeWord {
  static constexpr bool kWhole = false;
  using type = uint8_t;
};
template <> struct CodeWord<1> { static constexpr bool kWhole = true; using type = uint8_t; };
template <> struct CodeWord<2> { static constexpr bool kWhole = true; using type = uint16_t; };
template <> struct CodeWord<4> { static constexpr bool kWhole = true; using type = uint32_t; };
template <> struct CodeWord<8> { static constexpr bool kWhole = true; using type = uint64_t; };

// Eight codes of BITS bits as an octet's little-endian word (code j at bits [j * BITS, ...)). On
// the GPU whole bytes are assembled with byte permutes (PRMT): 8-bit codes 3 per 4 codes, 4-bit
// ones a shift-add per pair then the same, instead of a 64-bit shift and or per code.
template <int BITS>
QCONF_HD uint64_t pack_codes(const uint32_t c[kElems]) {
#if defined(__CUDA_ARCH__)
  if constexpr (BITS == 8 || BITS == 4) {
    uint32_t b[kElems];  // the octet's bytes (8-bit: a code each; 4-bit: b[0..3], two codes each)
#pragma unroll
    for (int j = 0; j < kElems; ++j) b[j] = BITS == 8 ? c[j] : (j < 4 ? c[2 * j] | (c[2 * j + 1] << 4) : 0u);
    const uint32_t lo = __byte_perm(__byte_perm(b[0], b[1], 0x1140), __byte_perm(b[2], b[3], 0x1140), 0x5410);
    if constexpr (BITS == 4) return lo;
    const uint32_t hi = __byte_perm(__byte_perm(b[4], b[5], 0x1140), __byte_perm(b[6], b[7], 0x1140), 0x5410);
    return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
  }
#endif
  uint64_t w = 0;
#pragma unroll
  for (int j = 0; j < kElems; ++j) w |= static_cast<uint64_t>(c[j]) << (j * BITS);
  return w;
}

// The low word of (hi:lo) >> s, s < 32 (one funnel shift on the GPU).
QCONF_HD uint32_t funnel_right(uint32_t lo, uint32_t hi, uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, s);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(hi) << 32 | lo) >> s);
#endif
}

// A whole octet of 3-, 5-, 6- or 7-bit codes is read as the 4-byte-aligned words that hold its
// bytes (two, or three where they straddle), shifted into place: a few loads instead of one per
// byte. The words may hold neighbouring octets' bytes, never memory of another page (an aligned
// word lies in one page; the buffer is 16-byte aligned, so the first word starts inside it); the
// second and third words are read only when the octet reaches into them.
//
// The BITS bytes of the octet starting at element e (a multiple of 8) as a little-endian word:
// element j's code is bits [j * BITS, (j + 1) * BITS). A partial octet has only its own bytes.
template <int BITS, bool FULL>
QCONF_HD uint64_t load_codes(const uint8_t* codes, int64_t e, int cnt) {
  const uint8_t* b = codes + (e >> 3) * BITS;
  using W = typename CodeWord<BITS>::type;
  if constexpr (FULL && CodeWord<BITS>::kWhole) {
    return load_word<W>(b);
  } else if constexpr (FULL) {
    const uint32_t skip = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(b) & 3u);
    const uint8_t* w = b - skip;
    const uint32_t w0 = load_word<uint32_t>(w);
    const uint32_t w1 = skip + BITS > 4 ? load_word<uint32_t>(w + 4) : 0u;
    const uint32_t w2 = skip + BITS > 8 ? load_word<uint32_t>(w + 8) : 0u;
    // bytes skip .. skip + BITS of w2:w1:w0
    const uint32_t lo = funnel_right(w0, w1, 8 * skip);
    if constexpr (BITS < 4) return lo & ((1u << (8 * BITS)) - 1u);
    else return static_cast<uint64_t>(funnel_right(w1, w2, 8 * skip) & ((1u << (8 * (BITS - 4))) - 1u)) << 32 | lo;
  } else {
    const int nbytes = FULL ? BITS : (cnt * BITS + 7) / 8;
    uint64_t w = 0;
#pragma unroll
    for (int k = 0; k < BITS; ++k)
      if (k < nbytes) w |= static_cast<uint64_t>(b[k]) << (8 * k);
    return w;
  }
}

template <int BITS, bool FULL>
QCONF_HD void store_codes(uint8_t* codes, int64_t e, int cnt, uint64_t w) {
  uint8_t* b = codes + (e >> 3) * BITS;
  using W = typename CodeWord<BITS>::type;
  if (FULL && cnt <= 0) return;
  if constexpr (FULL && CodeWord<BITS>::kWhole) {
    store_word<W>(b, static_cast<W>(w));
  } else if constexpr (FULL && BITS == 6) {  // (6 * octet bytes from a 2-byte aligned buffer)
#pragma unroll
    for (int k = 0; k < 3; ++k) store_word<uint16_t>(b + 2 * k, static_cast<uint16_t>(w >> (16 * k)));
  } else {
    const int nbytes = FULL ? BITS : (cnt * BITS + 7) / 8;
#pragma unroll
    for (int k = 0; k < BITS; ++k)
      if (k < nbytes) b[k] = static_cast<uint8_t>(w >> (8 * k));
  }
}

// ---------------------------------------------------------------------------------------------
// a quantized state's tables as a block holds them (shared memory on the GPU)

struct alignas(16) Quad {
  float x, y, z, w;
};

template <bool C, class A, class B>
struct Select {
  using type = A;
};
template <class A, class B>
struct Select<false, A, B> {
  using type = B;
};

// A table that a block holds in shared memory, as a lookup: on the GPU its shared-space address,
// so that t[i] is one LDS off the block's shared window in a uniform register (through a generic
// pointer the compiler recomputes the window's base around every lookup); on the host a pointer.
// Make it with table_of from the __shared__ variable itself.
template <class V>
struct Table {
  const V* p;
  uint32_t a;
  QCONF_HD Table operator+(int i) const { return Table{p + i, a + static_cast<uint32_t>(sizeof(V)) * i}; }
  QCONF_HD int64_t operator-(const Table& o) const { return p - o.p; }
  QCONF_HD V operator[](uint32_t i) const {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(V) == 16) {
      float4 v;
      asm("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a + 16u * i));
      return V{v.x, v.y, v.z, v.w};
    } else {
      float v;
      asm("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a + 4u * i));
      return v;
    }
#else
    return p[i];
#endif
  }
};

template <class V>
QCONF_HD Table<V> table_of(const V* t) {
#if defined(__CUDA_ARCH__)
  return Table<V>{t, static_cast<uint32_t>(__cvta_generic_to_shared(t))};
#else
  return Table<V>{t, 0u};
#endif
}

// normalize(x, r) (element.h) as x * normalize0(r), NaN -> 0: a zero scale (r = inf) normalizes
// every element to 0, and x * 0 is 0 for finite x and NaN (-> 0) otherwise.
QCONF_HD float normalize0(float r) { return f32_bits(r) == 0x7f800000u ? 0.0f : r; }

// A table of at most 16 entries spread over a warp's lanes, twice (lane l holds entry l % 16):
// t[i] is one SHFL with no address arithmetic and no memory access (the lane index is i mod 32, so
// the bits of i above bit 3 need no masking). Every lane of the warp must take part: the loops
// keep the warp converged. On the host, the entries.
struct Lanes16 {
  float v;
  const float* p;
  QCONF_HD float operator[](uint32_t i) const {
#if defined(__CUDA_ARCH__)
    return __shfl_sync(0xffffffffu, v, static_cast<int>(i));
#else
    ++host_shuffles();
    return p[i & 15u];
#endif
  }
};

// t = a row of a codec table in device memory (16 entries read)
QCONF_HD Lanes16 lanes16(const float* t) {
#if defined(__CUDA_ARCH__)
  return Lanes16{t[threadIdx.x & 15u], t};
#else
  return Lanes16{0.0f, t};
#endif
}

// A quantized state's tables as a block stores them in shared memory: the search table (and the
// map of codes wider than 4 bits; narrower maps live in the warp's lanes, Lanes16).
template <class St, bool Q = St::kQuantized>
struct StateTab {  // none
  QCONF_HD void fill(const float*, int, int) {}
};

template <class St>
struct StateTab<St, true> {
  static constexpr int kEntries = 1 << St::kBits;  // codes < levels <= 2^bits
  static constexpr bool kLines = St::kNearKind == kNearLinesUnsigned || St::kNearKind == kNearLinesSigned;
  float qmap[kEntries];
  float search[kEntries];        // the midpoints, +inf padded (nearest); the map, +inf padded (SR)
  Quad lines[kLines ? 32 : 1];   // per octave: S1, A1, S2, A2

  // Entries first, first + stride, ... from one codec table (layout.h kRow*); the block's threads
  // fill it together (first = tid, stride = threads).
  QCONF_HD void fill(const float* table, int first, int stride) {
    const float* search_row = table + (St::kStochastic ? kRowQsearch : kRowMids) * kTableSize;
    for (int i = first; i < kEntries; i += stride) {
      qmap[i] = table[kRowQmap * kTableSize + i];
      search[i] = search_row[i];
    }
    if (kLines) {
      const float* l = table + kRowLines * kTableSize;
      for (int i = first; i < 32; i += stride)
        lines[i] = Quad{l[kLinesSlope1 + i], l[kLinesOffset1 + i], l[kLinesSlope2 + i], l[kLinesOffset2 + i]};
    }
  }
};

// Whether a NaN normalized value already gets the code of 0 (the grid, the unsigned octave lines:
// their midpoints are all positive), so the normalizer need not map NaN to 0.
template <class St>
constexpr bool kNanAsZero = !St::kStochastic && (St::kNearKind == kNearGrid || St::kNearKind == kNearLinesUnsigned);

// How a thread reads a quantized state's tables: the map of at most 4-bit codes from the warp's
// lanes (dequantizing is one SHFL per element), wider maps and every search table from the
// block's shared StateTab (Table lookups), and the codec's scalars from the launch's parameters.
template <class St, bool Q = St::kQuantized>
struct StateLook {  // unquantized
  QCONF_HD StateLook() {}
  QCONF_HD StateLook(const StateTab<St>&, const SpecCodec&) {}
};

template <class St>
struct StateLook<St, true> {
  static constexpr bool kLines = StateTab<St>::kLines;
  using QmapTable = typename Select<(St::kBits <= 4), Lanes16, Table<float>>::type;
  QmapTable qmap;
  Table<float> search;
  Table<Quad> lines;
  const SpecCodec* cs;  // the launch's parameters
  QCONF_HD StateLook() {}
  QCONF_HD StateLook(const StateTab<St>& tab, const SpecCodec& c)
      : search(table_of(tab.search)), lines(table_of(tab.lines)), cs(&c) {
    if constexpr (St::kBits <= 4) qmap = lanes16(c.table + kRowQmap * kTableSize);
    else qmap = table_of(tab.qmap);
  }
  // The code of x with reciprocal scale r0 (normalize0) and uniform u (SR only): the code of
  // normalize(x, r) (element.h).
  QCONF_HD int code(float x, float r0, float u) const {
    float n = x * r0;
    if (!kNanAsZero<St>) n = n != n ? 0.0f : n;
    if (St::kStochastic) return stochastic_code(n, u, qmap, cs->levels, SearchLe<Table<float>>{search, St::kBits});
    if (St::kNearKind == kNearGrid) return quantize_grid(n, cs->grid_L, cs->grid_c, cs->top);
    if (kLines) {
      float a;
      const Quad q = lines[line_octave<St::kNearKind == kNearLinesSigned>(n, a)];
      return quantize_lines<St::kNearKind == kNearLinesSigned>(n, a, q.x, q.y, q.z, q.w, cs->mirror, search);
    }
    return quantize_nearest(n, search, St::kBits);
  }
};

// The tables of a spec's three states as a block stores them, and as its threads read them.
template <class S>
struct SpecTabs {
  StateTab<typename S::St0> t0;
  StateTab<typename S::St1> t1;
  StateTab<typename S::Comp> tc;
  QCONF_HD void fill(const SpecTables& src, int first, int stride) {
    t0.fill(src.c[0].table, first, stride);
    t1.fill(src.c[1].table, first, stride);
    tc.fill(src.c[2].table, first, stride);
  }
};

template <class S>
struct SpecLooks {
  StateLook<typename S::St0> t0;
  StateLook<typename S::St1> t1;
  StateLook<typename S::Comp> tc;
};

// The lookups of `tabs`: call it on the __shared__ variable itself (see Table).
template <class S>
QCONF_HD SpecLooks<S> looks_of(const SpecTabs<S>& tabs, const SpecTables& src) {
  SpecLooks<S> l;
  l.t0 = StateLook<typename S::St0>(tabs.t0, src.c[0]);
  l.t1 = StateLook<typename S::St1>(tabs.t1, src.c[1]);
  l.tc = StateLook<typename S::Comp>(tabs.tc, src.c[2]);
  return l;
}

// ---------------------------------------------------------------------------------------------
// one unit: the tensor's streams from the unit's first element on (warp-uniform)

// Everything a thread addresses in a unit, relative to its first element ub = row0 * cols + col0:
// the elements' streams at ub, a group state's scales at ub's group (units start on group
// boundaries), a rank-1 state's old scales, new reciprocals and absmax partials at the unit's
// first row and first column.
struct View {
  void* param;
  const void* grad;
  void* data[3];
  float* scales[3];            // group: scales + ub / GROUP; rank1: row scales + row0
  const float* cols_old[3];    // rank1: old column scales from col0
  const float* row_recip[3];   // rank1: 1 / new scale of the rows from row0 ...
  const float* col_recip[3];   // ... and of the columns from col0
  uint32_t* row_partial[3];    // rank1 (reduce pass): absmax bits of the rows from row0 ...
  uint32_t* col_partial[3];    // ... and of the columns from col0
  int64_t ub;
  int32_t cols;
};

template <int DT>
QCONF_HD constexpr int dtype_bytes() {
  return DT == kF32 ? 4 : 2;
}

template <class St, int PD>
QCONF_HD void view_state(const SpecArgs& a, const SpecTensor& t, const Unit& u, int k, View& v) {
  char* data = static_cast<char*>(t.data[k]);
  if constexpr (St::kKind == kFp32) v.data[k] = data + v.ub * 4;
  else if constexpr (St::kKind == kParamDtype) v.data[k] = data + v.ub * dtype_bytes<PD>();
  else if constexpr (St::kQuantized) v.data[k] = data + (v.ub / kElems) * St::kBits;
  if constexpr (St::kGroupScale) {
    v.scales[k] = t.scales[k] + v.ub / St::kGroup;
  } else if constexpr (St::kRank1Scale) {
    uint32_t* partial = a.partial + t.rank1_at[k];
    const float* recip = a.recip + t.rank1_at[k];
    v.scales[k] = t.scales[k] + u.row0;
    v.cols_old[k] = t.scales[k] + t.rows + u.col0;
    v.row_recip[k] = recip + u.row0;
    v.col_recip[k] = recip + t.rows + u.col0;
    v.row_partial[k] = partial + u.row0;
    v.col_partial[k] = partial + t.rows + u.col0;
  }
}

template <class S>
QCONF_HD View view_of(const SpecArgs& a, const SpecTensor& t, const Unit& u) {
  View v{};
  v.ub = u.row0 * t.cols + u.col0;
  v.cols = t.cols;
  v.param = static_cast<char*>(t.param) + v.ub * dtype_bytes<S::kPDtype>();
  v.grad = static_cast<const char*>(t.grad) + v.ub * dtype_bytes<S::kGDtype>();
  view_state<typename S::St0, S::kPDtype>(a, t, u, 0, v);
  view_state<typename S::St1, S::kPDtype>(a, t, u, 1, v);
  view_state<typename S::Comp, S::kPDtype>(a, t, u, 2, v);
  return v;
}

// The elements of a unit that exist, as an offset from ub: rows [0, nrows) of the strip, and the
// tensor's end (the last row of a tensor whose rows are kStrip elements may be partial).
QCONF_HD uint32_t unit_end(const SpecTensor& t, const Unit& u, const View& v) {
  const int64_t e = static_cast<int64_t>(u.nrows) * t.cols;
  const int64_t left = t.numel - v.ub;
  return static_cast<uint32_t>(e < left ? e : left);
}

// A thread's span of its unit: the loop bounds (a tensor whose last octet is partial -- rows of
// kStrip, one per iteration -- ends in the last iteration of its last unit, which runs after the
// loop with the element-wise loads) and the octet of each iteration.
struct UnitSpan {
  Place pl;
  uint32_t end, step;  // elements of the unit (offsets from ub) and per iteration
  int32_t iters;       // iterations of the loop (without the partial last octet)
  bool partial;
  uint32_t lo0;        // the thread's first offset

  QCONF_HD UnitSpan(const SpecTensor& t, const Unit& u, const View& v, int tid) {
    pl = place_of(u, tid);
    end = unit_end(t, u, v);
    step = static_cast<uint32_t>(u.rpi) * static_cast<uint32_t>(t.cols);
    partial = end % kElems != 0;
    iters = (u.nrows + u.rpi - 1) / u.rpi - (partial ? 1 : 0);
    lo0 = static_cast<uint32_t>(pl.rg) * static_cast<uint32_t>(t.cols) + pl.c8;
  }
  QCONF_HD uint32_t lo_at(int32_t it) const { return lo0 + static_cast<uint32_t>(it) * step; }
  QCONF_HD int32_t row_at(int32_t it, int32_t rpi) const { return pl.rg + it * rpi; }
};

// ---------------------------------------------------------------------------------------------
// one thread's octet

// Where the octet is: lo elements from the unit's first element (32-bit: unit_rows * cols < 2^31),
// in the unit's row r, at column offset c8 of the strip, with cnt elements (a thread without
// elements, cnt = 0, has lo = r = 0: see FULL above).
struct At {
  uint32_t lo;
  int32_t r, c8;
  int cnt;
};

// The octet of iteration `it` of the loop: whole, or none (then lo = r = 0, see above).
QCONF_HD At full_at(const UnitSpan& s, int32_t it, int32_t rpi) {
  const uint32_t lo = s.lo_at(it);
  const bool has = s.pl.active && lo < s.end;
  return At{has ? lo : 0u, has ? s.row_at(it, rpi) : 0, s.pl.c8, has ? kElems : 0};
}

// The octet after the loop of a unit whose last octet is partial (cnt elements, maybe 0).
QCONF_HD At partial_at(const UnitSpan& s, int32_t rpi) {
  const uint32_t lo = s.lo_at(s.iters);
  const uint32_t left = s.pl.active && lo < s.end ? s.end - lo : 0u;
  return At{lo, s.row_at(s.iters, rpi), s.pl.c8, static_cast<int>(left < kElems ? left : kElems)};
}

// The parameter stream's half_bits over one unit, one hash per pair of elements: stream element
// g = ub + offset + lo takes half of hash_at(g >> 1). Specs with pairs (Spec::kPairBits) take
// tensors whose g0 = ub + offset is even in every unit (an even offset: rows are multiples of 8
// elements, spec_key.h strip_ok) and whose pairs lie in one 2^32 window of pair indexes
// (spec_key.h pairs_aligned), so hash_at(q0 + lo / 2) = hash_pair((q0lo + lo / 2) ^ k0, b) with b
// fixed: 32-bit arithmetic per pair. Other tensors take the spec with kWeightsEachElement.
struct alignas(16) PairStream {
  uint32_t q0lo;  // low word of q0 = g0 >> 1
  uint32_t k0;    // the key's low word
  uint32_t b;     // fold_high(high word of q0 + k1)
};

QCONF_HD PairStream pair_stream(const StreamKey& k, uint64_t ub) {
  const uint64_t q0 = (ub + k.offset) >> 1;
  return PairStream{static_cast<uint32_t>(q0), k.k0, fold_high<uint32_t>(static_cast<uint32_t>(q0 >> 32) + k.k1)};
}

// The random streams of one tensor at this step (states 0 and 1, the parameter, the Kahan buffer),
// and the parameter stream's pairs over the unit at v.
struct Keys {
  StreamKey k[4];
  PairStream pair;
};

QCONF_HD Keys unit_keys(const SpecArgs& a, const SpecTensor& t, const View& v) {
  Keys keys;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    keys.k[s] = stream_key(a.seed, a.step, t.index, static_cast<uint64_t>(s));
    keys.k[s].offset = t.rng_offset;
  }
  keys.pair = pair_stream(keys.k[2], static_cast<uint64_t>(v.ub));
  return keys;
}

// How a rank-1 state's column scales and reciprocals are loaded: one element at a time (FULL
// false with a whole count), not as vectors. They follow the rows' entries (a tensor's stored
// scales are its rows' then its columns'; the reciprocals' scratch holds tensor after tensor), so
// they are 16-byte aligned only when the row counts happen to be multiples of 4: a (33, 128)
// tensor's column loads were misaligned addresses on the GPU.
constexpr bool kColumnLoads = false;

// The old values of a state, half an octet at a time (kHalf elements: the two halves of an octet
// are loaded and updated one after the other, so that half the registers carry them): fp32 /
// 16-bit values, or codes -> qmap[code] * old scale (the group's, or min(row, column) for rank1,
// NaN-ignoring as the CPU's walkers). begin() reads what the whole octet shares: its codes and
// its group's or row's scale.
constexpr int kHalf = kElems / 2;

template <class St, int PD, bool FULL>
struct OldState {
  uint64_t w = 0;
  float scale = 0.0f;
  QCONF_HD void begin(const View& v, int k, const At& at) {
    if constexpr (St::kQuantized) {
      w = load_codes<St::kBits, FULL>(static_cast<const uint8_t*>(v.data[k]), at.lo, at.cnt);
      scale = St::kGroupScale ? v.scales[k][at.lo / St::kGroup] : v.scales[k][at.r];
    }
  }
  QCONF_HD void half(const View& v, int k, const StateLook<St>& tab, const At& at, int h, float out[kHalf]) const {
    const uint32_t lo = at.lo + h * kHalf;
    const int cnt = at.cnt - h * kHalf;
    if constexpr (St::kKind == kFp32) {
      load_values<kF32, kHalf, FULL>(v.data[k], lo, cnt, out);
    } else if constexpr (St::kKind == kParamDtype) {
      load_values<PD, kHalf, FULL>(v.data[k], lo, cnt, out);
    } else if constexpr (St::kQuantized) {
      constexpr uint32_t mask = (1u << St::kBits) - 1u;
      float sc[kHalf];
      if constexpr (St::kGroupScale) {
#pragma unroll
        for (int j = 0; j < kHalf; ++j) sc[j] = scale;
      } else {
        float col[kHalf];  // element loads: see kColumnLoads
        load_values<kF32, kHalf, kColumnLoads>(v.cols_old[k], at.c8 + h * kHalf, kHalf, col);
#pragma unroll
        for (int j = 0; j < kHalf; ++j) sc[j] = fmin_nan(scale, col[j]);
      }
#pragma unroll
      for (int j = 0; j < kHalf; ++j)
        out[j] = tab.qmap[static_cast<uint32_t>(w >> ((h * kHalf + j) * St::kBits)) & mask] * sc[j];
    } else {
#pragma unroll
      for (int j = 0; j < kHalf; ++j) out[j] = 0.0f;
    }
  }
};

// The max of finite_abs_bits over n elements of an octet whose plain max of |x| was Inf: out of
// line (the values by value, in registers), so the main loop carries only its call.
QCONF_COLD uint32_t octet_finite_absmax(float x0, float x1, float x2, float x3, float x4, float x5, float x6,
                                        float x7, int n) {
  const float x[kElems] = {x0, x1, x2, x3, x4, x5, x6, x7};
  uint32_t b = 0;
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
    const uint32_t f = finite_abs_bits(x[j]);
    b = j < n && f > b ? f : b;
  }
  return b;
}

// The max of finite_abs_bits over the octet's elements (0 for elements past cnt): the max of
// |x| as floats (fmaxf ignores NaN; one instruction per element on the GPU), recomputed without
// the infinities only when it is one (a rare octet with an Inf element).
template <bool FULL>
QCONF_HD uint32_t octet_absmax(const float x[kElems], int cnt) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
#if defined(__CUDA_ARCH__)
    if (FULL || j < cnt) m = fmaxf(m, fabsf(x[j]));
#else
    if (FULL || j < cnt) m = __builtin_fmaxf(m, __builtin_fabsf(x[j]));
#endif
  }
  if (cnt <= 0) return 0;
  const uint32_t b = f32_bits(m);
  return b == 0x7f800000u ? octet_finite_absmax(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], FULL ? kElems : cnt)
                          : b;
}

// Codes of the octet's new values with the reciprocals of their new scales (normalize0'd), packed;
// the uniforms of stochastic rounding come from the state's stream at the elements' indices.
template <class St, bool FULL>
QCONF_HD uint64_t quantize_octet(const StateLook<St>& tab, const float x[kElems], const float r[kElems],
                                 const StreamKey& key, int64_t e, int cnt) {
  uint32_t c[kElems];
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
    const float u = St::kStochastic ? uniform01(hash_bits(key, static_cast<uint64_t>(e + j))) : 0.0f;
    // every element's code, then the ones past cnt dropped: stochastic rounding looks the map up
    // with warp shuffles (Lanes16), which every lane of the warp must execute, elements or not
    const uint32_t code = static_cast<uint32_t>(tab.code(x[j], r[j], u));
    c[j] = FULL || j < cnt ? code : 0u;
  }
  return pack_codes<St::kBits>(c);
}

// The new value of state k stored: fp32 / 16-bit values, or codes with the new scale -- a group's
// from its reduced absmax bits `m` (the group's first thread stores the scale: every thread of
// the group has read the old one before the reduction), a rank-1 state's from the reciprocals of
// the finalize kernel.
template <class St, int PD, bool FULL>
QCONF_HD void store_state(const View& v, int k, const StateLook<St>& tab, const At& at, const float x[kElems],
                          uint32_t m, const StreamKey& key) {
  if constexpr (St::kKind == kFp32) {
    store_f32<kElems, FULL>(v.data[k], at.lo, at.cnt, x);
  } else if constexpr (St::kKind == kParamDtype) {
    uint32_t w[kElems / 2];
    round_words<PD, kElems>(x, w);
    store_words<kElems, FULL>(v.data[k], at.lo, at.cnt, w);
  } else if constexpr (St::kQuantized) {
    float r[kElems];
    if constexpr (St::kGroupScale) {
      const float scale = scale_from_absmax_bits(m);
      const float rc = normalize0(qrcp(scale));
#pragma unroll
      for (int j = 0; j < kElems; ++j) r[j] = rc;
      if (at.lo % St::kGroup == 0 && at.cnt > 0) v.scales[k][at.lo / St::kGroup] = scale;
    } else {
      const float row = v.row_recip[k][at.r];
      float col[kElems];  // element loads: see kColumnLoads
      load_values<kF32, kElems, kColumnLoads>(v.col_recip[k], at.c8, kElems, col);
#pragma unroll
      for (int j = 0; j < kElems; ++j) r[j] = normalize0(fmax_nan(row, col[j]));
    }
    const uint64_t w = quantize_octet<St, FULL>(tab, x, r, key, v.ub + at.lo, at.cnt);
    store_codes<St::kBits, FULL>(static_cast<uint8_t*>(v.data[k]), at.lo, at.cnt, w);
  }
}

// The octet between its load and its stores: the states' new values and the Kahan buffer's (the
// new parameter is stored half by half as soon as it is known).
struct Octet {
  float s[3][kElems];
};

template <class S, bool FULL>
struct OldStates {
  OldState<typename S::St0, S::kPDtype, FULL> o0;
  OldState<typename S::St1, S::kPDtype, FULL> o1;
  OldState<typename S::Comp, S::kPDtype, FULL> oc;
};

// f32_to_bf16_sr of two values as a word, out of line on the GPU (round_bf16_sr's rare case).
QCONF_COLD uint32_t bf16_sr_pair_cold(float a, float b, uint32_t ra, uint32_t rb) {
  return f32_to_bf16_sr(a, ra) | static_cast<uint32_t>(f32_to_bf16_sr(b, rb)) << 16;
}

// half_bits of the unit's elements lo .. lo+N-1 (lo and N even) as N 16-bit values (PairStream).
template <int N>
QCONF_HD void half_bits_pairs(const PairStream& s, uint32_t lo, uint32_t r[N]) {
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    const uint32_t h = hash_pair<uint32_t>((s.q0lo + lo / 2 + j / 2) ^ s.k0, s.b);
    r[j] = h >> 16;
    r[j + 1] = h & 0xffffu;
  }
}

// Stochastic rounding of N fp32 values into bf16 (f32_to_bf16_sr with element lo + j's random
// bits, half_bits), as N / 2 words. When every magnitude is at most the largest finite bf16 (bits
// 0x7F7F0000), the top half of u + r16 is the answer: the sum cannot carry into the exponent's
// all-ones or the sign. Otherwise (NaN, infinities, larger values) element.h for each.
template <int N>
QCONF_HD void round_bf16_sr(const float x[N], const PairStream& s, uint32_t lo, uint32_t out[N / 2]) {
  uint32_t h[N];
  half_bits_pairs<N>(s, lo, h);
  bool plain = true;
#pragma unroll
  for (int j = 0; j < N; ++j) {
#if defined(__CUDA_ARCH__)
    plain &= fabsf(x[j]) <= 3.3895313892515355e38f;  // bits 0x7F7F0000 (false for NaN)
#else
    plain &= __builtin_fabsf(x[j]) <= 3.3895313892515355e38f;
#endif
  }
  if (plain) {
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      const uint32_t lo = f32_bits(x[j]) + h[j], hi = f32_bits(x[j + 1]) + h[j + 1];
#if defined(__CUDA_ARCH__)
      out[j / 2] = __byte_perm(lo, hi, 0x7632);  // the upper halves: lo's low, hi's high
#else
      out[j / 2] = (lo >> 16) | (hi & 0xffff0000u);
#endif
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; j += 2) out[j / 2] = bf16_sr_pair_cold(x[j], x[j + 1], h[j], h[j + 1]);
  }
}

// Half h of the octet: loads, the rule, the new parameter -- fp32, or for a 16-bit one rounded
// (nearest, stochastic, Kahan-compensated) -- stored.
template <class S, bool FULL>
QCONF_HD void compute_half(const SpecArgs& a, const SpecLooks<S>& tabs, const View& v, const Keys& keys,
                           const PairStream& pair, const At& at, int h, const OldStates<S, FULL>& old, Octet& o) {
  constexpr bool bf16 = S::kPDtype == kBF16;
  const uint32_t lo = at.lo + h * kHalf;
  const int cnt = at.cnt - h * kHalf;
  float g[kHalf], p[kHalf], s0[kHalf], s1[kHalf], c[kHalf];
  uint16_t pbits[kHalf];
  load_values<S::kGDtype, kHalf, FULL>(v.grad, lo, cnt, g);
  if constexpr (S::kPDtype == kF32) {
    load_values<kF32, kHalf, FULL>(v.param, lo, cnt, p);
  } else {  // pbits keeps the old parameter for the Kahan write
    load_bits16<kHalf, FULL>(v.param, lo, cnt, pbits);
#pragma unroll
    for (int j = 0; j < kHalf; ++j) p[j] = half_to_f32(pbits[j], bf16);
  }
  old.o0.half(v, 0, tabs.t0, at, h, s0);
  old.o1.half(v, 1, tabs.t1, at, h, s1);
  const Scalars hs = S::scalars(a.h);
#pragma unroll
  for (int j = 0; j < kHalf; ++j) S::Rule::apply(p[j], g[j], s0[j], s1[j], hs, true);
  if constexpr (S::kPDtype == kF32) {
    store_f32<kHalf, FULL>(v.param, lo, cnt, p);
  } else {
    if constexpr (S::kKahan) old.oc.half(v, 2, tabs.tc, at, h, c);
    if constexpr (S::kPairBits) {
      uint32_t w[kHalf / 2];
      round_bf16_sr<kHalf>(p, pair, lo, w);
      store_words<kHalf, FULL>(v.param, lo, cnt, w);
    } else if constexpr (S::kKahan || S::kWeightsSR) {
#pragma unroll
      for (int j = 0; j < kHalf; ++j) {
        const uint32_t hb = S::kWeightsSR ? param_bits(keys.k[2], static_cast<uint64_t>(v.ub + lo + j), bf16) : 0u;
        pbits[j] = S::kKahan ? kahan_write(p[j], pbits[j], c[j], bf16, S::kWeightsSR, hb)
                             : round_half(p[j], bf16, S::kWeightsSR, hb);
      }
      store_u16<kHalf, FULL>(v.param, lo, cnt, pbits);
    } else {  // round_half without SR: nearest even
      uint32_t w[kHalf / 2];
      round_words<S::kPDtype, kHalf>(p, w);
      store_words<kHalf, FULL>(v.param, lo, cnt, w);
    }
  }
#pragma unroll
  for (int j = 0; j < kHalf; ++j) {
    o.s[0][h * kHalf + j] = s0[j];
    o.s[1][h * kHalf + j] = s1[j];
    o.s[2][h * kHalf + j] = c[j];
  }
}

// Loads the octet, applies the rule and stores the new parameter: everything up to the states'
// new scales.
template <class S, bool FULL>
QCONF_HD void compute_octet(const SpecArgs& a, const SpecLooks<S>& tabs, const View& v, const Keys& keys, const At& at,
                            Octet& o) {
  OldStates<S, FULL> old;
  old.o0.begin(v, 0, at);
  old.o1.begin(v, 1, at);
  old.oc.begin(v, 2, at);
  const PairStream pair = keys.pair;  // read once per octet, not once per half (bf16 SR pairs)
  compute_half<S, FULL>(a, tabs, v, keys, pair, at, 0, old, o);
#if defined(__CUDA_ARCH__)
  __syncwarp();  // keeps the second half's loads after the first half's work (registers)
#endif
  compute_half<S, FULL>(a, tabs, v, keys, pair, at, 1, old, o);
}

// The absmax bits of the octet's new values of each group-scaled state (0 for the others).
struct Maxima {
  uint32_t m[3];
};

template <class S, bool FULL>
QCONF_HD Maxima octet_maxima(const Octet& o, int cnt) {
  Maxima mx{{0u, 0u, 0u}};
  if (S::St0::kGroupScale) mx.m[0] = octet_absmax<FULL>(o.s[0], cnt);
  if (S::St1::kGroupScale) mx.m[1] = octet_absmax<FULL>(o.s[1], cnt);
  if (S::Comp::kGroupScale) mx.m[2] = octet_absmax<FULL>(o.s[2], cnt);
  return mx;
}

// Stores the octet's states and Kahan buffer with their groups' reduced maxima.
template <class S, bool FULL>
QCONF_HD void store_states(const SpecLooks<S>& tabs, const View& v, const Keys& keys, const At& at, const Octet& o,
                           const Maxima& mx) {
  store_state<typename S::St0, S::kPDtype, FULL>(v, 0, tabs.t0, at, o.s[0], mx.m[0], keys.k[0]);
  store_state<typename S::St1, S::kPDtype, FULL>(v, 1, tabs.t1, at, o.s[1], mx.m[1], keys.k[1]);
  store_state<typename S::Comp, S::kPDtype, FULL>(v, 2, tabs.tc, at, o.s[2], mx.m[2], keys.k[3]);
}

// ---------------------------------------------------------------------------------------------
// the reduce pass of two-pass (rank1) states: only what their new maxima need

// The abs bits of the new values of the rank-1 state(s) of a whole octet (bits[k] for state k;
// the other state's, the parameter's and any group state's math is dead code). The parameter is
// read only when the rule's states depend on it (coupled L2 decay).
template <class S>
QCONF_HD void reduce_octet(const SpecArgs& a, const SpecLooks<S>& tabs, const View& v, const At& at,
                           uint32_t bits[2][kElems]) {
  using S0 = typename S::St0;
  using S1 = typename S::St1;
  OldState<S0, S::kPDtype, true> o0;
  OldState<S1, S::kPDtype, true> o1;
  if constexpr (S0::kRank1Scale) o0.begin(v, 0, at);
  if constexpr (S1::kRank1Scale) o1.begin(v, 1, at);
  const Scalars hs = S::scalars(a.h);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo = at.lo + h * kHalf;
    float g[kHalf], p[kHalf], s0[kHalf], s1[kHalf];
    load_values<S::kGDtype, kHalf, true>(v.grad, lo, kHalf, g);
    if (S::Rule::states_read_param(hs)) load_values<S::kPDtype, kHalf, true>(v.param, lo, kHalf, p);
    else {
#pragma unroll
      for (int j = 0; j < kHalf; ++j) p[j] = g[j];  // any finite value: p is not stored
    }
#pragma unroll
    for (int j = 0; j < kHalf; ++j) s0[j] = s1[j] = 0.0f;
    if constexpr (S0::kRank1Scale) o0.half(v, 0, tabs.t0, at, h, s0);
    if constexpr (S1::kRank1Scale) o1.half(v, 1, tabs.t1, at, h, s1);
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      S::Rule::apply(p[j], g[j], s0[j], s1[j], hs, true);
      bits[0][h * kHalf + j] = finite_abs_bits(s0[j]);
      bits[1][h * kHalf + j] = finite_abs_bits(s1[j]);
    }
  }
}

}  // namespace spec
}  // namespace qconf
