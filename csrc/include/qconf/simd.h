// SIMD traits for the CPU kernel template: one struct per instruction set with the same
// interface and bit-identical results (every operation is the IEEE fp32 operation or an exact
// integer operation). Include after the ISA's `#pragma GCC target`, inside that ISA's namespace
// (see csrc/cpu/step_*.cpp), with <immintrin.h> (x86) and qconf/element.h included before.
//
//   F  float lanes      I  uint32 lanes      M  lane mask      W  lanes per vector
#pragma once

#if defined(QCONF_ISA_AVX512)

struct VF {
  __m512 v;
  VF() = default;
  VF(__m512 x) : v(x) {}
  VF(float x) : v(_mm512_set1_ps(x)) {}
};
struct VI {
  __m512i v;
  VI() = default;
  VI(__m512i x) : v(x) {}
  VI(uint32_t x) : v(_mm512_set1_epi32(static_cast<int>(x))) {}
};
inline VF operator+(VF a, VF b) { return _mm512_add_ps(a.v, b.v); }
inline VF operator-(VF a, VF b) { return _mm512_sub_ps(a.v, b.v); }
inline VF operator*(VF a, VF b) { return _mm512_mul_ps(a.v, b.v); }
inline VF qfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }  // element.h qfma
inline VF operator-(VF a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN))); }
inline VF qdiv(VF a, VF b) { return _mm512_div_ps(a.v, b.v); }
inline VF qsqrt(VF a) { return _mm512_sqrt_ps(a.v); }
inline VF qsign(VF a) {
  const __mmask16 pos = _mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __mmask16 neg = _mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_mask_mov_ps(_mm512_setzero_ps(), pos, _mm512_set1_ps(1.0f)), neg,
                            _mm512_set1_ps(-1.0f));
}
inline VI operator^(VI a, VI b) { return _mm512_xor_si512(a.v, b.v); }
inline VI operator&(VI a, VI b) { return _mm512_and_si512(a.v, b.v); }
inline VI operator|(VI a, VI b) { return _mm512_or_si512(a.v, b.v); }
inline VI operator+(VI a, VI b) { return _mm512_add_epi32(a.v, b.v); }
inline VI operator-(VI a, VI b) { return _mm512_sub_epi32(a.v, b.v); }
inline VI operator*(VI a, VI b) { return _mm512_mullo_epi32(a.v, b.v); }
inline VI operator>>(VI a, int s) { return _mm512_srli_epi32(a.v, s); }
inline VI operator<<(VI a, int s) { return _mm512_slli_epi32(a.v, s); }

