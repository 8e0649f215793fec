// The CPU tile kernels' codec stages (part 1 of 3 of the per-ISA step template: tile_codec.h,
// quantizer.h, step_pipeline.h): dtype loads and stores, packed codes, the scale-layout walkers,
// dequantize, the generic quantize and the absmax reductions of one tile of one tensor.
//
// The three headers are compiled once per ISA: each csrc/cpu/step_<isa>.cpp sets
// `#pragma GCC target`, defines QCONF_ISA_*, and includes them (through step_cpu.h) inside
// namespace qconf::isa_<isa> after simd.h, which defines the `Isa` traits used here.
//
// Tiles start at multiples of 64 elements, so the packed codes of any width start on a byte.

using F = Isa::F;
using I = Isa::I;
constexpr int W = Isa::W;

// The next work item's parameter and gradient cache lines, requested one line of each at a time
// by the loops of the current tile: a line per 16 elements of the main loop (pass 1: of
// rank1_reduce), or per 32 when quantize loops follow, which then request one per 64 elements
// of each 4/8-bit state; the rest when the tile ends. (Requested all by the main loop, they came
// in bursts that memory could not serve with two threads, while the quantize loops asked nothing.)
struct NextLines {
  const char* p = nullptr;
  const char* g = nullptr;
  int64_t p_bytes = 0, g_bytes = 0, off = 0;
  int64_t main_elems = 16;  // main-loop elements per step (a power of two, at least W)
  void step() {
    if (off < p_bytes) __builtin_prefetch(p + off, 1);
    if (off < g_bytes) __builtin_prefetch(g + off, 0);
    off += 64;
  }
  void finish() {
    while (off < p_bytes || off < g_bytes) step();
  }
};
constexpr int64_t kQuantizeStride = 64;  // elements per step of each quantized state
constexpr int64_t kMainChunk = 32;  // main-loop elements per chunk: a multiple of NextLines::main_elems (16 or 32)
constexpr int64_t kPrefetch = 1024;  // elements ahead (one tile)

