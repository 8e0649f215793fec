// The CPU tile kernels' fast quantizers (part 2 of 3 of the per-ISA step template, see
// tile_codec.h): register-held search tables (Probe16, Search256), the arithmetic shortcuts
// (midpoint grid, octave lines), FastQuantizer and quantize_fast for 4/8-bit states, and the
// per-element fills of old scales and new reciprocals and the vectorized block scales they read.

// per-element values of a scale layout for the tile: scales combined with fmin (dequantize) or
// reciprocals combined with fmax (quantize)
inline void fill_per_element(const CodecDesc& c, const TensorDesc& t, const float* vals, bool use_min,
                             int64_t start, int64_t n, float* out) {
  for_each_scale_run(c, t, vals, use_min, start, n,
                     [&](int64_t off, int64_t len, float cv, const float* vec, bool comb) {
                       float* o = out + off;
                       int64_t j = 0;
                       if (vec == nullptr) {
                         const F v(cv);
#pragma GCC unroll 4
                         for (; j + W <= len; j += W) Isa::store(o + j, v);
                         for (; j < len; ++j) o[j] = cv;
                       } else if (!comb) {
#pragma GCC unroll 4
                         for (; j + W <= len; j += W) Isa::store(o + j, Isa::load(vec + j));
                         for (; j < len; ++j) o[j] = vec[j];
                       } else if (cv != cv) {  // fmin_nan / fmax_nan(NaN, x) = x
                         for (; j + W <= len; j += W) Isa::store(o + j, Isa::load(vec + j));
                         for (; j < len; ++j) o[j] = vec[j];
                       } else {  // cv is a number: one min/max that yields cv for a NaN x
                         const F v(cv);               // (scales and reciprocals are never -0)
                         if (use_min) {
#pragma GCC unroll 4
                           for (; j + W <= len; j += W) Isa::store(o + j, Isa::min_or(Isa::load(vec + j), v));
                         } else {
#pragma GCC unroll 4
                           for (; j + W <= len; j += W) Isa::store(o + j, Isa::max_or(Isa::load(vec + j), v));
                         }
                         for (; j < len; ++j) o[j] = use_min ? fmin_nan(cv, vec[j]) : fmax_nan(cv, vec[j]);
                       }
                     });
}

// a <= b (Le) or a < b -- a function, not a lambda: GCC does not apply #pragma GCC target to lambdas
template <bool Le>
inline Isa::M cmp_le_lt(F a, F b) {
  if constexpr (Le) return Isa::le(a, b);
  else return Isa::lt(a, b);
}

// 16-entry register tables shifted by the binary-search step: probe(c, s) = table[c + s - 1]
// becomes a plain permute of table_s at c (no index add). `shifted` holds table shifted by 3 then
// by 1 (CodecDesc::shifted16_*, built once with the codec tables, not per tile).
// Isa::kSplit16 (AVX2, where a 16-entry lookup is two permutes and a blend): the second probe is
// table[3] or table[11] by the first outcome (a blend of two broadcasts), and with k = c / 2 the
// third and fourth are 8-entry permutes, table[2k + 1] and table[2k]; the count is then 2k + the
// last outcome. The same probes in the same order, so the same counts.
struct Probe16 {
  Isa::T16 t4, t2, t1;
  float first;  // table[7]: the first probe is the same for every lane
  F second_lo, second_hi;  // kSplit16: table[3], table[11]
  Isa::T8 odd, even;       // kSplit16: table[2k + 1], table[2k]
  Probe16(const float* table, const float* shifted)
      : t4(Isa::table16(shifted)), t2(Isa::table16(shifted + 16)), t1(Isa::table16(table)), first(table[7]),
        second_lo(table[3]), second_hi(table[11]), odd(strided8(table + 1)), even(strided8(table)) {}
  static Isa::T8 strided8(const float* t) {  // t[0], t[2], .., t[14]
    alignas(64) float v[8];
    for (int k = 0; k < 8; ++k) v[k] = t[2 * k];
    return Isa::table8(v);
  }
  // #{k < 16 : table[k] < x} (Le=false) or <= x (Le=true) for sorted, +inf padded tables
  template <bool Le>
  I count(F x) const {
    if constexpr (Isa::kSplit16) {  // (the outcomes as all-ones masks: k = 4 a + 2 b, then + 1s)
      const auto m8 = cmp_le_lt<Le>(F(first), x);
      const I m4 = Isa::mask_i(cmp_le_lt<Le>(Isa::select(m8, second_hi, second_lo), x));
      I k = (Isa::mask_i(m8) & I(4u)) + (m4 & I(2u));
      k = Isa::inc_if(cmp_le_lt<Le>(Isa::lookup8(odd, k), x), k);
      return Isa::inc_if(cmp_le_lt<Le>(Isa::lookup8(even, k), x), k + k);
    }
    I c = Isa::select_i(cmp_le_lt<Le>(F(first), x), I(8u), I(0u));
    c = Isa::add_if(cmp_le_lt<Le>(Isa::lookup16(t4, c), x), c, I(4u));
    c = Isa::add_if(cmp_le_lt<Le>(Isa::lookup16(t2, c), x), c, I(2u));
    return Isa::add_if(cmp_le_lt<Le>(Isa::lookup16(t1, c), x), c, I(1u));
  }
};