struct Isa {
  using F = VF;
  using I = VI;
  using M = __mmask16;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x.v); }
  static I load_i(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static void store_i(uint32_t* p, I x) { _mm512_storeu_si512(p, x.v); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static I bits(F x) { return _mm512_castps_si512(x.v); }
  static F from_bits(I x) { return _mm512_castsi512_ps(x.v); }
  static F to_float(I x) { return _mm512_cvtepi32_ps(x.v); }  // exact for values < 2^24
  // ceil(x) as int32; NaN and out-of-range lanes give INT32_MIN (the x86 "integer indefinite")
  static I ceil_to_int(F x) { return _mm512_cvt_roundps_epi32(x.v, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC); }
  // x rounded half to even as int32 (whatever the MXCSR mode); NaN / out of range -> INT32_MIN
  static I rint_to_int(F x) { return _mm512_cvt_roundps_epi32(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // x rounded half to even (an integral float; NaN stays NaN), and an integral x as int32
  static F round_even(F x) { return _mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I integral_to_int(F x) { return _mm512_cvttps_epi32(x.v); }  // NaN -> INT32_MIN
  static F abs(F x) { return _mm512_abs_ps(x.v); }
  static bool any(M m) { return m != 0; }
  static M lt(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ); }
  static M le(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ); }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
  static M eq(F a, F b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
  static M isnan(F a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
  static M eq_i(I a, I b) { return _mm512_cmpeq_epi32_mask(a.v, b.v); }
  static M lt_i(I a, I b) { return _mm512_cmplt_epi32_mask(a.v, b.v); }  // signed
  // n with its NaN lanes set to 0
  static F zero_nan(F n) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(n.v, n.v, _CMP_ORD_Q), n.v); }
  static F select(M m, F a, F b) { return _mm512_mask_mov_ps(b.v, m, a.v); }
  static I select_i(M m, I a, I b) { return _mm512_mask_mov_epi32(b.v, m, a.v); }
  static I add_if(M m, I a, I b) { return _mm512_mask_add_epi32(a.v, m, a.v, b.v); }
  static I inc_if(M m, I a) { return add_if(m, a, I(1u)); }  // a + 1 where m
  static I mask_i(M m) { return _mm512_movm_epi32(m); }    // all-ones lanes where m, else 0
  static I keep_if(M m, I a) { return _mm512_maskz_mov_epi32(m, a.v); }  // a where m, else 0
  static I max_u(I a, I b) { return _mm512_max_epu32(a.v, b.v); }
  static I min_i(I a, I b) { return _mm512_min_epi32(a.v, b.v); }
  static I max_i(I a, I b) { return _mm512_max_epi32(a.v, b.v); }
  static I abs_i(I a) { return _mm512_abs_epi32(a.v); }    // |a| of int32 lanes
  static I srlv(I a, I s) { return _mm512_srlv_epi32(a.v, s.v); }  // lane-wise a >> s (s < 32)
  static uint32_t hmax_u(I a) { return _mm512_reduce_max_epu32(a.v); }
  // Whether block scales come from the main loop's chunk maxima, a vector of blocks at a time
  // (quantizer.h block_scales_lanes); here a tile's 8 blocks of 128 fill half a vector, so no
  // (hmax_lanes: the same interface, unused while this is false)
  static constexpr bool kBlockMaxLanes = false;
  static I hmax_lanes(const I* v, int nb) {  // lane k: hmax_u(v[k]) for k < nb, 0 above
    alignas(64) uint32_t m[W];
    for (int k = 0; k < W; ++k) m[k] = k < nb ? hmax_u(v[k]) : 0u;
    return load_i(m);
  }
  static F fmin_nan(F a, F b) {  // NaN-ignoring minimum: _mm512_min_ps returns b when a is NaN
    return select(isnan(b), a, _mm512_min_ps(a.v, b.v));
  }
  static F fmax_nan(F a, F b) { return select(isnan(b), a, _mm512_max_ps(a.v, b.v)); }
  // x < c ? x : c and x > c ? x : c: c whenever either is NaN
  static F min_or(F x, F c) { return _mm512_min_ps(x.v, c.v); }
  static F max_or(F x, F c) { return _mm512_max_ps(x.v, c.v); }
  // 16-entry table held in a register, and gathers for larger tables
  using T16 = __m512;
  static T16 table16(const float* t) { return _mm512_loadu_ps(t); }
  static F lookup16(T16 t, I idx) { return _mm512_permutexvar_ps(idx.v, t); }
  static T16 scale16(T16 t, F s) { return _mm512_mul_ps(t, s.v); }  // every entry times s
  // 8-entry tables (indices 0..7); kSplit16: whether a 16-entry count is cheaper as one
  // broadcast blend and two 8-entry permutes (quantizer.h Probe16) than as 16-entry permutes
  static constexpr bool kSplit16 = false;
  using T8 = __m512;
  static T8 table8(const float* t) { return _mm512_castps256_ps512(_mm256_loadu_ps(t)); }
  static F lookup8(T8 t, I idx) { return _mm512_permutexvar_ps(idx.v, t); }
  static F gather(const float* base, I idx) { return _mm512_i32gather_ps(idx.v, base, 4); }
  // 32- and 256-entry tables in registers (vpermt2ps): gathers cost ~19 cycles on Zen 4
  static constexpr bool kPermute256 = true;
  static constexpr bool kTable32 = true;  // lookup32 is register permutes (octave lines)
  // 8-bit nearest rounding by segment lines where the codec has them (quantizer.h): no, the
  // octave lines' single-permute lookups and byte-plane probe are as cheap here
  static constexpr bool kSegmentLines = false;
  static constexpr bool kValueLines = false;  // (8-bit decodes permute the map's planes)
  struct T32 {
    __m512 lo, hi;
  };
  static T32 table32(const float* t) { return T32{_mm512_loadu_ps(t), _mm512_loadu_ps(t + 16)}; }
  static F lookup32(const T32& t, I idx) { return _mm512_permutex2var_ps(t.lo, idx.v, t.hi); }  // idx & 31
  struct T256 {
    __m512 r[16];
    T256() {}  // left unfilled: StateIn holds one per state and only 8-bit states fill it
  };
  static inline __attribute__((always_inline)) T256 table256(const float* t) {
    T256 out;
    for (int q = 0; q < 16; ++q) out.r[q] = _mm512_loadu_ps(t + 16 * q);
    return out;
  }
  static inline __attribute__((always_inline)) F lookup256(const T256& t, I idx) {  // 8 permutes, select by bits 5..7
    __m512 v[8];
    for (int q = 0; q < 8; ++q) v[q] = _mm512_permutex2var_ps(t.r[2 * q], idx.v, t.r[2 * q + 1]);
    const __mmask16 b5 = _mm512_test_epi32_mask(idx.v, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx.v, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx.v, _mm512_set1_epi32(128));
    const __m512 w0 = _mm512_mask_blend_ps(b5, v[0], v[1]), w1 = _mm512_mask_blend_ps(b5, v[2], v[3]);
    const __m512 w2 = _mm512_mask_blend_ps(b5, v[4], v[5]), w3 = _mm512_mask_blend_ps(b5, v[6], v[7]);
    const __m512 x0 = _mm512_mask_blend_ps(b6, w0, w1), x1 = _mm512_mask_blend_ps(b6, w2, w3);
    return _mm512_mask_blend_ps(b7, x0, x1);
  }
  // Lookups of kGroup index vectors at once in a 256-entry fp32 table held as planes of its
  // bytes (CodecDesc::*_bytes, *_words; qconf/codec/native.py:codec_table): a permute looks up
  // 64 byte lanes (VBMI, 128-entry tables, 4 vectors) or 32 word lanes (BW, 64-entry tables, 2
  // vectors), so a vector costs ~6 (VBMI) or ~10 (BW) operations against 18 for lookup256. Both
  // take the indices packed so that unpacking the planes (per 128-bit lane L) gives each vector
  // in order.
#if defined(QCONF_ISA_VBMI)
  static constexpr int kGroup = 4;
  struct T256P {
    __m512i b[4][4];  // plane k (byte k of each entry), entries 64q .. 64q + 63
  };
  static inline __attribute__((always_inline)) T256P table256p(const float*, const uint8_t*, const uint8_t* planes) {
    T256P out;
    for (int k = 0; k < 4; ++k)
      for (int q = 0; q < 4; ++q) out.b[k][q] = _mm512_loadu_si512(planes + 256 * k + 64 * q);
    return out;
  }
  // idx: byte 16L + 4h + m is the index of element 4L + m of vector h
  static inline __attribute__((always_inline)) void lookup_packed(const T256P& t, __m512i idx, F* out) {
    const __mmask64 b7 = _mm512_movepi8_mask(idx);
    __m512i p[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i lo = _mm512_permutex2var_epi8(t.b[k][0], idx, t.b[k][1]);
      const __m512i hi = _mm512_permutex2var_epi8(t.b[k][2], idx, t.b[k][3]);
      p[k] = _mm512_mask_blend_epi8(b7, lo, hi);
    }
    const __m512i a = _mm512_unpacklo_epi8(p[0], p[1]), b = _mm512_unpackhi_epi8(p[0], p[1]);
    const __m512i c = _mm512_unpacklo_epi8(p[2], p[3]), d = _mm512_unpackhi_epi8(p[2], p[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(a, c));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(a, c));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(b, d));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(b, d));
  }
  // byte 16L + 4h + m <- element 16h + 4L + m (of 64 codes), or byte 4(4L + m) of vector h
  static __m512i pack_order(int vector_bytes) {
    alignas(64) uint8_t order[64];
    for (int p = 0; p < 64; ++p) {
      const int L = p / 16, h = (p / 4) % 4, m = p % 4;
      order[p] = static_cast<uint8_t>(vector_bytes == 1 ? 16 * h + 4 * L + m : 64 * (h & 1) + 4 * (4 * L + m));
    }
    return _mm512_load_si512(order);
  }
  static inline __attribute__((always_inline)) void lookup256n(const T256P& t, const I* idx, F* out) {
    const __m512i order = pack_order(4);
    const __m512i x = _mm512_permutex2var_epi8(idx[0].v, order, idx[1].v);
    const __m512i y = _mm512_permutex2var_epi8(idx[2].v, order, idx[3].v);
    lookup_packed(t, _mm512_mask_blend_epi8(0xFF00FF00FF00FF00ull, x, y), out);  // h >= 2 from y
  }
  static inline __attribute__((always_inline)) void decode256n(const T256P& t, const uint8_t* codes, F* out) {
    lookup_packed(t, _mm512_permutexvar_epi8(pack_order(1), _mm512_loadu_si512(codes)), out);
  }
  // kGroup vectors of 8-bit codes (< 256) -> 64 bytes in element order, one store
  static inline __attribute__((always_inline)) void pack8n(uint8_t* p, const I* c) {
    alignas(64) uint8_t order[64];
    for (int q = 0; q < 64; ++q) order[q] = static_cast<uint8_t>(64 * ((q / 16) & 1) + 4 * (q % 16));
    const __m512i o = _mm512_load_si512(order);
    const __m512i x = _mm512_permutex2var_epi8(c[0].v, o, c[1].v), y = _mm512_permutex2var_epi8(c[2].v, o, c[3].v);
    _mm512_storeu_si512(p, _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, x, y));
  }