// ---------------------------------------------------------------------------------------------
// dtype conversion
inline void load_as_f32(const void* src, int32_t dtype, int64_t start, int64_t n, float* dst) {
  int64_t i = 0;
  if (dtype == kF32) {
    const float* s = static_cast<const float*>(src) + start;
    for (; i + W <= n; i += W) Isa::store(dst + i, Isa::load(s + i));
    for (; i < n; ++i) dst[i] = s[i];
  } else if (dtype == kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + start;
    for (; i + 4 * W <= n; i += 4 * W) {  // 4 vectors per turn: the loop's own count is half the work
      const F a = Isa::load_bf16(s + i), b = Isa::load_bf16(s + i + W);
      const F c = Isa::load_bf16(s + i + 2 * W), d = Isa::load_bf16(s + i + 3 * W);
      Isa::store(dst + i, a);
      Isa::store(dst + i + W, b);
      Isa::store(dst + i + 2 * W, c);
      Isa::store(dst + i + 3 * W, d);
    }
    for (; i + W <= n; i += W) Isa::store(dst + i, Isa::load_bf16(s + i));
    for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + start;
    for (; i + W <= n; i += W) Isa::store(dst + i, Isa::load_f16(s + i));
    for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
}

// bf16 pattern (low 16 bits of the lanes) of x that is not NaN, round to nearest even: the
// carry of u + 0x7fff + (lsb of the result) rounds up; +-inf and overflow come out as +-inf.
inline I bf16_rne_bits_no_nan(F x) {
  const I u = Isa::bits(x);
  return (u + I(0x7fffu) + ((u >> 16) & I(1u))) >> 16;
}

// bf16 pattern (low 16 bits of the lanes) of x, round to nearest even, NaN quiet
inline I bf16_rne_bits(F x) {
  return Isa::select_i(Isa::isnan(x), (Isa::bits(x) >> 16) | I(0x40u), bf16_rne_bits_no_nan(x));
}

// bf16 stochastic rounding of x with the random bits h (the top 16 bits are used)
inline I bf16_sr_bits(F x, I h) {
  const I u = Isa::bits(x);
  const I exp_mask(0x7f800000u);
  const auto nonfinite = Isa::eq_i(u & exp_mask, exp_mask);
  I v = (u + (h >> 16)) & I(0xffff0000u);
  v = Isa::select_i(Isa::eq_i(v & exp_mask, exp_mask), (u & I(0x80000000u)) | I(0x7f7f0000u), v);
  const I special = (u >> 16) | Isa::select_i(Isa::isnan(x), I(0x40u), I(0u));
  return Isa::select_i(nonfinite, special, v >> 16);
}

// Round to nearest even into a bf16/fp16 tensor (fp32 params are updated in place instead).
inline void store_from_f32(void* dst, int32_t dtype, int64_t start, int64_t n, const float* src) {
  int64_t i = 0;
  uint16_t* d = static_cast<uint16_t*>(dst) + start;
  if (dtype == kBF16) {
    // Without the NaN select first: the running sum `seen` becomes NaN once any value is NaN (or
    // when infinities cancel), and then these vectors are written again with the select.
    F seen(0.0f);
    for (; i + 2 * W <= n; i += 2 * W) {
      const F a = Isa::load(src + i), b = Isa::load(src + i + W);
      seen = seen + (a + b);
      Isa::store_u16x2(d + i, bf16_rne_bits_no_nan(a), bf16_rne_bits_no_nan(b));
    }
    if (Isa::any(Isa::isnan(seen)))
      for (int64_t j = 0; j < i; j += 2 * W)
        Isa::store_u16x2(d + j, bf16_rne_bits(Isa::load(src + j)), bf16_rne_bits(Isa::load(src + j + W)));
    for (; i + W <= n; i += W) Isa::store_u16(d + i, bf16_rne_bits(Isa::load(src + i)));
    for (; i < n; ++i) d[i] = f32_to_bf16_rne(src[i]);
  } else {
    for (; i + W <= n; i += W) Isa::store_f16(d + i, Isa::load(src + i));
    for (; i < n; ++i) d[i] = f32_to_f16_rne(src[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// packed codes (start is a multiple of 8, so the tile owns whole bytes)
inline void unpack_codes(const uint8_t* packed, int bits, int64_t start, int64_t n, uint32_t* out) {
  const uint8_t* src = packed + start * bits / 8;
  int64_t i = 0;
  if (bits == 8) {
    if constexpr (Isa::kFastPack) {
      for (; i + W <= n; i += W) Isa::store_i(out + i, Isa::unpack8(src + i));
    }
    for (; i < n; ++i) out[i] = src[i];
    return;
  }
  if (bits == 4) {
    if constexpr (Isa::kFastPack) {
      for (; i + W <= n; i += W) Isa::store_i(out + i, Isa::unpack4(src + i / 2));
    }
    for (; i < n; ++i) out[i] = (src[i / 2] >> ((i & 1) * 4)) & 0xFu;
    return;
  }
  const uint32_t mask = (1u << bits) - 1u;
  for (; i < n; i += 8) {  // 8 codes = `bits` bytes = one little-endian word
    const int64_t count = n - i < 8 ? n - i : 8;
    const int nbytes = static_cast<int>((count * bits + 7) / 8);
    const uint8_t* b = src + (i / 8) * bits;
    uint64_t word = 0;
    for (int k = 0; k < nbytes; ++k) word |= static_cast<uint64_t>(b[k]) << (8 * k);
    for (int64_t j = 0; j < count; ++j) out[i + j] = static_cast<uint32_t>(word >> (j * bits)) & mask;
  }
}

inline void pack_codes(const uint32_t* in, int bits, int64_t start, int64_t n, uint8_t* packed) {
  uint8_t* dst = packed + start * bits / 8;
  int64_t i = 0;
  if (bits == 8) {
    if constexpr (Isa::kFastPack) {
      for (; i + W <= n; i += W) Isa::pack8(dst + i, Isa::load_i(in + i));
    }
    for (; i < n; ++i) dst[i] = static_cast<uint8_t>(in[i]);
    return;
  }
  if (bits == 4) {
    if constexpr (Isa::kFastPack) {
      for (; i + W <= n; i += W) Isa::pack4(dst + i / 2, Isa::load_i(in + i));
    }
    for (; i + 1 < n; i += 2) dst[i / 2] = static_cast<uint8_t>(in[i] | (in[i + 1] << 4));
    if (i < n) dst[i / 2] = static_cast<uint8_t>(in[i]);  // odd tail: high nibble stays 0
    return;
  }
  for (; i < n; i += 8) {
    const int64_t count = n - i < 8 ? n - i : 8;
    uint64_t word = 0;
    for (int64_t j = 0; j < count; ++j) word |= static_cast<uint64_t>(in[i + j]) << (j * bits);
    const int nbytes = static_cast<int>((count * bits + 7) / 8);
    uint8_t* b = dst + (i / 8) * bits;
    for (int k = 0; k < nbytes; ++k) b[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

// ---------------------------------------------------------------------------------------------
// scale layout walkers (the index arithmetic is qconf/scale_walk.h, shared with the CUDA kernels;
// these loops call the ISA code's lambdas, so they live here, in the ISA namespace)

// Calls fn(off, len, lead, nlead, col) for each run of the tile [start, start+n) inside one row
// of a rank1 layout (see Rank1Rows).
template <class Fn>
inline void for_each_rank1_row(const TensorDesc& t, int64_t start, int64_t n, Fn&& fn) {
  Rank1Rows rows;
  rows.begin(t, start, n);
  while (rows.next()) fn(rows.off, rows.len, rows.lead, rows.nlead, rows.col);
}

// Calls fn(offset, len, c, vec, combine) for each run of elements of the tile [start, start+n)
// whose per-element value is `c` (vec == nullptr), `vec[j]`, or combine(c, vec[j]) (rank1).
// `vals` is the per-stored-scale array (scales or reciprocals). One loop per walk mode, so each
// call of fn is specialized on the run's form.
template <class Fn>
inline void for_each_scale_run(const CodecDesc& c, const TensorDesc& t, const float* vals, bool use_min,
                               int64_t start, int64_t n, Fn&& fn) {
  ScaleRuns runs(c, t, vals, use_min, start, n);
  ScaleRun r;
  switch (runs.mode) {
    case ScaleRuns::kBlockRuns:
      while (runs.next_of<ScaleRuns::kBlockRuns>(r)) fn(r.off, r.len, r.value, r.vec, r.comb);
      break;
    case ScaleRuns::kDim1Vector:
      while (runs.next_of<ScaleRuns::kDim1Vector>(r)) fn(r.off, r.len, r.value, r.vec, r.comb);
      break;
    case ScaleRuns::kDim1Runs:
      while (runs.next_of<ScaleRuns::kDim1Runs>(r)) fn(r.off, r.len, r.value, r.vec, r.comb);
      break;
    default:
      while (runs.next_of<ScaleRuns::kRank1Rows>(r)) fn(r.off, r.len, r.value, r.vec, r.comb);
      break;
  }
}

// max of a partial maximum (abs bit patterns) and m
inline void fold_max(uint32_t* dst, uint32_t m) { *dst = m > *dst ? m : *dst; }

// qmap[code] of 8-bit codes by the codec's value lines (qconf/codec/value_lines.py, which checks
// that they give every code's exact bits): t = (code << s) - C, x = |t| + 1 as a float, run
// d = exponent(x) & 7; the value's bits are those of fma(x, S[d], A[d]) plus the run's bias B[d]
// plus a 2-bit correction (index |t| >> s), with the sign of t. present(c): whether this ISA
// takes them for codec c.
struct ValueLines {
  bool mirror;  // s = 1
  I center;
  float bias_bits[8];  // B[d] as int32 bits
  Isa::T8 slope, offset, bias;
  Isa::T16 words;  // uint32 bits: 2 bits per index, 16 indices per word
  explicit ValueLines(const float* lines)
      : mirror(lines[kValShift] == 1.0f),
        center(static_cast<uint32_t>(static_cast<int32_t>(lines[kValCenter]))),
        slope(Isa::table8(lines + kValSlope)),
        offset(Isa::table8(lines + kValOffset)),
        words(Isa::table16(lines + kValWords)) {
    for (int d = 0; d < 8; ++d) {
      const int32_t b = static_cast<int32_t>(lines[kValBias + d]);
      __builtin_memcpy(bias_bits + d, &b, 4);
    }
    bias = Isa::table8(bias_bits);
  }
  static bool present(const CodecDesc& c) { return Isa::kValueLines && c.bits == 8 && c.lines[kValPresent] == 1.0f; }
  // Mirror: the signed form (s = 1); else s = 0 and C = 0, so t = |t| = i = code, sign +
  template <bool Mirror>
  F decode(I code) const {
    const I t = Mirror ? (code << 1) - center : code;
    const I a = Mirror ? Isa::abs_i(t) : t;
    const F x = Isa::to_float(a + I(1u));
    const I d = (Isa::bits(x) >> 23) & I(7u);
    const F y = qfma(x, Isa::lookup8(slope, d), Isa::lookup8(offset, d));
    // field i = a >> s: bits 2 (i & 15) of word i >> 4 (with a = 2i: a & 30 and a >> 5)
    const I word = Isa::bits(Isa::lookup16(words, Mirror ? a >> 5 : a >> 4));
    const I f = Isa::srlv(word, Mirror ? a & I(30u) : (a << 1) & I(30u)) & I(3u);
    const I v = Isa::bits(y) + Isa::bits(Isa::lookup8(bias, d)) + f;
    return Isa::from_bits(Mirror ? v ^ (t & I(0x80000000u)) : v);
  }
  // out[0..n) = the values of the codes load(j) of vectors j = 0, W, .. (n a multiple of W)
  template <class Load>
  void decode_all(Load load, int64_t n, float* out) const {
    if (mirror) {
      for (int64_t i = 0; i < n; i += W) Isa::store(out + i, decode<true>(load(i)));
    } else {
      for (int64_t i = 0; i < n; i += W) Isa::store(out + i, decode<false>(load(i)));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// dequantize: out[i] = qmap[code_i] * scale_i
inline void dequantize(const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n, float* out,
                       uint32_t* codes) {
  const CodecDesc& c = st.codec;
  unpack_codes(st.codes, c.bits, start, n, codes);
  int64_t i = 0;
  if (c.bits <= 4) {
    const auto tab = Isa::table16(c.qmap);
    for (; i + W <= n; i += W) Isa::store(out + i, Isa::lookup16(tab, Isa::load_i(codes + i)));
  } else if (ValueLines::present(c)) {
    i = n / W * W;
    ValueLines(c.lines).decode_all([codes](int64_t j) { return Isa::load_i(codes + j); }, i, out);
  } else {
    for (; i + W <= n; i += W) Isa::store(out + i, Isa::gather(c.qmap, Isa::load_i(codes + i)));
  }
  for (; i < n; ++i) out[i] = c.qmap[codes[i]];
  for_each_scale_run(c, t, st.scales, true, start, n,
                     [&](int64_t off, int64_t len, float cv, const float* vec, bool comb) {
                       float* o = out + off;
                       int64_t j = 0;
                       if (vec == nullptr) {
                         const F s(cv);
                         for (; j + W <= len; j += W) Isa::store(o + j, Isa::load(o + j) * s);
                         for (; j < len; ++j) o[j] = o[j] * cv;
                       } else if (!comb) {
                         for (; j + W <= len; j += W) Isa::store(o + j, Isa::load(o + j) * Isa::load(vec + j));
                         for (; j < len; ++j) o[j] = o[j] * vec[j];
                       } else {
                         const F cp(cv);
                         for (; j + W <= len; j += W)
                           Isa::store(o + j, Isa::load(o + j) * Isa::fmin_nan(cp, Isa::load(vec + j)));
                         for (; j < len; ++j) o[j] = o[j] * fmin_nan(cv, vec[j]);
                       }
                     });
}


// qmap[code] of n 8-bit codes (n a multiple of W) into out: by the codec's value lines where the
// ISA takes them (AVX2), else Isa::kGroup vectors per lookup in the map's planes, a fraction of
// the permutes of one vector at a time in the main loop (AVX2 without value lines: a gather per
// vector)
inline void decode8(const CodecDesc& c, const uint8_t* codes, int64_t n, float* out) {
  if (ValueLines::present(c)) {
    ValueLines(c.lines).decode_all([codes](int64_t i) { return Isa::unpack8(codes + i); }, n, out);
    return;
  }
  constexpr int G = Isa::kGroup;
  const Isa::T256P t = Isa::table256p(c.qmap, c.qmap_words, c.qmap_bytes);
  int64_t i = 0;
  F v[G];
  // U groups per turn where a group is one vector (AVX2's gathers): one prefetch and one count
  // per 32 codes instead of per 8
  constexpr int U = G == 1 ? 4 : 1;
  for (; i + U * G * W <= n; i += U * G * W) {
    __builtin_prefetch(codes + i + kPrefetch, 0);  // the next tile's codes (the same tensor's, usually)
    for (int u = 0; u < U; ++u) {
      Isa::decode256n(t, codes + i + u * G * W, v);
      for (int h = 0; h < G; ++h) Isa::store(out + i + (u * G + h) * W, v[h]);
    }
  }
  for (; i + G * W <= n; i += G * W) {
    Isa::decode256n(t, codes + i, v);
    for (int h = 0; h < G; ++h) Isa::store(out + i + h * W, v[h]);
  }
  if (i < n) {  // fewer than G vectors left: look up the last one in the unused slots
    I idx[G];
    for (int h = 0; h < G; ++h) idx[h] = Isa::unpack8(codes + (i + h * W < n ? i + h * W : n - W));
    Isa::lookup256n(t, idx, v);
    for (int h = 0; i + h * W < n; ++h) Isa::store(out + i + h * W, v[h]);
  }
}

// ---------------------------------------------------------------------------------------------
// quantize one run of normalized values: codes[j] for n_j = normalize(x_j, r_j)
// Register-held 16-entry tables: for bits <= 4 the whole search tables; for wider codes the
// "coarse" entries [16k + 15] that resolve the first four levels of the binary search.
struct SearchTables {
  Isa::T16 near16, sr16, qmap16;
};

// normalize (element.h) of a vector: 0 where r = inf (a zero scale) or (ZeroNan) the product is
// NaN; ZeroNan = false leaves a NaN for quantizers that give it the code of 0 anyway
template <bool ZeroNan = true>
inline F normalize_v(F x, F r) {
  const I inf_bits(0x7f800000u);
  const F n = x * r;
  return Isa::select(Isa::eq_i(Isa::bits(r), inf_bits), F(0.0f), ZeroNan ? Isa::zero_nan(n) : n);
}

// finite_abs_bits (element.h) of a vector: the |x| bits, 0 for NaN and +-Inf. (A float compare:
// GCC turns the integer one, |x| bits < Inf's, into a min and an equality, one operation more.)
inline I finite_abs_v(F x) {
  const F a = Isa::abs(x);
  return Isa::keep_if(Isa::lt(a, F(__builtin_inff())), Isa::bits(a));
}

inline I search_nearest(const CodecDesc& c, const SearchTables& tb, F n) {
  I code(0u);
  if (c.bits <= 4) {
    for (uint32_t s = 8; s > 0; s >>= 1)
      code = Isa::add_if(Isa::lt(Isa::lookup16(tb.near16, code + I(s - 1)), n), code, I(s));
  } else {
    for (uint32_t s = 8; s > 0; s >>= 1)
      code = Isa::add_if(Isa::lt(Isa::lookup16(tb.near16, code + I(s - 1)), n), code, I(s));
    code = code << 4;
    for (uint32_t s = 8; s > 0; s >>= 1)
      code = Isa::add_if(Isa::lt(Isa::gather(c.mids, code + I(s - 1)), n), code, I(s));
  }
  return code;  // NaN compares false everywhere: code 0
}

inline I search_stochastic(const CodecDesc& c, const SearchTables& tb, F n, F u) {
  const F q0(c.qmap[0]), qL(c.qmap[c.levels - 1]);
  const auto nan = Isa::isnan(n);
  F nc = Isa::select(Isa::lt(n, q0), q0, n);
  nc = Isa::select(Isa::gt(nc, qL), qL, nc);
  I cnt(0u);  // #{k : qsearch[k] <= n}
  for (uint32_t s = 8; s > 0; s >>= 1)
    cnt = Isa::add_if(Isa::le(Isa::lookup16(tb.sr16, cnt + I(s - 1)), nc), cnt, I(s));
  if (c.bits > 4) {
    cnt = cnt << 4;
    for (uint32_t s = 8; s > 0; s >>= 1)
      cnt = Isa::add_if(Isa::le(Isa::gather(c.qsearch, cnt + I(s - 1)), nc), cnt, I(s));
  }
  I lo = Isa::max_i(cnt - I(1u), I(0u));
  lo = Isa::min_i(lo, I(static_cast<uint32_t>(c.levels - 2)));
  const I hi = lo + I(1u);
  const F q_lo = c.bits <= 4 ? Isa::lookup16(tb.qmap16, lo) : Isa::gather(c.qmap, lo);
  const F q_hi = c.bits <= 4 ? Isa::lookup16(tb.qmap16, hi) : Isa::gather(c.qmap, hi);
  const F p_up = qdiv(nc - q_lo, q_hi - q_lo);
  const I code = Isa::add_if(Isa::lt(u, p_up), lo, I(1u));
  return Isa::select_i(nan, I(0u), code);
}

// The random bits of elements first .. first+W-1 of a tensor from `scalar(k, element)` (hash_bits
// or half_bits), or, when the lanes' stream elements g = first + k.offset + j stay below one 2^32
// boundary, from `lanes(g's low words, g's high word)` in vector arithmetic.
template <class Scalar, class Lanes>
inline I stream_lanes(StreamKey k, uint64_t first, Scalar scalar, Lanes lanes) {
  if constexpr (W == 1) {
    return scalar(k, first);
  } else {
    const uint64_t e = first + k.offset;
    const uint32_t lo = static_cast<uint32_t>(e);
    if (lo > 0xFFFFFFFFu - (W - 1)) {  // the lanes cross a 2^32 boundary: per-lane scalar
      alignas(64) uint32_t tmp[W];
      for (int j = 0; j < W; ++j) tmp[j] = scalar(k, first + j);
      return Isa::load_i(tmp);
    }
    return lanes(Isa::iota() + I(lo), static_cast<uint32_t>(e >> 32));
  }
}

// the 32 random bits of elements first .. first+W-1 of a tensor (hash_bits: stream elements
// first + k.offset ..)
inline I hash_vec(StreamKey k, uint64_t first) {
  // (hash_bits through a lambda, not a function pointer: always_inline needs its callee known at
  // every optimization level, and the sanitized build's -O1 resolves no pointer before inlining)
  return stream_lanes(k, first, [](StreamKey key, uint64_t i) { return hash_bits(key, i); }, [&](I g, uint32_t hi) {
    return hash_pair<I>(g ^ I(k.k0), I(fold_high<uint32_t>(hi + k.k1)));
  });
}

// half_bits (element.h) of elements first .. first+W-1 of a tensor: lane g = first + k.offset + j
// takes the top half of hash_at(g >> 1) for even g, the low half (moved to the top) for odd g.
inline I half_bits_vec(StreamKey k, uint64_t first) {
  return stream_lanes(k, first, [](StreamKey key, uint64_t i) { return half_bits(key, i); }, [&](I g, uint32_t hi) {
    // g >> 1 within one 2^32 window of g: low word (g_lo >> 1) | (g_hi & 1) << 31, high g_hi >> 1
    const I q = (g >> 1) | I(hi << 31);
    const I h = hash_pair<I>(q ^ I(k.k0), I(fold_high<uint32_t>((hi >> 1) + k.k1)));
    return Isa::select_i(Isa::eq_i(g & I(1u), I(1u)), h << 16, h);
  });
}

// uniforms in [0, 1) for elements first .. first+W-1 of a stream
inline F uniforms(StreamKey k, uint64_t first) { return Isa::to_float(hash_vec(k, first) >> 8) * F(5.9604644775390625e-08f); }

// Quantize x[0..len) (elements start+off .. of the tensor) with reciprocal r (const or per element).
inline void quantize_run(const StateDesc& st, const SearchTables& tb, const float* x, int64_t len,
                         int64_t first, float rc, const float* rvec, bool comb, uint32_t* codes) {
  const CodecDesc& c = st.codec;
  int64_t j = 0;
  for (; j + W <= len; j += W) {
    F r = rvec == nullptr ? F(rc) : (comb ? Isa::fmax_nan(F(rc), Isa::load(rvec + j)) : Isa::load(rvec + j));
    const F n = normalize_v(Isa::load(x + j), r);
    I code;
    if (!c.stochastic) code = search_nearest(c, tb, n);
    else code = search_stochastic(c, tb, n, st.noise ? Isa::load(st.noise + first + j) : uniforms(st.key, first + j));
    Isa::store_i(codes + j, code);
  }
  for (; j < len; ++j) {
    const float r = rvec == nullptr ? rc : (comb ? fmax_nan(rc, rvec[j]) : rvec[j]);
    const float n = normalize(x[j], r);
    const float u = !c.stochastic ? 0.0f : (st.noise ? st.noise[first + j] : uniform01(hash_bits(st.key, first + j)));
    codes[j] = static_cast<uint32_t>(c.stochastic ? quantize_stochastic(n, u, c.qmap, c.qsearch, c.levels, c.bits)
                                                  : quantize_nearest(n, c.mids, c.bits));
  }
}

// The max of abs_bits over x[0..n): at least Inf's bits (0x7f800000) iff x has a NaN or an Inf.
inline uint32_t raw_absmax_bits(const float* x, int64_t n) {
  I acc(0u), acc1(0u), acc2(0u), acc3(0u);  // (four vectors per iteration: a maximum of integers
  const I mask(0x7fffffffu);                 // is the same in any order)
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {
    acc = Isa::max_u(acc, Isa::bits(Isa::load(x + j)) & mask);
    acc1 = Isa::max_u(acc1, Isa::bits(Isa::load(x + j + W)) & mask);
    acc2 = Isa::max_u(acc2, Isa::bits(Isa::load(x + j + 2 * W)) & mask);
    acc3 = Isa::max_u(acc3, Isa::bits(Isa::load(x + j + 3 * W)) & mask);
  }
  for (; j + W <= n; j += W) acc = Isa::max_u(acc, Isa::bits(Isa::load(x + j)) & mask);
  uint32_t m = Isa::hmax_u(Isa::max_u(Isa::max_u(acc, acc1), Isa::max_u(acc2, acc3)));
  for (; j < n; ++j) {
    const uint32_t b = abs_bits(x[j]);
    m = b > m ? b : m;
  }
  return m;
}

// The max of finite_abs_bits over x[0..n): the absmax bits of the finite elements, 0 if none.
// The vector loop keeps k = |x| bits + 2^23 as signed ints: finite values map in order onto
// [2^23, 2^31), NaN and +-Inf wrap around to negative ints, below the accumulator's 0 ("no finite
// element yet").
inline uint32_t finite_absmax_bits(const float* x, int64_t n) {
  I acc(0u);
  const I mask(0x7fffffffu), lift(0x00800000u);
  int64_t j = 0;
  for (; j + W <= n; j += W) acc = Isa::max_i(acc, (Isa::bits(Isa::load(x + j)) & mask) + lift);
  const uint32_t top = Isa::hmax_u(acc);  // every lane is >= 0: the unsigned max is the signed one
  uint32_t m = top == 0u ? 0u : top - 0x00800000u;
  for (; j < n; ++j) {
    const uint32_t b = finite_abs_bits(x[j]);
    m = b > m ? b : m;
  }
  return m;
}

// The absmax bits of the finite elements of x[0..n): the plain max of the |x| bits, and only when
// that shows a NaN or an Inf (rare) a second loop that leaves them out, so finite blocks cost
// what they did before non-finite values were excluded.
inline uint32_t absmax_bits(const float* x, int64_t n) {
  const uint32_t m = raw_absmax_bits(x, n);
  return m < 0x7f800000u ? m : finite_absmax_bits(x, n);
}

inline SearchTables tables_of(const CodecDesc& c) {
  SearchTables tb;
  tb.near16 = Isa::table16(c.bits <= 4 ? c.mids : c.coarse_mids);
  tb.sr16 = Isa::table16(c.bits <= 4 ? c.qsearch : c.coarse_qsearch);
  tb.qmap16 = Isa::table16(c.qmap);
  return tb;
}

// Quantize the tile's new values x[0..n) into the state's codes (and block scales when the state
// is single-pass).
inline void quantize(const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n, const float* x,
                     uint32_t* codes) {
  const CodecDesc& c = st.codec;
  const SearchTables tb = tables_of(c);
  if (!st.two_pass) {  // kBlock with whole blocks in the tile: new scale per block, then quantize
    const int64_t B = c.block;
    for (int64_t off = 0; off < n;) {
      const int64_t blk = (start + off) / B;
      const int64_t len = (blk + 1) * B - (start + off) < n - off ? (blk + 1) * B - (start + off) : n - off;
      const float s = scale_from_absmax_bits(absmax_bits(x + off, len));
      st.scales[blk] = s;
      quantize_run(st, tb, x + off, len, start + off, 1.0f / s, nullptr, false, codes + off);
      off += len;
    }
  } else {
    for_each_scale_run(c, t, st.new_recip, false, start, n,
                       [&](int64_t off, int64_t len, float cv, const float* vec, bool comb) {
                         quantize_run(st, tb, x + off, len, start + off, cv, vec, comb, codes + off);
                       });
  }
  pack_codes(codes, c.bits, start, n, st.codes);
}

// Pass 1: fold the tile's new values into this thread's absmax partials (the bits of the finite
// elements' absmax: finite_abs_bits).
inline void reduce_absmax(const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n, const float* x,
                          uint32_t* partial) {
  const CodecDesc& c = st.codec;
  auto fold_vec = [&](uint32_t* dst, const float* v, int64_t len) {
    int64_t j = 0;
    for (; j + W <= len; j += W)
      Isa::store_i(dst + j, Isa::max_u(Isa::load_i(dst + j), finite_abs_v(Isa::load(v + j))));
    for (; j < len; ++j) {
      const uint32_t b = finite_abs_bits(v[j]);
      dst[j] = b > dst[j] ? b : dst[j];
    }
  };
  const int64_t end = start + n;
  if (c.scale_kind == kBlock) {
    for (int64_t i = start; i < end;) {
      const int64_t blk = i / c.block;
      const int64_t e = (blk + 1) * c.block < end ? (blk + 1) * c.block : end;
      fold_max(partial + blk, absmax_bits(x + (i - start), e - i));
      i = e;
    }
  } else if (c.scale_kind == kDim1) {
    for (int64_t i = start; i < end;) {
      if (c.inner == 1) {
        const int64_t c0 = i % c.d1;
        const int64_t e = i + (c.d1 - c0) < end ? i + (c.d1 - c0) : end;
        fold_vec(partial + c0, x + (i - start), e - i);
        i = e;
      } else {
        const int64_t run = i / c.inner;
        const int64_t e = (run + 1) * c.inner < end ? (run + 1) * c.inner : end;
        fold_max(partial + run % c.d1, absmax_bits(x + (i - start), e - i));
        i = e;
      }
    }
  } else {
    for_each_rank1_row(t, start, n, [&](int64_t off, int64_t len, const int64_t* lead, int nlead, int64_t col) {
      const float* v = x + off;
      const uint32_t m = absmax_bits(v, len);
      for (int k = 0; k < nlead; ++k) fold_max(partial + lead[k], m);
      fold_vec(partial + col, v, len);
    });
  }
}