// #{k : table[k] (<|<=) x} over a 256-entry table: 16 coarse probes in a register, 4 gathers
template <bool Le>
inline I count256(const Probe16& coarse, const float* table, F x) {
  I c = coarse.count<Le>(x) << 4;
  c = Isa::add_if(cmp_le_lt<Le>(Isa::gather(table + 7, c), x), c, I(8u));
  c = Isa::add_if(cmp_le_lt<Le>(Isa::gather(table + 3, c), x), c, I(4u));
  c = Isa::add_if(cmp_le_lt<Le>(Isa::gather(table + 1, c), x), c, I(2u));
  return Isa::add_if(cmp_le_lt<Le>(Isa::gather(table, c), x), c, I(1u));
}

// #{k : table[k] (<|<=) x} over a 256-entry sorted table with register tables only: a binary
// search over the 32 entries [8b + 7] gives the block b (copies of that table shifted by 7, 3, 1,
// CodecDesc::shifted32_*, make each probe a plain permute), then a 3-level binary search inside the block over the 7 "column"
// tables (column j holds [8b + j] for every b), whose probes are permutes by b blended by the
// earlier levels' outcomes: 8 compares in all.
struct Search256 {
  Isa::T32 coarse8, coarse4, coarse2, coarse1;  // coarse[b + 7], [b + 3], [b + 1], [b]
  Isa::T32 cols[7];
  float first;
  Search256(const float* coarse32, const float* shifted, const float* columns) {
    coarse8 = Isa::table32(shifted);
    coarse4 = Isa::table32(shifted + 32);
    coarse2 = Isa::table32(shifted + 64);
    coarse1 = Isa::table32(coarse32);
    for (int j = 0; j < 7; ++j) cols[j] = Isa::table32(columns + 32 * j);
    first = coarse32[15];
  }
  template <bool Le>
  I count(F x) const {
    I b = Isa::select_i(cmp_le_lt<Le>(F(first), x), I(16u), I(0u));
    b = Isa::add_if(cmp_le_lt<Le>(Isa::lookup32(coarse8, b), x), b, I(8u));
    b = Isa::add_if(cmp_le_lt<Le>(Isa::lookup32(coarse4, b), x), b, I(4u));
    b = Isa::add_if(cmp_le_lt<Le>(Isa::lookup32(coarse2, b), x), b, I(2u));
    b = Isa::add_if(cmp_le_lt<Le>(Isa::lookup32(coarse1, b), x), b, I(1u));
    // inside block b: [8b + 3], then [8b + 1] or [8b + 5], then [8b + 0 | 2 | 4 | 6]
    const auto k4 = cmp_le_lt<Le>(Isa::lookup32(cols[3], b), x);
    const F t2 = Isa::select(k4, Isa::lookup32(cols[5], b), Isa::lookup32(cols[1], b));
    const auto k2 = cmp_le_lt<Le>(t2, x);
    const F lo = Isa::select(k2, Isa::lookup32(cols[2], b), Isa::lookup32(cols[0], b));
    const F hi = Isa::select(k2, Isa::lookup32(cols[6], b), Isa::lookup32(cols[4], b));
    const auto k1 = cmp_le_lt<Le>(Isa::select(k4, hi, lo), x);
    I c = b << 3;
    c = Isa::add_if(k4, c, I(4u));
    c = Isa::add_if(k2, c, I(2u));
    return Isa::add_if(k1, c, I(1u));
  }
};