#else
  static constexpr int kGroup = 2;
  struct T256P {
    __m512i lo[8], hi[8];  // low and high 16-bit halves, entries 32q .. 32q + 31
  };
  static inline __attribute__((always_inline)) T256P table256p(const float*, const uint8_t* planes, const uint8_t*) {
    T256P out;
    for (int q = 0; q < 8; ++q) {
      out.lo[q] = _mm512_loadu_si512(planes + 64 * q);
      out.hi[q] = _mm512_loadu_si512(planes + 512 + 64 * q);
    }
    return out;
  }
  // w: word 8L + 4h + m is the index of element 4L + m of vector h
  static inline __attribute__((always_inline)) void lookup_packed(const T256P& t, __m512i w, F* out) {
    const __mmask32 b6 = _mm512_test_epi16_mask(w, _mm512_set1_epi16(64));
    const __mmask32 b7 = _mm512_test_epi16_mask(w, _mm512_set1_epi16(128));
    __m512i plane[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i* r = h == 0 ? t.lo : t.hi;
      const __m512i a = _mm512_permutex2var_epi16(r[0], w, r[1]), b = _mm512_permutex2var_epi16(r[2], w, r[3]);
      const __m512i c = _mm512_permutex2var_epi16(r[4], w, r[5]), d = _mm512_permutex2var_epi16(r[6], w, r[7]);
      plane[h] = _mm512_mask_blend_epi16(b7, _mm512_mask_blend_epi16(b6, a, b), _mm512_mask_blend_epi16(b6, c, d));
    }
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(plane[0], plane[1]));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(plane[0], plane[1]));
  }
  // word 8L + 4h + m <- word (element) 16h + 4L + m of 32 codes, or word 2(4L + m) of vector h
  static __m512i pack_order(int vector_words) {
    alignas(64) uint16_t order[32];
    for (int p = 0; p < 32; ++p) {
      const int L = p / 8, h = (p / 4) % 2, m = p % 4;
      order[p] = static_cast<uint16_t>(vector_words == 1 ? 16 * h + 4 * L + m : 32 * h + 2 * (4 * L + m));
    }
    return _mm512_load_si512(order);
  }
  static inline __attribute__((always_inline)) void lookup256n(const T256P& t, const I* idx, F* out) {
    lookup_packed(t, _mm512_permutex2var_epi16(idx[0].v, pack_order(2), idx[1].v), out);
  }
  static inline __attribute__((always_inline)) void decode256n(const T256P& t, const uint8_t* codes, F* out) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)codes));
    lookup_packed(t, _mm512_permutexvar_epi16(pack_order(1), w), out);
  }
  static void pack8n(uint8_t* p, const I* c) {
    pack8(p, c[0]);
    pack8(p + W, c[1]);
  }
