// The CPU optimizer-step template: one tile of one tensor at a time,
//
//   load grad/param -> dequantize states -> update rule (fp32) -> new scales -> quantize -> store
//
// with every intermediate in a per-thread L1/L2-resident tile buffer (never O(numel) scratch).
// The update rule is a policy (AdamRule, SgdRule, LionRule in element.h); the state format comes
// from the StateDesc at run time (fp32, or codes + scales of any codec), so the rule never knows
// how a state is stored. This header is compiled once per ISA: each csrc/cpu/step_<isa>.cpp sets
// `#pragma GCC target`, defines QCONF_ISA_*, and includes it inside namespace qconf::isa_<isa>
// after simd.h (which defines the `Isa` traits used below).
//
// Tiles start at multiples of 64 elements (so packed codes of any width start on a byte) and, for
// states whose blocks fit a tile, at block boundaries: such a state is finished inside the tile
// (single pass). States whose scales need the whole tensor (tensor/dim1/rank1, huge blocks) take
// two passes: pass 1 computes the new values and reduces their absmax into per-thread partials,
// the driver combines them, pass 2 recomputes the values and quantizes with the new scales.

using F = Isa::F;
using I = Isa::I;
constexpr int W = Isa::W;

struct Buffers {
  float* g;
  float* p;
  float* s[2];
  float* vhat;
  uint32_t* codes;
  float* storage;
  explicit Buffers(int64_t tile) {
    const int64_t n = tile + 64;
    storage = new float[6 * n];
    g = storage;
    p = storage + n;
    s[0] = storage + 2 * n;
    s[1] = storage + 3 * n;
    vhat = storage + 4 * n;
    codes = reinterpret_cast<uint32_t*>(storage + 5 * n);
  }
  ~Buffers() { delete[] storage; }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
};

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
    for (; i + W <= n; i += W) Isa::store(dst + i, Isa::load_bf16(s + i));
    for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + start;
    for (; i + W <= n; i += W) Isa::store(dst + i, Isa::load_f16(s + i));
    for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
}