// (Near, the nearest-rounding method: element.h)
// kNearGrid: nearest rounding onto a map whose midpoints are an exact binary grid (CodecDesc::grid):
// no search. With z = n * L exact (L a power of two) and c = o + 1/2, o >= 0: z - c is exact
// whenever z >= c / 2 (Sterbenz, or c a multiple of ulp(z)), and negative otherwise, so
// ceil(z - c) clamped to [0, levels-1] is #{k : mid_k < n}; NaN converts to INT32_MIN -> code 0,
// +inf is capped first -> the top code, like the search.
// kNearLines*: 8-bit maps that are linear per octave of |n| (the smaller of two lines each:
// qconf/codec/octave_lines.py, which proves the estimate for every float32): j = a * S + A
// (mirrored, K - j, for negative n of signed maps) lands within one code below the answer, so
// r = clamp(rint(j)) and one probe of the midpoints, r + (mid[r] < n), replace the 8-compare
// search: ~2/3 of the operations and a much shorter dependency chain.
// Stands in for Search256 where the ISA searches 256-entry tables with gathers (count256): no
// tables to load; count is never called there.
struct NoSearch256 {
  NoSearch256(const float*, const float*, const float*) {}
  template <bool Le>
  I count(F) const {
    return I(0u);
  }
};

template <int BITS, bool SR, int NEAR = kNearSearch>
struct FastQuantizer {
  using Search = std::conditional_t<Isa::kPermute256, Search256, NoSearch256>;
  const StateDesc& st;
  Probe16 near, sr;
  F q0, qL;
  I lo_max;
  Isa::T16 qmap16;
  Search near256, sr256;
  Isa::T256 qmap256;
  explicit FastQuantizer(const StateDesc& s)
      : st(s),
        near(BITS == 4 ? s.codec.mids : s.codec.coarse_mids,
             BITS == 4 ? s.codec.shifted16_mids : s.codec.shifted16_coarse_mids),
        sr(BITS == 4 ? s.codec.qsearch : s.codec.coarse_qsearch,
           BITS == 4 ? s.codec.shifted16_qsearch : s.codec.shifted16_coarse_qsearch),
        q0(s.codec.qmap[0]),
        qL(s.codec.qmap[s.codec.levels - 1]),
        lo_max(static_cast<uint32_t>(s.codec.levels - 2)),
        qmap16(Isa::table16(s.codec.qmap)),
        near256(s.codec.coarse32_mids, s.codec.shifted32_mids, s.codec.cols_mids),
        sr256(s.codec.coarse32_qsearch, s.codec.shifted32_qsearch, s.codec.cols_qsearch),
        qmap256(Isa::table256(s.codec.qmap)),
        grid_L(s.codec.grid[kGridL]),
        grid_c(s.codec.grid[kGridC]),
        grid_cap(static_cast<float>(s.codec.levels)),
        top(static_cast<uint32_t>(s.codec.levels - 1)),
        slope1(Isa::table32(s.codec.lines + kLinesSlope1)),
        offset1(Isa::table32(s.codec.lines + kLinesOffset1)),
        slope2(Isa::table32(s.codec.lines + kLinesSlope2)),
        offset2(Isa::table32(s.codec.lines + kLinesOffset2)),
        mirror(s.codec.lines[kLinesMirror]),
        mids256(Isa::table256p(s.codec.mids, s.codec.mids_words, s.codec.mids_bytes)),
        seg_b1(Isa::table8(s.codec.lines + kSegBounds)),
        seg_b2(Isa::table8(s.codec.lines + kSegBounds + 1)),
        seg_slope(Isa::table8(s.codec.lines + kSegSlope)),
        seg_offset(Isa::table8(s.codec.lines + kSegOffset)),
        seg_cap(Isa::table8(s.codec.lines + kSegCap)),
        seg_top(Isa::table8(s.codec.lines + kSegTop)),
        seg_b4(s.codec.lines[kSegBounds + 3]),
        seg_eps(s.codec.lines[kSegEps]) {}
  F grid_L, grid_c, grid_cap;
  I top;
  Isa::T32 slope1, offset1, slope2, offset2;
  F mirror;
  Isa::T256P mids256;
  Isa::T8 seg_b1, seg_b2, seg_slope, seg_offset, seg_cap, seg_top;  // kNearSegments*
  F seg_b4, seg_eps;
  static constexpr bool kLines = NEAR == kNearLinesUnsigned || NEAR == kNearLinesSigned;
  static constexpr bool kSegments = NEAR == kNearSegmentsUnsigned || NEAR == kNearSegmentsSigned;
  static constexpr bool kSigned = NEAR == kNearLinesSigned || NEAR == kNearSegmentsSigned;