#endif
  // dtype conversions
  static F load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static void store_u16(uint16_t* p, I x) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(x.v)); }
  static void store_u16x2(uint16_t* p, I x0, I x1) {  // 2 W lanes (< 2^16) -> 2 W uint16
    store_u16(p, x0);
    store_u16(p + W, x1);
  }
  static F load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // codes: 16 codes <-> packed bytes at 4 and 8 bits (element 2k in the low nibble of byte k)
  static constexpr bool kFastPack = true;
  static I unpack4(const uint8_t* p) {  // 8 bytes -> 16 codes
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i*)p));
    const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi64(0xF));
    const __m512i hi = _mm512_slli_epi64(_mm512_srli_epi64(b, 4), 32);
    return _mm512_or_si512(lo, hi);
  }
  static void pack4(uint8_t* p, I c) {  // 16 codes -> 8 bytes
    const __m512i w = _mm512_or_si512(c.v, _mm512_srli_epi64(c.v, 28));
    _mm_storel_epi64((__m128i*)p, _mm512_cvtepi64_epi8(w));
  }
  static void pack4x2(uint8_t* p, I c0, I c1) {  // 32 codes -> 16 bytes
    pack4(p, c0);
    pack4(p + W / 2, c1);
  }
  static void pack4x4(uint8_t* p, I c0, I c1, I c2, I c3) {  // 64 codes -> 32 bytes
    pack4x2(p, c0, c1);
    pack4x2(p + W, c2, c3);
  }
  // pack4x4 of the codes clamped to [0, top] (signed int lanes, top < 16)
  static I clamp_code(I c, uint32_t top) { return min_i(max_i(c, I(0u)), I(top)); }
  static void pack4x4_clamp(uint8_t* p, I c0, I c1, I c2, I c3, uint32_t top) {
    pack4x4(p, clamp_code(c0, top), clamp_code(c1, top), clamp_code(c2, top), clamp_code(c3, top));
  }
  static I unpack8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static void pack8(uint8_t* p, I c) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(c.v)); }
  // 4 vectors of int32 codes -> 4 W bytes in order, each clamped to [0, 255]
  static void pack8x4_sat(uint8_t* p, I c0, I c1, I c2, I c3) {
    const I c[4] = {c0, c1, c2, c3};
    for (int h = 0; h < 4; ++h)
      _mm_storeu_si128((__m128i*)(p + 16 * h), _mm512_cvtusepi32_epi8(_mm512_max_epi32(c[h].v, _mm512_setzero_si512())));
  }
  // table[code] for 16 packed 4-bit codes: vpermps reads only index bits 0..3, so each lane just
  // needs its nibble at the bottom: byte k of the 8 goes to lanes 2k, 2k+1 (vpshufb inside the
  // 128-bit lanes of a broadcast), then odd lanes shift right by 4.
  static F lookup16_packed4(T16 t, const uint8_t* p) {
    int64_t q;
    __builtin_memcpy(&q, p, 8);
    const __m512i b = _mm512_set1_epi64(q);
    const __m512i spread = _mm512_shuffle_epi8(
        b, _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0));
    const __m512i idx = _mm512_srlv_epi32(spread, _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
    return _mm512_permutexvar_ps(idx, t);
  }
};

#elif defined(QCONF_ISA_AVX2)