// Round to nearest even into a bf16/fp16 tensor (fp32 params are updated in place instead).
inline void store_from_f32(void* dst, int32_t dtype, int64_t start, int64_t n, const float* src) {
  int64_t i = 0;
  uint16_t* d = static_cast<uint16_t*>(dst) + start;
  if (dtype == kBF16) {
    for (; i + W <= n; i += W) Isa::store_bf16(d + i, Isa::load(src + i));
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
// scale layout walker: calls fn(offset, len, c, vec, combine) for each run of elements of the
// tile [start, start+n) whose per-element value is `c` (vec == nullptr), `vec[j]`, or
// combine(c, vec[j]) (rank1). `vals` is the per-stored-scale array (scales or reciprocals).
template <class Fn>
inline void for_each_scale_run(const CodecDesc& c, const TensorDesc& t, const float* vals, bool use_min,
                               int64_t start, int64_t n, Fn&& fn) {
  const int64_t end = start + n;
  if (c.scale_kind == kBlock) {
    const int64_t B = c.block;
    for (int64_t i = start; i < end;) {
      const int64_t blk = i / B;
      const int64_t e = (blk + 1) * B < end ? (blk + 1) * B : end;
      fn(i - start, e - i, vals[blk], static_cast<const float*>(nullptr), false);
      i = e;
    }
  } else if (c.scale_kind == kDim1) {
    const int64_t d1 = c.d1, inner = c.inner;
    if (inner == 1) {
      for (int64_t i = start; i < end;) {
        const int64_t c0 = i % d1;
        const int64_t e = i + (d1 - c0) < end ? i + (d1 - c0) : end;
        fn(i - start, e - i, 0.0f, vals + c0, false);
        i = e;
      }
    } else {
      for (int64_t i = start; i < end;) {
        const int64_t run = i / inner;
        const int64_t e = (run + 1) * inner < end ? (run + 1) * inner : end;
        fn(i - start, e - i, vals[run % d1], static_cast<const float*>(nullptr), false);
        i = e;
      }
    }
  } else {  // kRank1, ndim >= 2: rows along the last dimension
    const int nd = t.ndim;
    const int64_t C = t.shape[nd - 1];
    int64_t last_off = 0;
    for (int d = 0; d < nd - 1; ++d) last_off += t.shape[d];
    for (int64_t i = start; i < end;) {
      const int64_t r = i / C;
      const int64_t c0 = i - r * C;
      const int64_t e = i + (C - c0) < end ? i + (C - c0) : end;
      // combine the leading dims' values for row r
      float part = 0.0f;
      bool have = false;
      int64_t rem = r, off = last_off;
      for (int d = nd - 2; d >= 0; --d) {
        off -= t.shape[d];
        const int64_t idx = rem % t.shape[d];
        rem /= t.shape[d];
        const float v = vals[off + idx];
        part = !have ? v : (use_min ? fmin_nan(part, v) : fmax_nan(part, v));
        have = true;
      }
      fn(i - start, e - i, part, vals + last_off + c0, true);
      i = e;
    }
  }
}

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

// ---------------------------------------------------------------------------------------------
// quantize one run of normalized values: codes[j] for n_j = normalize(x_j, r_j)
// Register-held 16-entry tables: for bits <= 4 the whole search tables; for wider codes the
// "coarse" entries [16k + 15] that resolve the first four levels of the binary search.
struct SearchTables {
  Isa::T16 near16, sr16, qmap16;
};

inline F normalize_v(F x, F r) {
  const I inf_bits(0x7f800000u);
  return Isa::select(Isa::eq_i(Isa::bits(r), inf_bits), F(0.0f), x * r);
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

// uniforms for elements first .. first+W-1 of the state's stream
inline F uniforms(StreamKey k, uint64_t first) {
  if constexpr (W == 1) {
    return uniform01(hash_bits(k, first));
  } else {
    const uint32_t lo = static_cast<uint32_t>(first);
    if (lo > 0xFFFFFFFFu - (W - 1)) {  // the lanes cross a 2^32 boundary: per-lane scalar
      alignas(64) float tmp[W];
      for (int j = 0; j < W; ++j) tmp[j] = uniform01(hash_bits(k, first + j));
      return Isa::load(tmp);
    }
    const I idx = Isa::iota() + I(lo);
    const I h = mix32<I>(idx ^ I(k.k0));
    const I h2 = mix32<I>(h ^ I(static_cast<uint32_t>(first >> 32) + k.k1));
    return Isa::to_float(h2 >> 8) * F(5.9604644775390625e-08f);
  }
}

// Quantize x[0..len) (elements start+off .. of the tensor) with reciprocal r (const or per element).
inline void quantize_run(const StateDesc& st, const SearchTables& tb, const float* x, int64_t len,
                         int64_t first, float rc, const float* rvec, bool comb, uint32_t* codes) {
  const CodecDesc& c = st.codec;
  int64_t j = 0;
  for (; j + W <= len; j += W) {
    F r = rvec == nullptr ? F(rc) : (comb ? Isa::fmax_nan(F(rc), Isa::load(rvec + j)) : Isa::load(rvec + j));
    const F n = normalize_v(Isa::load(x + j), r);
    const I code = c.stochastic ? search_stochastic(c, tb, n, uniforms(st.key, first + j)) : search_nearest(c, tb, n);
    Isa::store_i(codes + j, code);
  }
  for (; j < len; ++j) {
    const float r = rvec == nullptr ? rc : (comb ? fmax_nan(rc, rvec[j]) : rvec[j]);
    const float n = normalize(x[j], r);
    codes[j] = static_cast<uint32_t>(
        c.stochastic ? quantize_stochastic(n, uniform01(hash_bits(st.key, first + j)), c.qmap, c.qsearch, c.levels,
                                           c.bits)
                     : quantize_nearest(n, c.mids, c.bits));
  }
}

inline uint32_t absmax_bits(const float* x, int64_t n) {
  I acc(0u);
  const I mask(0x7fffffffu);
  int64_t j = 0;
  for (; j + W <= n; j += W) acc = Isa::max_u(acc, Isa::bits(Isa::load(x + j)) & mask);
  uint32_t m = Isa::hmax_u(acc);
  for (; j < n; ++j) {
    const uint32_t b = abs_bits(x[j]);
    m = b > m ? b : m;
  }
  return m;
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

// Pass 1: fold the tile's new values into this thread's absmax partials (bits, NaN-propagating).
inline void reduce_absmax(const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n, const float* x,
                          uint32_t* partial) {
  const CodecDesc& c = st.codec;
  const I mask(0x7fffffffu);
  auto fold_vec = [&](uint32_t* dst, const float* v, int64_t len) {
    int64_t j = 0;
    for (; j + W <= len; j += W)
      Isa::store_i(dst + j, Isa::max_u(Isa::load_i(dst + j), Isa::bits(Isa::load(v + j)) & mask));
    for (; j < len; ++j) {
      const uint32_t b = abs_bits(v[j]);
      dst[j] = b > dst[j] ? b : dst[j];
    }
  };
  auto fold_one = [](uint32_t* dst, uint32_t m) { *dst = m > *dst ? m : *dst; };
  const int64_t end = start + n;
  if (c.scale_kind == kBlock) {
    for (int64_t i = start; i < end;) {
      const int64_t blk = i / c.block;
      const int64_t e = (blk + 1) * c.block < end ? (blk + 1) * c.block : end;
      fold_one(partial + blk, absmax_bits(x + (i - start), e - i));
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
        fold_one(partial + run % c.d1, absmax_bits(x + (i - start), e - i));
        i = e;
      }
    }
  } else {
    const int nd = t.ndim;
    const int64_t C = t.shape[nd - 1];
    int64_t last_off = 0;
    for (int d = 0; d < nd - 1; ++d) last_off += t.shape[d];
    for (int64_t i = start; i < end;) {
      const int64_t r = i / C;
      const int64_t c0 = i - r * C;
      const int64_t e = i + (C - c0) < end ? i + (C - c0) : end;
      const float* v = x + (i - start);
      const uint32_t m = absmax_bits(v, e - i);
      int64_t rem = r, off = last_off;
      for (int d = nd - 2; d >= 0; --d) {
        off -= t.shape[d];
        fold_one(partial + off + rem % t.shape[d], m);
        rem /= t.shape[d];
      }
      fold_vec(partial + last_off + c0, v, e - i);
      i = e;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// the update rule over a tile
template <class Rule>
inline void apply_rule(float* p, const float* g, float* s0, float* s1, int64_t n, const Scalars& h, bool update_v) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F P = Isa::load(p + i), A = Isa::load(s0 + i);
    F B = Rule::kStates == 2 ? Isa::load(s1 + i) : F(0.0f);
    Rule::apply(P, Isa::load(g + i), A, B, h, update_v);
    Isa::store(p + i, P);
    Isa::store(s0 + i, A);
    if (Rule::kStates == 2 && update_v) Isa::store(s1 + i, B);
  }
  for (; i < n; ++i) {
    float P = p[i], A = s0[i], B = Rule::kStates == 2 ? s1[i] : 0.0f;
    Rule::apply(P, g[i], A, B, h, update_v);
    p[i] = P;
    s0[i] = A;
    if (Rule::kStates == 2 && update_v) s1[i] = B;
  }
}

// factored second moment: vhat[i] = row_factor[r] * col[batch, c] for the tile
inline void fill_vhat(const TensorDesc& t, int64_t start, int64_t n, float* vhat) {
  const int64_t C = t.cols, R = t.shape[t.ndim - 2];
  const int64_t end = start + n;
  for (int64_t i = start; i < end;) {
    const int64_t r = i / C;
    const int64_t c0 = i - r * C;
    const int64_t e = i + (C - c0) < end ? i + (C - c0) : end;
    const float* col = t.col + (r / R) * C + c0;
    const F rf(t.row_factor[r]);
    float* o = vhat + (i - start);
    int64_t j = 0;
    for (; j + W <= e - i; j += W) Isa::store(o + j, rf * Isa::load(col + j));
    for (; j < e - i; ++j) o[j] = t.row_factor[r] * col[j];
    i = e;
  }
}

// pass 1 of a factored tensor: sums of g_eff^2 per row (16 fixed lanes, the same association on
// every ISA) and per column within this row chunk (rows added in order)
template <class Rule>
inline void factor_reduce(const TensorDesc& t, int64_t chunk, Buffers& b) {
  const int64_t C = t.cols, R = t.shape[t.ndim - 2];
  const int64_t r0 = chunk * t.rows_per_chunk;
  const int64_t r1 = r0 + t.rows_per_chunk < t.rows ? r0 + t.rows_per_chunk : t.rows;
  float* colp = t.col_partial + chunk * (t.rows / R) * C;  // this chunk's column sums: [batch][C]
  for (int64_t r = r0; r < r1; ++r) {
    load_as_f32(t.grad, t.gdtype, r * C, C, b.g);
    load_as_f32(t.param, t.pdtype, r * C, C, b.p);
    for (int64_t j = 0; j < C; ++j) {
      const float ge = Rule::effective_grad(b.p[j], b.g[j], t.h);
      b.vhat[j] = ge * ge;
    }
    float acc[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= C; j += 16)
      for (int k = 0; k < 16; ++k) acc[k] = acc[k] + b.vhat[j + k];
    for (int k = 0; j < C; ++j, ++k) acc[k] = acc[k] + b.vhat[j];
    for (int w = 8; w > 0; w >>= 1)
      for (int k = 0; k < w; ++k) acc[k] = acc[k] + acc[k + w];
    t.row_sum[r] = acc[0];
    float* dst = colp + (r / R) * C;
    for (int64_t c = 0; c < C; ++c) dst[c] = dst[c] + b.vhat[c];
  }
}

template <class Rule>
inline void process_tile(TensorDesc& t, int64_t start, int64_t n, int32_t phase, int32_t tid, Buffers& b) {
  const bool final_pass = phase == kPassApply;
  const float* g;
  if (t.gdtype == kF32) {
    g = static_cast<const float*>(t.grad) + start;
  } else {
    load_as_f32(t.grad, t.gdtype, start, n, b.g);
    g = b.g;
  }
  float* p;
  if (t.pdtype == kF32 && final_pass) {
    p = static_cast<float*>(t.param) + start;
  } else {
    load_as_f32(t.param, t.pdtype, start, n, b.p);
    p = b.p;
  }
  float* s[2];
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    if (st.kind == kFp32) {
      if (final_pass) {
        s[k] = st.values + start;
      } else {
        load_as_f32(st.values, kF32, start, n, b.s[k]);
        s[k] = b.s[k];
      }
    } else {
      if (st.kind == kQuant) dequantize(st, t, start, n, b.s[k], b.codes);
      s[k] = b.s[k];
    }
  }
  bool update_v = true;
  if (t.factored) {
    fill_vhat(t, start, n, b.vhat);
    s[1] = b.vhat;
    update_v = false;
  }
  apply_rule<Rule>(p, g, s[0], s[1], n, t.h, update_v);
  if (!final_pass) {
    for (int k = 0; k < 2; ++k) {
      const StateDesc& st = t.st[k];
      if (st.kind == kQuant && st.two_pass) reduce_absmax(st, t, start, n, s[k], st.partial + tid * st.num_scales);
    }
    return;
  }
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    if (st.kind == kQuant) quantize(st, t, start, n, s[k], b.codes);
  }
  if (t.pdtype != kF32) store_from_f32(t.param, t.pdtype, start, n, p);
}

template <class Rule>
inline void run_items_rule(const StepContext& ctx, const WorkItem* items, int64_t begin, int64_t end, int32_t phase,
                           int32_t tid) {
  Buffers b(ctx.max_tile);
  for (int64_t k = begin; k < end; ++k) {
    TensorDesc& t = ctx.tensors[items[k].tensor];
    if (phase == kPassFactor) {
      if constexpr (Rule::kStates == 2) factor_reduce<Rule>(t, items[k].start, b);
    } else {
      process_tile<Rule>(t, items[k].start, items[k].len, phase, tid, b);
    }
  }
}

void run_items(const StepContext& ctx, const WorkItem* items, int64_t begin, int64_t end, int32_t phase,
               int32_t tid) {
  switch (ctx.rule) {
    case kRuleAdam: run_items_rule<AdamRule>(ctx, items, begin, end, phase, tid); break;
    case kRuleSgd: run_items_rule<SgdRule>(ctx, items, begin, end, phase, tid); break;
    default: run_items_rule<LionRule>(ctx, items, begin, end, phase, tid); break;
  }
}