  // the lines' argument: a = max(n, 2^-31) (NaN, negatives -> 2^-31) for unsigned maps, |n| for
  // signed ones (NaN stays), capped below 2
  static F line_arg(F n) {
    if constexpr (kSigned) return Isa::min_or(F(1.99999988f), Isa::abs(n));
    else return Isa::min_or(F(1.99999988f), Isa::max_or(n, F(4.65661287e-10f)));
  }

  // kNearLines*: the line estimate r; the code is r or r + 1
  I line_index(F n) const {
    static_assert(BITS == 8 && Isa::kTable32, "octave lines index 32-entry register tables");
    // a's biased exponent, at least 96, is the octave (the permutes read it mod 32)
    const F a = line_arg(n);
    I o = Isa::bits(a) >> 23;
    if constexpr (kSigned) o = Isa::max_i(o, I(96u));
    // the smaller of the octave's two lines (one line: the same twice), each one fused
    // multiply-add; NaN stays NaN
    F j = Isa::min_or(qfma(a, Isa::lookup32(slope1, o), Isa::lookup32(offset1, o)),
                      qfma(a, Isa::lookup32(slope2, o), Isa::lookup32(offset2, o)));
    if constexpr (NEAR == kNearLinesSigned) j = Isa::select(Isa::lt(n, F(0.0f)), mirror - j, j);
    // octave_lines checked 0 <= r < 256 (the padded midpoint table) for every input but NaN,
    // which only the signed form lets through (INT32_MIN -> 0)
    const I r = Isa::rint_to_int(j);
    if constexpr (NEAR == kNearLinesSigned) return Isa::max_i(r, I(0u));
    else return r;
  }
  // the nearest codes of Isa::kGroup vectors: one probe of the midpoints for all
  void code_group(const F* n, I* c) const {
    constexpr int G = Isa::kGroup;
    I r[G];
    F m[G];
    for (int h = 0; h < G; ++h) r[h] = line_index(n[h]);
    Isa::lookup256n(mids256, r, m);
    for (int h = 0; h < G; ++h) c[h] = Isa::inc_if(Isa::lt(m[h], n[h]), r[h]);
  }

  // kNearSegments* (qconf/codec/segment_lines.py): the segment d = #{s : B[s] <= a} by a
  // 3-level search (B[4], then B[d + 2], then B[d + 1]); j = its line capped at T[d] (a signed
  // map's junction point itself at T[d] + 1/2), mirrored for negative n; the code is ceil(j),
  // or, for the rare j within eps of an integer, r = rint(j) plus one probe of the midpoints.
  // Not clamped (NaN gives INT32_MIN): the stores saturate to [0, 255] (segment_lines proves
  // the clamped codes).
  I segment_code(F n) const {
    const F a = line_arg(n);
    I d = Isa::mask_i(Isa::le(seg_b4, a)) & I(4u);
    d = Isa::add_if(Isa::le(Isa::lookup8(seg_b2, d), a), d, I(2u));
    d = Isa::inc_if(Isa::le(Isa::lookup8(seg_b1, d), a), d);
    F cap = Isa::lookup8(seg_cap, d);
    if constexpr (kSigned) cap = cap + Isa::select(Isa::eq(a, Isa::lookup8(seg_top, d)), F(0.5f), F(0.0f));
    F j = Isa::min_or(cap, qfma(a, Isa::lookup8(seg_slope, d), Isa::lookup8(seg_offset, d)));  // (NaN stays)
    if constexpr (kSigned) j = Isa::select(Isa::lt(n, F(0.0f)), mirror - j, j);
    const F jr = Isa::round_even(j);
    const auto near_int = Isa::le(Isa::abs(j - jr), seg_eps);  // (j - jr is exact)
    I code = Isa::ceil_to_int(j);  // NaN -> INT32_MIN
    if (__builtin_expect(Isa::any(near_int), 0)) {
      const I rp = Isa::min_i(Isa::max_i(Isa::integral_to_int(jr), I(0u)), top);
      code = Isa::select_i(near_int, Isa::inc_if(Isa::lt(Isa::gather(st.codec.mids, rp), n), rp), code);
    }
    return code;
  }