struct VF {
  __m256 v;
  VF() = default;
  VF(__m256 x) : v(x) {}
  VF(float x) : v(_mm256_set1_ps(x)) {}
};
struct VI {
  __m256i v;
  VI() = default;
  VI(__m256i x) : v(x) {}
  VI(uint32_t x) : v(_mm256_set1_epi32(static_cast<int>(x))) {}
};
inline VF operator+(VF a, VF b) { return _mm256_add_ps(a.v, b.v); }
inline VF operator-(VF a, VF b) { return _mm256_sub_ps(a.v, b.v); }
inline VF operator*(VF a, VF b) { return _mm256_mul_ps(a.v, b.v); }
inline VF qfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline VF operator-(VF a) { return _mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f)); }
inline VF qdiv(VF a, VF b) { return _mm256_div_ps(a.v, b.v); }
inline VF qsqrt(VF a) { return _mm256_sqrt_ps(a.v); }
inline VF qsign(VF a) {
  const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(1.0f));
  const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, _mm256_setzero_ps(), _CMP_LT_OQ), _mm256_set1_ps(1.0f));
  return _mm256_sub_ps(pos, neg);
}
inline VI operator^(VI a, VI b) { return _mm256_xor_si256(a.v, b.v); }
inline VI operator&(VI a, VI b) { return _mm256_and_si256(a.v, b.v); }
inline VI operator|(VI a, VI b) { return _mm256_or_si256(a.v, b.v); }
inline VI operator+(VI a, VI b) { return _mm256_add_epi32(a.v, b.v); }
inline VI operator-(VI a, VI b) { return _mm256_sub_epi32(a.v, b.v); }
inline VI operator*(VI a, VI b) { return _mm256_mullo_epi32(a.v, b.v); }
inline VI operator>>(VI a, int s) { return _mm256_srli_epi32(a.v, s); }
inline VI operator<<(VI a, int s) { return _mm256_slli_epi32(a.v, s); }