  I count_near(F n) const {
    if constexpr (kSegments) return segment_code(n);
    if constexpr (kLines) {  // (a tile's last vectors, fewer than a group)
      F ns[Isa::kGroup];
      I c[Isa::kGroup];
      for (int h = 0; h < Isa::kGroup; ++h) ns[h] = n;
      code_group(ns, c);
      return c[0];
    }
    if constexpr (NEAR == kNearGrid) return Isa::min_i(Isa::max_i(grid_raw(n), I(0u)), top);
    if constexpr (BITS == 4) return near.count<false>(n);
    else if constexpr (Isa::kPermute256) return near256.count<false>(n);
    else return count256<false>(near, st.codec.mids, n);
  }
  // kNearGrid: ceil(n * L - c) before the clamp to [0, levels - 1] (INT32_MIN for NaN)
  I grid_raw(F n) const {
    F y = n * grid_L - grid_c;
    y = Isa::min_or(grid_cap, y);  // cap +inf (keeps NaN: min_or yields y when y is NaN)
    return Isa::ceil_to_int(y);
  }
  I count_sr(F n) const {
    if constexpr (BITS == 4) return sr.count<true>(n);
    else if constexpr (Isa::kPermute256) return sr256.count<true>(n);
    else return count256<true>(sr, st.codec.qsearch, n);
  }

  I code(F n, uint64_t first) const {
    if constexpr (!SR) {
      return count_near(n);
    } else {
      F nc = Isa::select(Isa::lt(n, q0), q0, n);
      nc = Isa::select(Isa::gt(nc, qL), qL, nc);
      const I cnt = count_sr(nc);
      const I lo = Isa::min_i(Isa::max_i(cnt - I(1u), I(0u)), lo_max);
      const F q_lo = BITS == 4 ? Isa::lookup16(qmap16, lo) : Isa::lookup256(qmap256, lo);
      const F q_hi = BITS == 4 ? Isa::lookup16(qmap16, lo + I(1u)) : Isa::lookup256(qmap256, lo + I(1u));
      const F p_up = qdiv(nc - q_lo, q_hi - q_lo);
      // (a NaN n would give code 0 here too: no compare holds, and u < NaN is false; the
      // normalizers below never pass one)
      return Isa::add_if(Isa::lt(uniforms(st.key, first), p_up), lo, I(1u));
    }
  }

  static void store(uint8_t* codes, I code, int64_t e) {  // (e >= 0: an unsigned halving is one shift)
    if constexpr (BITS == 4) Isa::pack4(codes + static_cast<uint64_t>(e) / 2, code);
    else if constexpr (kSegments) Isa::pack8(codes + e, Isa::min_i(Isa::max_i(code, I(0u)), I(255u)));  // (as pack8x4_sat)
    else Isa::pack8(codes + e, code);
  }

  // Whether a NaN n already gets the code of 0, so the normalizers need not map NaN to 0: the
  // grid (NaN converts to INT32_MIN and clamps to code 0; its maps have mids[0] > 0, so 0 gets
  // code 0 too) and the unsigned octave and segment lines (max_or(NaN, 2^-31) = max_or(0, 2^-31),
  // and the probe mid[r] < n is false for both, as every midpoint is positive; segment_lines
  // checks NaN's code as well).
  static constexpr bool kNanCodesLikeZero =
      !SR && (NEAR == kNearGrid || NEAR == kNearLinesUnsigned || NEAR == kNearSegmentsUnsigned);

  // normalized values of vector j: one reciprocal per vector (0 for a zero block: 0 * 0
  // normalizes to 0 like the reference), or per element (inf marks a zero scale). NaN products
  // (NaN elements, or an Inf in a zero block) must get the code of 0, as normalize (element.h)
  // maps them to 0: PerElement does it in the loop unless kNanCodesLikeZero; PerVector leaves
  // them (code 0) to recode_nan, which runs only for tiles that have non-finite values.
  // (shifted(j): the same values from element j on, j >= 0 a multiple of W)
  struct PerVector {
    const float *x, *r;
    F operator()(int64_t j) const { return Isa::load(x + j) * F(r[static_cast<uint64_t>(j) / W]); }  // (j >= 0)
    PerVector shifted(int64_t j) const { return {x + j, r + static_cast<uint64_t>(j) / W}; }
  };
  struct PerElement {
    const float *x, *r;
    PerElement shifted(int64_t j) const { return {x + j, r + j}; }
    F operator()(int64_t j) const {
      if constexpr (kNanCodesLikeZero) return normalize_v<false>(Isa::load(x + j), Isa::load(r + j));
      else return normalize_v<true>(Isa::load(x + j), Isa::load(r + j));
    }
  };
  // codes of elements first..first+len-1 (len a multiple of W) from norm(0), norm(W), ... The
  // codes pointer is a local: stores through uint8_t* may alias anything, so st.codes would be
  // reloaded after every store.
  template <class Norm>
  void run(Norm norm, int64_t len, int64_t first, NextLines& next) const {
    uint8_t* const codes = st.codes;
    NextLines nx = next;  // (a local, for the same reason)
    int64_t j = 0;
    if constexpr (kLines) {
      constexpr int G = Isa::kGroup;
      F n[G];
      I c[G];
      for (; j + kQuantizeStride <= len && j % kQuantizeStride == 0; j += kQuantizeStride) {
        nx.step();
        const Norm nj = norm.shifted(j);
        uint8_t* const cj = codes + first + j;
#pragma GCC unroll 16
        for (int64_t k = 0; k < kQuantizeStride; k += G * W) {
          for (int h = 0; h < G; ++h) n[h] = nj(k + h * W);
          code_group(n, c);
          Isa::pack8n(cj + k, c);
        }
      }
      for (; j + G * W <= len; j += G * W) {
        if (j % kQuantizeStride == 0) nx.step();
        for (int h = 0; h < G; ++h) n[h] = norm(j + h * W);
        code_group(n, c);
        Isa::pack8n(codes + first + j, c);
      }
    }
    // one prefetch step per kQuantizeStride elements, the vectors between unrolled and addressed
    // at constant offsets from the stride's pointers
    for (; j + kQuantizeStride <= len && j % kQuantizeStride == 0; j += kQuantizeStride) {
      nx.step();
      const Norm nj = norm.shifted(j);
      const int64_t fj = first + j;
      uint8_t* const cj = codes + static_cast<uint64_t>(fj) * BITS / 8;
      if constexpr (BITS == 4 && NEAR == kNearGrid && !SR) {  // the grid's clamp in the pack
        const uint32_t top_code = static_cast<uint32_t>(st.codec.levels - 1);
#pragma GCC unroll 64
        for (int64_t k = 0; k < kQuantizeStride; k += 4 * W)
          Isa::pack4x4_clamp(cj + k / 2, grid_raw(nj(k)), grid_raw(nj(k + W)), grid_raw(nj(k + 2 * W)),
                             grid_raw(nj(k + 3 * W)), top_code);
      } else if constexpr (kSegments) {  // four vectors per store, clamped by saturation
#pragma GCC unroll 64
        for (int64_t k = 0; k < kQuantizeStride; k += 4 * W)
          Isa::pack8x4_sat(cj + k, count_near(nj(k)), count_near(nj(k + W)), count_near(nj(k + 2 * W)),
                           count_near(nj(k + 3 * W)));
      } else if constexpr (BITS == 4) {  // four vectors per packed store
#pragma GCC unroll 64
        for (int64_t k = 0; k < kQuantizeStride; k += 4 * W)
          Isa::pack4x4(cj + k / 2, code(nj(k), fj + k), code(nj(k + W), fj + k + W),
                       code(nj(k + 2 * W), fj + k + 2 * W), code(nj(k + 3 * W), fj + k + 3 * W));
      } else {
#pragma GCC unroll 64
        for (int64_t k = 0; k < kQuantizeStride; k += W) store(cj, code(nj(k), fj + k), k);
      }
    }
    for (; j < len; j += W) {
      if (j % kQuantizeStride == 0) nx.step();
      store(codes, code(norm(j), first + j), first + j);
    }
    next = nx;
  }
};