struct Isa {
  using F = VF;
  using I = VI;
  using M = __m256i;  // all-ones lanes
  static constexpr int W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x.v); }
  static I load_i(const uint32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static void store_i(uint32_t* p, I x) { _mm256_storeu_si256((__m256i*)p, x.v); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I bits(F x) { return _mm256_castps_si256(x.v); }
  static F from_bits(I x) { return _mm256_castsi256_ps(x.v); }
  static F to_float(I x) { return _mm256_cvtepi32_ps(x.v); }
  static I ceil_to_int(F x) { return _mm256_cvttps_epi32(_mm256_ceil_ps(x.v)); }
  static F round_even(F x) { return _mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I integral_to_int(F x) { return _mm256_cvttps_epi32(x.v); }  // NaN -> INT32_MIN
  static I rint_to_int(F x) { return integral_to_int(round_even(x)); }
  static F abs(F x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x.v); }
  static bool any(M m) { return _mm256_movemask_ps(_mm256_castsi256_ps(m)) != 0; }
  static M lt(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)); }
  static M le(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a.v, b.v, _CMP_LE_OQ)); }
  static M gt(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)); }
  static M eq(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)); }
  static M isnan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)); }
  static M eq_i(I a, I b) { return _mm256_cmpeq_epi32(a.v, b.v); }
  static M lt_i(I a, I b) { return _mm256_cmpgt_epi32(b.v, a.v); }  // signed
  static F zero_nan(F n) { return _mm256_and_ps(_mm256_cmp_ps(n.v, n.v, _CMP_ORD_Q), n.v); }
  static F select(M m, F a, F b) { return _mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(m)); }
  static I select_i(M m, I a, I b) { return _mm256_blendv_epi8(b.v, a.v, m); }
  static I add_if(M m, I a, I b) { return _mm256_add_epi32(a.v, _mm256_and_si256(m, b.v)); }
  static I inc_if(M m, I a) { return _mm256_sub_epi32(a.v, m); }  // a + 1 where m (m = -1)
  static I mask_i(M m) { return m; }
  static I keep_if(M m, I a) { return _mm256_and_si256(m, a.v); }  // a where m, else 0
  static I max_u(I a, I b) { return _mm256_max_epu32(a.v, b.v); }
  static I min_i(I a, I b) { return _mm256_min_epi32(a.v, b.v); }
  static I max_i(I a, I b) { return _mm256_max_epi32(a.v, b.v); }
  static I abs_i(I a) { return _mm256_abs_epi32(a.v); }
  static I srlv(I a, I s) { return _mm256_srlv_epi32(a.v, s.v); }
  static uint32_t hmax_u(I a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a.v), _mm256_extracti128_si256(a.v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  static constexpr bool kBlockMaxLanes = true;  // (quantizer.h block_scales_lanes)
  // lane k: hmax_u(v[k]), k < 8 (v[k] = 0 for k >= nb): pairs of vectors interleaved and maxed (a
  // transpose that halves each time), 21 operations for 8 maxima against 7 each
  static I hmax_lanes(const I* v, int) {
    __m256i t[4], u[2];
    for (int k = 0; k < 4; ++k)
      t[k] = _mm256_max_epu32(_mm256_unpacklo_epi32(v[2 * k].v, v[2 * k + 1].v),
                              _mm256_unpackhi_epi32(v[2 * k].v, v[2 * k + 1].v));
    for (int k = 0; k < 2; ++k)
      u[k] = _mm256_max_epu32(_mm256_unpacklo_epi64(t[2 * k], t[2 * k + 1]),
                              _mm256_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
    // u[0] lane L: the 4-lane maxima of v[0..3]'s 128-bit lane L, u[1] those of v[4..7]
    return _mm256_max_epu32(_mm256_permute2x128_si256(u[0], u[1], 0x20),
                            _mm256_permute2x128_si256(u[0], u[1], 0x31));
  }
  static F fmin_nan(F a, F b) { return select(isnan(b), a, _mm256_min_ps(a.v, b.v)); }
  static F fmax_nan(F a, F b) { return select(isnan(b), a, _mm256_max_ps(a.v, b.v)); }
  static F min_or(F x, F c) { return _mm256_min_ps(x.v, c.v); }
  static F max_or(F x, F c) { return _mm256_max_ps(x.v, c.v); }
  struct T16 {
    __m256 lo, hi;
  };
  static T16 table16(const float* t) { return T16{_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)}; }
  static T16 scale16(T16 t, F s) { return T16{_mm256_mul_ps(t.lo, s.v), _mm256_mul_ps(t.hi, s.v)}; }
  static constexpr bool kSplit16 = true;  // (a lookup16 is two permutes and a blend)
  using T8 = __m256;
  static T8 table8(const float* t) { return _mm256_loadu_ps(t); }
  static F lookup8(T8 t, I idx) { return _mm256_permutevar8x32_ps(t, idx.v); }
  static F lookup16(T16 t, I idx) {  // bit 3 of the index picks the half
    const __m256 lo = _mm256_permutevar8x32_ps(t.lo, idx.v);
    const __m256 hi = _mm256_permutevar8x32_ps(t.hi, idx.v);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx.v, 28)));
  }
  static F gather(const float* base, I idx) { return _mm256_i32gather_ps(base, idx.v, 4); }
  static constexpr bool kPermute256 = false;
  static constexpr bool kTable32 = true;
  // 8-bit nearest rounding by segment lines (quantizer.h): 8-entry tables, one vpermps each, and
  // a midpoint gather only for the rare values near a code boundary
  static constexpr bool kSegmentLines = true;
  // 8-bit decodes by value lines where the codec has them (tile_codec.h ValueLines): 19-24
  // operations per 8 codes instead of a gather: about 5% off an 8bit.yml step on Zen 4; more
  // where gathers are slower (Zen 2, Intel under the Gather Data Sampling mitigation; not measured)
  static constexpr bool kValueLines = true;
  // 32-entry tables in four registers: index bits 0..2 by vpermps, bits 3 and 4 by blends
  struct T32 {
    __m256 r[4];
  };
  static T32 table32(const float* t) {
    return T32{{_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8), _mm256_loadu_ps(t + 16), _mm256_loadu_ps(t + 24)}};
  }
  static F lookup32(const T32& t, I idx) {  // idx & 31
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx.v, 28));
    const __m256 b4 = _mm256_castsi256_ps(_mm256_slli_epi32(idx.v, 27));
    __m256 r[4];
    for (int q = 0; q < 4; ++q) r[q] = _mm256_permutevar8x32_ps(t.r[q], idx.v);
    return _mm256_blendv_ps(_mm256_blendv_ps(r[0], r[1], b3), _mm256_blendv_ps(r[2], r[3], b3), b4);
  }
  using T256 = const float*;
  static T256 table256(const float* t) { return t; }
  static F lookup256(T256 t, I idx) { return gather(t, idx); }
  static constexpr int kGroup = 1;  // 256-entry lookups: one gather per vector
  using T256P = const float*;
  static T256P table256p(const float* values, const uint8_t*, const uint8_t*) { return values; }
  static void lookup256n(T256P t, const I* idx, F* out) { out[0] = gather(t, idx[0]); }
  static void decode256n(T256P t, const uint8_t* codes, F* out) { out[0] = gather(t, unpack8(codes)); }
  static void pack8n(uint8_t* p, const I* c) { pack8(p, c[0]); }
  static F load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static void store_u16(uint16_t* p, I x) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(x.v, x.v), 0xD8);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
  }
  static void store_u16x2(uint16_t* p, I x0, I x1) {  // 16 lanes (< 2^16) -> 16 uint16: one pack, one store
    _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(_mm256_packus_epi32(x0.v, x1.v), 0xD8));
  }
  static F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // codes: 8 codes <-> packed bytes at 4 and 8 bits (element 2k in the low nibble of byte k)
  static constexpr bool kFastPack = true;
  // the 4 bytes of 8 4-bit codes, lane k shifted right by 4k: code k in bits 0..3, higher codes above
  static __m256i spread4(const uint8_t* p) {
    int32_t q;
    __builtin_memcpy(&q, p, 4);
    return _mm256_srlv_epi32(_mm256_set1_epi32(q), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  }
  static I unpack4(const uint8_t* p) { return _mm256_and_si256(spread4(p), _mm256_set1_epi32(0xF)); }
  static void pack4(uint8_t* p, I c) {  // 8 codes -> 4 bytes
    // byte 0 of each 64-bit lane: c(2m) | c(2m+1) << 4; bytes 0, 8 of each 128-bit half to bytes
    // 0, 1 (low half) and 2, 3 (high half), the rest zero, then the halves or-ed
    const __m256i w = _mm256_or_si256(c.v, _mm256_srli_epi64(c.v, 28));
    const __m256i b = _mm256_shuffle_epi8(w, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, -1, -1));
    const int32_t q = _mm_cvtsi128_si32(_mm_or_si128(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    __builtin_memcpy(p, &q, 4);
  }
  static void pack4x2(uint8_t* p, I c0, I c1) {  // 16 codes (c0 then c1) -> 8 bytes
    // words: lane L holds c0[4L..4L+3], c1[4L..4L+3]; dword d | d >> 12 has byte 0 = the pair's
    // byte; bytes 0, 4, 8, 12 of each lane to its low dword (c0's two pairs, then c1's two), and
    // the lanes' words interleaved put c0's four pairs before c1's
    const __m256i w = _mm256_packus_epi32(c0.v, c1.v);
    const __m256i b = _mm256_shuffle_epi8(_mm256_or_si256(w, _mm256_srli_epi32(w, 12)),
                                          _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64((__m128i*)p, _mm_unpacklo_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  // 4 vectors of codes as bytes, saturated to [0, 255]: bytes of 128-bit lane L are c0[4L..4L+3],
  // c1[..], c2[..], c3[..] (the packs keep the lanes apart)
  static __m256i code_bytes4(I c0, I c1, I c2, I c3) {
    return _mm256_packus_epi16(_mm256_packus_epi32(c0.v, c1.v), _mm256_packus_epi32(c2.v, c3.v));
  }
  // code_bytes4's 32 bytes (< 16) -> 16 bytes of nibbles: each byte pair (2j, 2j+1) becomes the low
  // byte of word | word >> 4, those go to the lane's first 8 bytes (a word per vector), and the two
  // lanes' words interleaved put each vector's 4 bytes in order
  static void store_nibbles(uint8_t* p, __m256i b) {
    const __m256i lo = _mm256_shuffle_epi8(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)),
                                           _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storeu_si128((__m128i*)p, _mm_unpacklo_epi16(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
  }
  static void pack4x4(uint8_t* p, I c0, I c1, I c2, I c3) {  // 32 codes -> 16 bytes
    store_nibbles(p, code_bytes4(c0, c1, c2, c3));
  }
  // pack4x4 of the codes clamped to [0, top] (signed int lanes, top < 16): the unsigned-saturating
  // packs clamp below at 0 (and above at 255), one byte min clamps at top, for four vectors
  static void pack4x4_clamp(uint8_t* p, I c0, I c1, I c2, I c3, uint32_t top) {
    store_nibbles(p, _mm256_min_epu8(code_bytes4(c0, c1, c2, c3), _mm256_set1_epi8(static_cast<char>(top))));
  }
  static I unpack8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  // 4 vectors of int32 codes (below 2^15) -> 32 bytes in order, each clamped to [0, 255] by the
  // saturating packs; code_bytes4's dwords (c0..c3 of each lane's half) put in order by one vpermd
  static void pack8x4_sat(uint8_t* p, I c0, I c1, I c2, I c3) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i*)p, _mm256_permutevar8x32_epi32(code_bytes4(c0, c1, c2, c3), order));
  }
  static void pack8(uint8_t* p, I c) {  // 8 codes (< 256) -> 8 bytes: byte 0 of each lane, halves or-ed
    const __m256i b = _mm256_shuffle_epi8(c.v, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                  -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                                                  -1, -1, -1, -1));
    _mm_storel_epi64((__m128i*)p, _mm_or_si128(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  // table[code] for 8 packed 4-bit codes: lookup16 reads index bits 0..3 only (vpermps bits
  // 0..2, the blend bit 3), so the spread word needs no mask
  static F lookup16_packed4(T16 t, const uint8_t* p) { return lookup16(t, spread4(p)); }
};

#else  // portable scalar

struct Isa {
  using F = float;
  using I = uint32_t;
  using M = bool;
  static constexpr int W = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static I load_i(const uint32_t* p) { return *p; }
  static void store_i(uint32_t* p, I x) { *p = x; }
  static I iota() { return 0u; }
  static I bits(F x) { return f32_bits(x); }
  static F from_bits(I x) { return bits_f32(x); }
  static F to_float(I x) { return static_cast<float>(static_cast<int32_t>(x)); }
  static I ceil_to_int(F x) {  // as the x86 conversion: NaN / out of range -> INT32_MIN
    return (x >= -2147483648.0f && x < 2147483648.0f) ? static_cast<uint32_t>(static_cast<int32_t>(std::ceil(x)))
                                                      : 0x80000000u;
  }
  static F round_even(F x) {  // half to even, independent of the FP environment; NaN, inf stay
    if (!(std::fabs(x) < 8388608.0f)) return x;  // (from 2^23 on every float is integral)
    float f = std::floor(x);
    const float d = x - f;  // exact
    if (d > 0.5f || (d == 0.5f && std::fmod(f, 2.0f) != 0.0f)) f += 1.0f;
    return f;
  }
  static I integral_to_int(F x) {  // as the x86 conversion: NaN / out of range -> INT32_MIN
    return (x >= -2147483648.0f && x < 2147483648.0f) ? static_cast<uint32_t>(static_cast<int32_t>(x)) : 0x80000000u;
  }
  static I rint_to_int(F x) { return integral_to_int(round_even(x)); }
  static F abs(F x) { return std::fabs(x); }
  static bool any(M m) { return m; }
  static M lt(F a, F b) { return a < b; }
  static M le(F a, F b) { return a <= b; }
  static M gt(F a, F b) { return a > b; }
  static M eq(F a, F b) { return a == b; }
  static M isnan(F a) { return a != a; }
  static M eq_i(I a, I b) { return a == b; }
  static M lt_i(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b); }
  static F zero_nan(F n) { return n != n ? 0.0f : n; }
  static F select(M m, F a, F b) { return m ? a : b; }
  static I select_i(M m, I a, I b) { return m ? a : b; }
  static I add_if(M m, I a, I b) { return m ? a + b : a; }
  static I inc_if(M m, I a) { return m ? a + 1u : a; }
  static I mask_i(M m) { return m ? 0xFFFFFFFFu : 0u; }
  static I keep_if(M m, I a) { return m ? a : 0u; }
  static I max_u(I a, I b) { return a > b ? a : b; }
  static I min_i(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? a : b; }
  static I max_i(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b; }
  static I abs_i(I a) { return static_cast<int32_t>(a) < 0 ? 0u - a : a; }
  static I srlv(I a, I s) { return a >> s; }
  static uint32_t hmax_u(I a) { return a; }
  static constexpr bool kBlockMaxLanes = false;
  static I hmax_lanes(const I* v, int) { return v[0]; }
  static F fmin_nan(F a, F b) { return qconf::fmin_nan(a, b); }
  static F fmax_nan(F a, F b) { return qconf::fmax_nan(a, b); }
  static F min_or(F x, F c) { return x < c ? x : c; }
  static F max_or(F x, F c) { return x > c ? x : c; }
  using T16 = const float*;
  static T16 table16(const float* t) { return t; }
  static F lookup16(T16 t, I idx) { return t[idx]; }
  static constexpr bool kSplit16 = false;
  using T8 = const float*;
  static T8 table8(const float* t) { return t; }
  static F lookup8(T8 t, I idx) { return t[idx]; }
  static F gather(const float* base, I idx) { return base[idx]; }
  static constexpr bool kPermute256 = false;
  static constexpr bool kTable32 = false;
  static constexpr bool kSegmentLines = false;
  static constexpr bool kValueLines = false;
  using T32 = const float*;
  static T32 table32(const float* t) { return t; }
  static F lookup32(T32 t, I idx) { return t[idx]; }
  using T256 = const float*;
  static T256 table256(const float* t) { return t; }
  static F lookup256(T256 t, I idx) { return t[idx]; }
  static constexpr int kGroup = 1;
  using T256P = const float*;
  static T256P table256p(const float* values, const uint8_t*, const uint8_t*) { return values; }
  static void lookup256n(T256P t, const I* idx, F* out) { out[0] = t[idx[0]]; }
  static void decode256n(T256P t, const uint8_t* codes, F* out) { out[0] = t[*codes]; }
  static void pack8n(uint8_t* p, const I* c) { pack8(p, c[0]); }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static void store_u16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x); }
  static void store_u16x2(uint16_t* p, I x0, I x1) {
    store_u16(p, x0);
    store_u16(p + 1, x1);
  }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_f16(uint16_t* p, F x) { *p = f32_to_f16_rne(x); }
  static constexpr bool kFastPack = false;
  static I unpack4(const uint8_t*) { return 0u; }
  static void pack4(uint8_t*, I) {}
  static void pack4x2(uint8_t*, I, I) {}
  static void pack4x4(uint8_t*, I, I, I, I) {}
  static void pack4x4_clamp(uint8_t*, I, I, I, I, uint32_t) {}
  static I unpack8(const uint8_t*) { return 0u; }
  static void pack8(uint8_t*, I) {}
  static void pack8x4_sat(uint8_t*, I, I, I, I) {}
  static F lookup16_packed4(T16, const uint8_t*) { return 0.0f; }  // kFastPack is false
  static T16 scale16(T16 t, F) { return t; }  // (unused: kFastPack is false, so no state reads packed codes)
};

#endif