inline float run_recip(float s) { return s == 0.0f ? 0.0f : 1.0f / s; }

// The rare path of quantize_fast's single-pass loop, for a tile with NaN or Inf values: elements
// whose product x * r is NaN (a NaN element, or an Inf one in a zero block) were given code 0 by
// the register loop; give them the code of 0 instead, as the reference's normalize does. (The
// scalar forms of element.h give the register loops' codes: FastQuantizer's uniforms are
// uniform01(hash_bits).) The codes are written in place: 4-bit ones as nibbles.
template <int BITS, bool SR>
inline void recode_nan(const StateDesc& st, const float* x, const float* rbuf, int64_t start, int64_t n) {
  const CodecDesc& c = st.codec;
  for (int64_t j = 0; j < n; ++j) {
    const float prod = x[j] * rbuf[j / W];
    if (prod == prod) continue;
    const int64_t e = start + j;
    const uint32_t code = static_cast<uint32_t>(
        SR ? quantize_stochastic(0.0f, uniform01(hash_bits(st.key, static_cast<uint64_t>(e))), c.qmap, c.qsearch,
                                 c.levels, c.bits)
           : quantize_nearest(0.0f, c.mids, c.bits));
    if constexpr (BITS == 4) {
      uint8_t& byte = st.codes[e / 2];
      byte = static_cast<uint8_t>((e & 1) ? (byte & 0x0Fu) | (code << 4) : (byte & 0xF0u) | code);
    } else {
      st.codes[e] = static_cast<uint8_t>(code);
    }
  }
}

// Lane b: raw_absmax_bits of block b (b < nb <= W) of the tile, from the main loop's per-chunk
// lane-wise maxima (chunk_max, W lanes per chunk; per_block chunks per block); lanes from nb on
// are 0.
inline I block_absmax_lanes(const uint32_t* chunk_max, int64_t per_block, int nb) {
  I acc[W];
  for (int b = 0; b < W; ++b) {
    I a(0u);
    if (b < nb) {
      for (int64_t q = 0; q < per_block; ++q) a = Isa::max_u(a, Isa::load_i(chunk_max + (b * per_block + q) * W));
    }
    acc[b] = a;
  }
  return Isa::hmax_lanes(acc, nb);
}

// rbuf's per-vector reciprocals of elements off .. off+len-1 of the tile: r, in whole-register
// stores (a block's last store may run up to W-1 entries past its vectors; Buffers has room)
inline void fill_recip_per_vector(float* rbuf, int64_t off, int64_t len, float r) {
  const F rv(r);
  for (int64_t v = off / W; v < (off + len) / W; v += W) Isa::store(rbuf + v, rv);
}

// The new scales of the whole blocks of a tile (start a multiple of B, and B of kMainChunk), W
// blocks at a time: st.scales and one reciprocal per vector in rbuf, as the per-block loop of
// quantize_fast gives them (scale_from_absmax_bits, run_recip), for a vector of blocks at once.
// The maxima come from the main loop (chunk_max); a block with a NaN or an Inf sets nonfinite
// and takes finite_absmax_bits of x. Returns the number of elements done.
inline int64_t block_scales_lanes(const StateDesc& st, int64_t start, int64_t n, const float* x,
                                  const uint32_t* chunk_max, float* rbuf, bool& nonfinite) {
  const int64_t B = st.codec.block;
  if (!Isa::kBlockMaxLanes || B % kMainChunk != 0 || start % B != 0) return 0;
  const int64_t blocks = n / B, first_block = start / B, per_block = B / kMainChunk;
  const I min_bits(0x00800000u);  // FLT_MIN
  alignas(64) uint32_t mv[W];
  alignas(64) float sv[W], rv[W];
  for (int64_t b0 = 0; b0 < blocks; b0 += W) {
    const int nb = blocks - b0 < W ? static_cast<int>(blocks - b0) : W;
    I m = block_absmax_lanes(chunk_max + b0 * per_block * W, per_block, nb);
    if (Isa::hmax_u(m) >= 0x7f800000u) {  // rare: some block has a NaN or an Inf
      nonfinite = true;
      Isa::store_i(mv, m);
      for (int b = 0; b < nb; ++b)
        if (mv[b] >= 0x7f800000u) mv[b] = finite_absmax_bits(x + (b0 + b) * B, B);
      m = Isa::load_i(mv);
    }
    // scale_from_absmax_bits: a nonzero maximum below FLT_MIN becomes FLT_MIN (m < 2^31: signed
    // max); run_recip: 1 / s, 0 for a zero scale
    const auto zero = Isa::eq_i(m, I(0u));
    const F s = Isa::from_bits(Isa::select_i(zero, I(0u), Isa::max_i(m, min_bits)));
    Isa::store(sv, s);
    Isa::store(rv, Isa::select(zero, F(0.0f), qdiv(F(1.0f), s)));
    for (int b = 0; b < nb; ++b) {
      st.scales[first_block + b0 + b] = sv[b];
      fill_recip_per_vector(rbuf, (b0 + b) * B, B, rv[b]);
    }
  }
  return blocks * B;
}

template <int BITS, bool SR, int NEAR = kNearSearch>
void quantize_fast(const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n, const float* x, float* rbuf,
                   NextLines& next, const uint32_t* chunk_max) {
  const FastQuantizer<BITS, SR, NEAR> q(st);
  if (!st.two_pass) {
    // all the tile's new block scales first (a vector of blocks at a time from the main loop's
    // chunk maxima, then any partial block), then one quantize loop over the tile with a
    // reciprocal per vector
    const int64_t B = st.codec.block;
    bool nonfinite = false;
    int64_t off = block_scales_lanes(st, start, n, x, chunk_max, rbuf, nonfinite);
    int64_t blk = (start + off) / B;
    for (; off < n; ++blk) {
      const int64_t len = (blk + 1) * B - (start + off) < n - off ? (blk + 1) * B - (start + off) : n - off;
      const uint32_t m = raw_absmax_bits(x + off, len);  // >= Inf's bits iff the block has NaN / Inf
      nonfinite = nonfinite || m >= 0x7f800000u;
      const float s = scale_from_absmax_bits(m < 0x7f800000u ? m : finite_absmax_bits(x + off, len));
      st.scales[blk] = s;
      fill_recip_per_vector(rbuf, off, len, run_recip(s));
      off += len;
    }
    q.run(typename FastQuantizer<BITS, SR, NEAR>::PerVector{x, rbuf}, n, start, next);
    if (!FastQuantizer<BITS, SR, NEAR>::kNanCodesLikeZero && nonfinite) recode_nan<BITS, SR>(st, x, rbuf, start, n);
  } else {
    fill_per_element(st.codec, t, st.new_recip, false, start, n, rbuf);
    q.run(typename FastQuantizer<BITS, SR, NEAR>::PerElement{x, rbuf}, n, start, next);
  }
}

// 8-bit nearest rounding by segment lines (AVX2, where the codec has them) or octave lines when
// the codec has them (form 1 or 2) and the ISA holds 32-entry tables in registers (AVX-512 probes
// the midpoints with byte-plane permutes); false: the caller searches
inline bool quantize_lines(int form, const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n,
                           const float* x, float* rbuf, NextLines& next, const uint32_t* chunk_max) {
  if constexpr (Isa::kSegmentLines) {
    if (st.codec.lines[kSegPresent] == 1.0f && (form == 1 || form == 2)) {
      if (form == 1) quantize_fast<8, false, kNearSegmentsUnsigned>(st, t, start, n, x, rbuf, next, chunk_max);
      else quantize_fast<8, false, kNearSegmentsSigned>(st, t, start, n, x, rbuf, next, chunk_max);
      return true;
    }
  }
  if constexpr (Isa::kTable32) {
    if (form == 1) quantize_fast<8, false, kNearLinesUnsigned>(st, t, start, n, x, rbuf, next, chunk_max);
    if (form == 2) quantize_fast<8, false, kNearLinesSigned>(st, t, start, n, x, rbuf, next, chunk_max);
    return form == 1 || form == 2;
  } else {
    return false;
  }
}
