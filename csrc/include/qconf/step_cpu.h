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

struct Buffers {
  NextLines next;
  float* g;
  float* p;
  float* s[2];   // new state values
  float* sc[2];  // old scales, then reciprocals (per vector or per element)
  float* vhat;
  uint32_t* codes;
  float* storage;
  explicit Buffers(int64_t tile) {
    const int64_t n = tile + 64;
    storage = new float[8 * n];
    g = storage;
    p = storage + n;
    s[0] = storage + 2 * n;
    s[1] = storage + 3 * n;
    sc[0] = storage + 4 * n;
    sc[1] = storage + 5 * n;
    vhat = storage + 6 * n;
    codes = reinterpret_cast<uint32_t*>(storage + 7 * n);
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

// bf16 pattern (low 16 bits of the lanes) of x, round to nearest even, NaN quiet
inline I bf16_rne_bits(F x) {
  const I u = Isa::bits(x);
  const I rounded = (u + I(0x7fffu) + ((u >> 16) & I(1u))) >> 16;
  return Isa::select_i(Isa::isnan(x), (u >> 16) | I(0x40u), rounded);
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
// rank1 layout: one value per index of every dim, concatenated (shape[0] values, shape[1], ...).
// Calls fn(off, len, lead, nlead, col) for each run of the tile [start, start+n) inside one row
// along the last dim: lead[0..nlead) are the slots of the row's leading-dim values (last leading
// dim first), col the slot of the run's first column value.
template <class Fn>
inline void for_each_rank1_row(const TensorDesc& t, int64_t start, int64_t n, Fn&& fn) {
  const int nd = t.ndim;
  const int64_t C = t.shape[nd - 1], end = start + n;
  int64_t last_off = 0;
  for (int d = 0; d < nd - 1; ++d) last_off += t.shape[d];
  int64_t lead[kMaxDims];
  for (int64_t i = start; i < end;) {
    const int64_t r = i / C;
    const int64_t c0 = i - r * C;
    const int64_t e = i + (C - c0) < end ? i + (C - c0) : end;
    int64_t rem = r, off = last_off;
    for (int d = nd - 2; d >= 0; --d) {
      off -= t.shape[d];
      lead[nd - 2 - d] = off + rem % t.shape[d];
      rem /= t.shape[d];
    }
    fn(i - start, e - i, lead, nd - 1, last_off + c0);
    i = e;
  }
}

// rank1: the value a row contributes, combined over its leading dims' slots lead[0..nlead):
// scales with fmin (dequantize) or reciprocals with fmax (quantize), NaN-ignoring
inline float rank1_row_part(const float* vals, const int64_t* lead, int nlead, bool use_min) {
  float part = vals[lead[0]];
  for (int k = 1; k < nlead; ++k) part = use_min ? fmin_nan(part, vals[lead[k]]) : fmax_nan(part, vals[lead[k]]);
  return part;
}

// max of a partial maximum (abs bit patterns) and m
inline void fold_max(uint32_t* dst, uint32_t m) { *dst = m > *dst ? m : *dst; }

// ---------------------------------------------------------------------------------------------
// scale layout walker: calls fn(offset, len, c, vec, combine) for each run of elements of the
// tile [start, start+n) whose per-element value is `c` (vec == nullptr), `vec[j]`, or
// combine(c, vec[j]) (rank1). `vals` is the per-stored-scale array (scales or reciprocals).
template <class Fn>
inline void for_each_scale_run(const CodecDesc& c, const TensorDesc& t, const float* vals, bool use_min,
                               int64_t start, int64_t n, Fn&& fn) {
  const int64_t end = start + n;
  // one division per tile; runs then advance incrementally
  if (c.scale_kind == kBlock) {
    const int64_t B = c.block;
    int64_t blk = start / B;
    for (int64_t i = start; i < end; ++blk) {
      const int64_t e = (blk + 1) * B < end ? (blk + 1) * B : end;
      fn(i - start, e - i, vals[blk], static_cast<const float*>(nullptr), false);
      i = e;
    }
  } else if (c.scale_kind == kDim1) {
    const int64_t d1 = c.d1, inner = c.inner;
    if (inner == 1) {
      int64_t c0 = start % d1;
      for (int64_t i = start; i < end; c0 = 0) {
        const int64_t e = i + (d1 - c0) < end ? i + (d1 - c0) : end;
        fn(i - start, e - i, 0.0f, vals + c0, false);
        i = e;
      }
    } else {
      int64_t run = start / inner, j = run % d1;
      for (int64_t i = start; i < end; ++run, j = j + 1 == d1 ? 0 : j + 1) {
        const int64_t e = (run + 1) * inner < end ? (run + 1) * inner : end;
        fn(i - start, e - i, vals[j], static_cast<const float*>(nullptr), false);
        i = e;
      }
    }
  } else {  // kRank1, ndim >= 2: combine the leading dims' values of each row
    for_each_rank1_row(t, start, n, [&](int64_t off, int64_t len, const int64_t* lead, int nlead, int64_t col) {
      fn(off, len, rank1_row_part(vals, lead, nlead, use_min), vals + col, true);
    });
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

// the 32 random bits of elements first .. first+W-1 of a stream
inline I hash_vec(StreamKey k, uint64_t first) {
  if constexpr (W == 1) {
    return hash_bits(k, first);
  } else {
    const uint32_t lo = static_cast<uint32_t>(first);
    if (lo > 0xFFFFFFFFu - (W - 1)) {  // the lanes cross a 2^32 boundary: per-lane scalar
      alignas(64) uint32_t tmp[W];
      for (int j = 0; j < W; ++j) tmp[j] = hash_bits(k, first + j);
      return Isa::load_i(tmp);
    }
    const I idx = Isa::iota() + I(lo);
    const I h = mix32<I>(idx ^ I(k.k0));
    return mix32<I>(h ^ I(static_cast<uint32_t>(first >> 32) + k.k1));
  }
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


// ---------------------------------------------------------------------------------------------
// Tile pipeline. Each stage is a tight loop specialized at compile time; old scales are written
// to a buffer first (one per vector or per element), so the main loop never branches on layouts:
//   1. gradient / parameter as fp32 (pointers into fp32 tensors, converted copies otherwise)
//   2. per quantized state: old scales (for 4/8-bit codes), or a full generic dequant
//   3. main loop, specialized on the two state formats: dequantize 4/8-bit codes in registers,
//      apply the rule, write new values (fp32 states in place on the final pass)
//   4. pass 1: fold absmax into the thread's partials and stop (rank-1 states: rank1_reduce does
//      2-4 in one loop); final pass: the tile's new block scales (single-pass) or per-element new
//      reciprocals (two-pass), then quantize and pack
//   kIOQ4/kIOQ8: 4/8-bit codes with per-element old scales (two-pass layouts: rank1, dim1, ...)
//   kIOQ4B/kIOQ8B: the same codes with one old scale per vector (single-pass blocks, block % W == 0)
enum StateIO : int { kIONone = 0, kIOF32 = 1, kIOQ4 = 4, kIOQ4B = 5, kIOQ8 = 8, kIOQ8B = 9 };
constexpr bool io_q4(int io) { return io == kIOQ4 || io == kIOQ4B; }
constexpr bool io_q8(int io) { return io == kIOQ8 || io == kIOQ8B; }
constexpr int64_t kPrefetch = 1024;  // elements ahead (one tile)

struct StateIn {
  const float* values = nullptr;  // kIOF32: read from here
  float* out = nullptr;           // new values go here (in place for kIOF32 on the final pass)
  const uint8_t* codes = nullptr; // kIOQ4/kIOQ8: packed codes of the tile
  const float* scale = nullptr;   // old scales of the tile: per element, or per vector (kIOQ*B)
  const float* qmap = nullptr;
  Isa::T256 q256{};               // kIOQ8: the map as a table (filled only then), or on
  const float* decoded = nullptr; // kPermute256 ISAs qmap[code] of the whole tile (decode8)
};

// qmap[code] of n 8-bit codes (n a multiple of W) into out: Isa::kGroup vectors per lookup in
// the map's planes, a fraction of the permutes of one vector at a time in the main loop
inline void decode8(const CodecDesc& c, const uint8_t* codes, int64_t n, float* out) {
  constexpr int G = Isa::kGroup;
  const Isa::T256P t = Isa::table256p(c.qmap, c.qmap_words, c.qmap_bytes);
  int64_t i = 0;
  F v[G];
  for (; i + G * W <= n; i += G * W) {
    __builtin_prefetch(codes + i + kPrefetch, 0);  // the next tile's codes (the same tensor's, usually)
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

// Fills s for the 8-bit codes of state st in a tile: decoded into `scratch` ahead of the loop
// that reads them (kPermute256 ISAs), or the map as a table for per-vector lookups
inline void prepare_codes8(StateIn& s, const StateDesc& st, int64_t n, float* scratch) {
  if constexpr (Isa::kPermute256) {
    decode8(st.codec, s.codes, n, scratch);
    s.decoded = scratch;
  } else {
    s.q256 = Isa::table256(st.codec.qmap);
  }
}

template <int IO>
inline F old_scale(const StateIn& s, int64_t i) {
  if constexpr (IO == kIOQ4B || IO == kIOQ8B) return F(s.scale[i / W]);
  else return Isa::load(s.scale + i);
}

// qmap[code] of elements i .. i+W-1 of the tile (4/8-bit kinds)
template <int IO>
inline F code_value(const StateIn& s, int64_t i) {
  if constexpr (io_q4(IO)) return Isa::lookup16_packed4(Isa::table16(s.qmap), s.codes + i / 2);
  else if constexpr (Isa::kPermute256) return Isa::load(s.decoded + i);
  else return Isa::lookup256(s.q256, Isa::unpack8(s.codes + i));
}

template <int IO>
inline F load_state(const StateIn& s, int64_t i) {
  if constexpr (IO == kIOF32) {
    return Isa::load(s.values + i);
  } else if constexpr (io_q4(IO) || io_q8(IO)) {
    return code_value<IO>(s, i) * old_scale<IO>(s, i);
  } else {
    return F(0.0f);
  }
}

// (the 4/8-bit kinds only occur for whole vectors: state_io)
template <int IO>
inline float load_state_scalar(const StateIn& s, int64_t i) {
  if constexpr (IO == kIOF32) return s.values[i];
  else return 0.0f;
}

// StoreP=false (pass 1): only the states' new values are needed; the parameter math is dead code.
template <class Rule, int IO0, int IO1, bool StoreP = true>
void main_loop(float* p, const float* g, const StateIn& s0_, const StateIn& s1_, int64_t n, const Scalars& hs,
               bool update_v, NextLines& next) {
  const Scalars h = hs;  // local copies: the rule's scalars, the state pointers and the
  const StateIn s0 = s0_, s1 = s1_;  // prefetch cursor stay in registers (stores through float*
  NextLines nx = next;               // could alias the references)
  int64_t i = 0;
  if constexpr (W > 1) {
    for (; i + W <= n; i += W) {
      if ((i & (nx.main_elems - 1)) == 0) nx.step();
      F P = Isa::load(p + i);
      F A = load_state<IO0>(s0, i);
      F B = load_state<IO1>(s1, i);
      Rule::apply(P, Isa::load(g + i), A, B, h, update_v);
      if constexpr (StoreP) Isa::store(p + i, P);
      if constexpr (IO0 != kIONone) Isa::store(s0.out + i, A);
      if constexpr (IO1 != kIONone) {
        if (update_v) Isa::store(s1.out + i, B);
      }
    }
  }
  for (; i < n; ++i) {
    float P = p[i], A = load_state_scalar<IO0>(s0, i), B = load_state_scalar<IO1>(s1, i);
    Rule::apply(P, g[i], A, B, h, update_v);
    if constexpr (StoreP) p[i] = P;
    if constexpr (IO0 != kIONone) s0.out[i] = A;
    if constexpr (IO1 != kIONone) {
      if (update_v) s1.out[i] = B;
    }
  }
  next = nx;
}

// Dispatch on the two state kinds. Pass 1 (StoreP=false) only sees two-pass states, whose
// scales are per element, so the per-vector kinds are instantiated for the final pass only.
template <class Rule, bool StoreP, int IO0>
void main_loop_1(float* p, const float* g, const StateIn& s0, int io1, const StateIn& s1, int64_t n,
                 const Scalars& h, bool update_v, NextLines& next) {
  if constexpr (Rule::kStates == 1) {
    main_loop<Rule, IO0, kIONone, StoreP>(p, g, s0, s1, n, h, update_v, next);
  } else {
    switch (io1) {
      case kIOF32: main_loop<Rule, IO0, kIOF32, StoreP>(p, g, s0, s1, n, h, update_v, next); break;
      case kIOQ4: main_loop<Rule, IO0, kIOQ4, StoreP>(p, g, s0, s1, n, h, update_v, next); break;
      case kIOQ8: main_loop<Rule, IO0, kIOQ8, StoreP>(p, g, s0, s1, n, h, update_v, next); break;
      case kIOQ4B:
        if constexpr (StoreP) main_loop<Rule, IO0, kIOQ4B, StoreP>(p, g, s0, s1, n, h, update_v, next);
        break;
      case kIOQ8B:
        if constexpr (StoreP) main_loop<Rule, IO0, kIOQ8B, StoreP>(p, g, s0, s1, n, h, update_v, next);
        break;
      default: main_loop<Rule, IO0, kIONone, StoreP>(p, g, s0, s1, n, h, update_v, next); break;
    }
  }
}

template <class Rule, bool StoreP>
void run_main_loop(float* p, const float* g, int io0, const StateIn& s0, int io1, const StateIn& s1, int64_t n,
                   const Scalars& h, bool update_v, NextLines& next) {
  switch (io0) {
    case kIOF32: main_loop_1<Rule, StoreP, kIOF32>(p, g, s0, io1, s1, n, h, update_v, next); break;
    case kIOQ4: main_loop_1<Rule, StoreP, kIOQ4>(p, g, s0, io1, s1, n, h, update_v, next); break;
    case kIOQ8: main_loop_1<Rule, StoreP, kIOQ8>(p, g, s0, io1, s1, n, h, update_v, next); break;
    case kIOQ4B:
      if constexpr (StoreP) main_loop_1<Rule, StoreP, kIOQ4B>(p, g, s0, io1, s1, n, h, update_v, next);
      break;
    case kIOQ8B:
      if constexpr (StoreP) main_loop_1<Rule, StoreP, kIOQ8B>(p, g, s0, io1, s1, n, h, update_v, next);
      break;
    default: main_loop_1<Rule, StoreP, kIONone>(p, g, s0, io1, s1, n, h, update_v, next); break;
  }
}

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
                         for (; j + W <= len; j += W) Isa::store(o + j, v);
                         for (; j < len; ++j) o[j] = cv;
                       } else if (!comb) {
                         for (; j + W <= len; j += W) Isa::store(o + j, Isa::load(vec + j));
                         for (; j < len; ++j) o[j] = vec[j];
                       } else if (cv != cv) {  // fmin_nan / fmax_nan(NaN, x) = x
                         for (; j + W <= len; j += W) Isa::store(o + j, Isa::load(vec + j));
                         for (; j < len; ++j) o[j] = vec[j];
                       } else {  // cv is a number: one min/max that yields cv for a NaN x
                         const F v(cv);               // (scales and reciprocals are never -0)
                         if (use_min) {
                           for (; j + W <= len; j += W) Isa::store(o + j, Isa::min_or(Isa::load(vec + j), v));
                         } else {
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
struct Probe16 {
  Isa::T16 t4, t2, t1;
  float first;  // table[7]: the first probe is the same for every lane
  Probe16(const float* table, const float* shifted)
      : t4(Isa::table16(shifted)), t2(Isa::table16(shifted + 16)), t1(Isa::table16(table)), first(table[7]) {}
  // #{k < 16 : table[k] < x} (Le=false) or <= x (Le=true) for sorted, +inf padded tables
  template <bool Le>
  I count(F x) const {
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

// How nearest rounding finds a code: the binary search over the midpoints, or one of two
// arithmetic shortcuts that the codec table enables only where they are exact for every input.
enum Near : int { kNearSearch = 0, kNearGrid = 1, kNearLinesUnsigned = 2, kNearLinesSigned = 3 };

// kNearGrid: nearest rounding onto a map whose midpoints are an exact binary grid (CodecDesc::grid):
// no search. With z = n * L exact (L a power of two) and c = o + 1/2, o >= 0: z - c is exact
// whenever z >= c / 2 (Sterbenz, or c a multiple of ulp(z)), and negative otherwise, so
// ceil(z - c) clamped to [0, levels-1] is #{k : mid_k < n}; NaN converts to INT32_MIN -> code 0,
// +inf is capped first -> the top code, like the search.
// kNearLines*: 8-bit maps that are linear per octave of |n| (the smaller of two lines each:
// qconf/ops/octave_lines.py, which proves the estimate for every float32): j = a * S + A
// (mirrored, K - j, for negative n of signed maps) lands within one code below the answer, so
// r = clamp(rint(j)) and one probe of the midpoints, r + (mid[r] < n), replace the 8-compare
// search: ~2/3 of the operations and a much shorter dependency chain.
template <int BITS, bool SR, int NEAR = kNearSearch>
struct FastQuantizer {
  const StateDesc& st;
  Probe16 near, sr;
  F q0, qL;
  I lo_max;
  Isa::T16 qmap16;
  Search256 near256, sr256;
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
        grid_L(s.codec.grid[0]),
        grid_c(s.codec.grid[1]),
        grid_cap(static_cast<float>(s.codec.levels)),
        top(static_cast<uint32_t>(s.codec.levels - 1)),
        slope1(Isa::table32(s.codec.lines + kLinesSlope1)),
        offset1(Isa::table32(s.codec.lines + kLinesOffset1)),
        slope2(Isa::table32(s.codec.lines + kLinesSlope2)),
        offset2(Isa::table32(s.codec.lines + kLinesOffset2)),
        mirror(s.codec.lines[kLinesMirror]),
        mids256(Isa::table256p(s.codec.mids, s.codec.mids_words, s.codec.mids_bytes)) {}
  F grid_L, grid_c, grid_cap;
  I top;
  Isa::T32 slope1, offset1, slope2, offset2;
  F mirror;
  Isa::T256P mids256;
  static constexpr bool kLines = NEAR == kNearLinesUnsigned || NEAR == kNearLinesSigned;

  // kNearLines*: the line estimate r; the code is r or r + 1
  I line_index(F n) const {
    static_assert(BITS == 8 && Isa::kPermute256, "octave lines index 32-entry register tables");
    // a = max(n, 2^-31) (NaN, negatives -> 2^-31) or |n|, capped below 2 (NaN stays); its
    // biased exponent, at least 96, is the octave (the permutes read it mod 32)
    F a;
    I o;
    if constexpr (NEAR == kNearLinesUnsigned) {
      a = Isa::min_or(F(1.99999988f), Isa::max_or(n, F(4.65661287e-10f)));
      o = Isa::bits(a) >> 23;
    } else {
      a = Isa::min_or(F(1.99999988f), Isa::from_bits(Isa::bits(n) & I(0x7fffffffu)));
      o = Isa::max_i(Isa::bits(a) >> 23, I(96u));
    }
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
    for (int h = 0; h < G; ++h) c[h] = Isa::add_if(Isa::lt(m[h], n[h]), r[h], I(1u));
  }

  I count_near(F n) const {
    if constexpr (kLines) {  // (a tile's last vectors, fewer than a group)
      F ns[Isa::kGroup];
      I c[Isa::kGroup];
      for (int h = 0; h < Isa::kGroup; ++h) ns[h] = n;
      code_group(ns, c);
      return c[0];
    }
    if constexpr (NEAR == kNearGrid) {
      F y = n * grid_L - grid_c;
      y = Isa::min_or(grid_cap, y);  // cap +inf (keeps NaN: min_or yields y when y is NaN)
      return Isa::min_i(Isa::max_i(Isa::ceil_to_int(y), I(0u)), top);
    }
    if constexpr (BITS == 4) return near.count<false>(n);
    else if constexpr (Isa::kPermute256) return near256.count<false>(n);
    else return count256<false>(near, st.codec.mids, n);
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
      const I code = Isa::add_if(Isa::lt(uniforms(st.key, first), p_up), lo, I(1u));
      return Isa::select_i(Isa::isnan(n), I(0u), code);
    }
  }

  static void store(uint8_t* codes, I code, int64_t e) {
    if constexpr (BITS == 4) Isa::pack4(codes + e / 2, code);
    else Isa::pack8(codes + e, code);
  }

  // normalized values of vector j: one reciprocal per vector (0 for a zero block: 0 * 0
  // normalizes to 0 like the reference), or per element (inf marks a zero scale)
  struct PerVector {
    const float *x, *r;
    F operator()(int64_t j) const { return Isa::load(x + j) * F(r[j / W]); }
  };
  struct PerElement {
    const float *x, *r;
    F operator()(int64_t j) const { return normalize_v(Isa::load(x + j), Isa::load(r + j)); }
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
      for (; j + G * W <= len; j += G * W) {
        if (j % kQuantizeStride == 0) nx.step();
        for (int h = 0; h < G; ++h) n[h] = norm(j + h * W);
        code_group(n, c);
        Isa::pack8n(codes + first + j, c);
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

template <int BITS, bool SR, int NEAR = kNearSearch>
void quantize_fast(const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n, const float* x, float* rbuf,
                   NextLines& next) {
  const FastQuantizer<BITS, SR, NEAR> q(st);
  if (!st.two_pass) {
    // all the tile's new block scales first (their reductions and divisions overlap), then one
    // quantize loop over the tile with a reciprocal per vector
    const int64_t B = st.codec.block;
    int64_t blk = start / B;
    for (int64_t off = 0; off < n; ++blk) {
      const int64_t len = (blk + 1) * B - (start + off) < n - off ? (blk + 1) * B - (start + off) : n - off;
      const float s = scale_from_absmax_bits(absmax_bits(x + off, len));
      st.scales[blk] = s;
      const F r(run_recip(s));  // per vector; whole-register stores (Buffers has room to spare)
      for (int64_t v = off / W; v < (off + len) / W; v += W) Isa::store(rbuf + v, r);
      off += len;
    }
    q.run(typename FastQuantizer<BITS, SR, NEAR>::PerVector{x, rbuf}, n, start, next);
  } else {
    fill_per_element(st.codec, t, st.new_recip, false, start, n, rbuf);
    q.run(typename FastQuantizer<BITS, SR, NEAR>::PerElement{x, rbuf}, n, start, next);
  }
}

// 8-bit nearest rounding by octave lines when the codec has them (form 1 or 2) and the ISA
// holds 32-entry tables in registers; false: the caller searches
inline bool quantize_lines(int form, const StateDesc& st, const TensorDesc& t, int64_t start, int64_t n,
                           const float* x, float* rbuf, NextLines& next) {
  if constexpr (Isa::kPermute256) {
    if (form == 1) quantize_fast<8, false, kNearLinesUnsigned>(st, t, start, n, x, rbuf, next);
    if (form == 2) quantize_fast<8, false, kNearLinesSigned>(st, t, start, n, x, rbuf, next);
    return form == 1 || form == 2;
  } else {
    return false;
  }
}

// Whether the 4/8-bit register paths apply to this state in this tile: whole vectors, and every
// single-pass block a multiple of the vector width (so no vector straddles two blocks).
inline int state_io(const StateDesc& st, int64_t start, int64_t n) {
  if (st.kind == kNone) return kIONone;
  if (st.kind == kFp32) return kIOF32;
  const CodecDesc& c = st.codec;
  if (!Isa::kFastPack || W == 1 || (c.bits != 4 && c.bits != 8) || n % W != 0 || start % W != 0) return kIOF32;
  if (!st.two_pass) return c.block % W != 0 ? kIOF32 : c.bits + 1;  // kIOQ4B / kIOQ8B
  return c.bits;  // kIOQ4 / kIOQ8
}

// one old scale per vector of a single-pass block state (blocks are whole vectors: state_io),
// in whole-register stores: a block's last store may run up to W-1 entries past its vectors (the
// next block's stores overwrite them; Buffers leaves room after the tile's last vector)
inline void fill_per_vector(const CodecDesc& c, const float* scales, int64_t start, int64_t n, float* out) {
  const int64_t per_block = c.block / W;
  int64_t blk = start / c.block, v = 0;
  const int64_t nv = n / W;
  for (int64_t k = (start % c.block) / W; v < nv; ++blk, k = 0) {
    const int64_t count = per_block - k < nv - v ? per_block - k : nv - v;
    const F s(scales[blk]);
    for (int64_t q = 0; q < count; q += W) Isa::store(out + v + q, s);
    v += count;
  }
}


// ---------------------------------------------------------------------------------------------
// Pass 1 of a rank-1 state with 4/8-bit codes, in one loop per row run: old scale
// min(row, col) -> dequantize -> rule -> fold |new| into the row's and the columns' partial
// maxima. (The generic pass writes the old scales, the new values and re-reads both.) Only state
// K's new value is used; the other state's math is dead code.
template <class Rule, int K, int IO>
inline void rank1_reduce(const TensorDesc& t, int64_t start, int64_t n, const float* p, const float* g,
                         uint32_t* partial, float* scratch, NextLines& next) {
  const StateDesc& st = t.st[K];
  const uint8_t* codes = st.codes + start * st.codec.bits / 8;
  const float* scales = st.scales;
  const Scalars h = t.h;
  const I mask(0x7fffffffu);
  StateIn in;
  in.codes = codes;
  in.qmap = st.codec.qmap;
  if constexpr (io_q8(IO)) prepare_codes8(in, st, n, scratch);
  for_each_rank1_row(t, start, n, [&](int64_t off, int64_t len, const int64_t* lead, int nlead, int64_t col) {
    const float part = rank1_row_part(scales, lead, nlead, true);
    const F row_scale(part);
    const bool row_nan = part != part;  // fmin_nan(NaN, col) = col
    const float* col_scale = scales + col;
    uint32_t* col_max = partial + col;
    I row_max(0u);
    NextLines nx = next;  // (a local: the stores to col_max could alias it)
    for (int64_t j = 0; j < len; j += W) {
      nx.step();  // pass 1 streams the parameter and gradient from memory
      const F col_j = Isa::load(col_scale + j);
      const F scale = row_nan ? col_j : Isa::min_or(col_j, row_scale);
      F P = Isa::load(p + off + j);
      F S[2] = {F(0.0f), F(0.0f)};
      S[K] = code_value<IO>(in, off + j) * scale;
      Rule::apply(P, Isa::load(g + off + j), S[0], S[1], h, true);
      const I a = Isa::bits(S[K]) & mask;
      row_max = Isa::max_u(row_max, a);
      Isa::store_i(col_max + j, Isa::max_u(Isa::load_i(col_max + j), a));
    }
    next = nx;
    const uint32_t m = Isa::hmax_u(row_max);
    for (int k = 0; k < nlead; ++k) fold_max(partial + lead[k], m);
  });
}

// Whether rank1_reduce handles state k of this tile (whole vectors in every row run).
inline bool rank1_reduce_applies(const TensorDesc& t, const StateDesc& st, int io, int64_t start, int64_t n) {
  return st.kind == kQuant && st.two_pass && st.codec.scale_kind == kRank1 && (io == kIOQ4 || io == kIOQ8) &&
         t.shape[t.ndim - 1] % W == 0 && start % W == 0 && n % W == 0;
}

// ---------------------------------------------------------------------------------------------
// Writing the new fp32 parameter into a bf16/fp16 parameter (final pass; qconf/optim/weights.py):
// nearest, stochastic rounding, and/or Kahan compensation with the buffer t.comp.

inline void write_params(TensorDesc& t, int64_t start, int64_t n, const float* p, Buffers& b) {
  uint16_t* dst = static_cast<uint16_t*>(t.param) + start;
  const bool sr = t.w_stochastic != 0, kahan = t.w_kahan != 0;
  float* comp = b.vhat;  // free after the main loop
  const StateDesc& cs = t.comp;
  if (kahan) {
    if (cs.kind == kQuant) dequantize(cs, t, start, n, comp, b.codes);
    else load_as_f32(cs.values16, t.pdtype, start, n, comp);
  }
  int64_t i = 0;
  if constexpr (W > 1) {
    if (t.pdtype == kBF16) {
      for (; i + W <= n; i += W) {
        const F pn = Isa::load(p + i);
        if (!kahan) {
          Isa::store_u16(dst + i, sr ? bf16_sr_bits(pn, hash_vec(t.pkey, start + i)) : bf16_rne_bits(pn));
          continue;
        }
        const F po = Isa::load_bf16(dst + i);  // the old parameter is still in memory
        const F c1 = Isa::load(comp + i) + (pn - po);
        const F target = po + c1;
        const I r = sr ? bf16_sr_bits(target, hash_vec(t.pkey, start + i)) : bf16_rne_bits(target);
        Isa::store(comp + i, c1 + (po - Isa::from_bits(r << 16)));
        Isa::store_u16(dst + i, r);
      }
    }
  }
  const bool bf16 = t.pdtype == kBF16;
  for (; i < n; ++i) {  // the element functions the CUDA kernel uses too (qconf/element.h)
    const uint32_t h = sr ? hash_bits(t.pkey, start + i) : 0u;
    dst[i] = kahan ? kahan_write(p[i], dst[i], comp[i], bf16, sr, h) : round_half(p[i], bf16, sr, h);
  }
  if (kahan) {
    if (cs.kind == kQuant) quantize(cs, t, start, n, comp, b.codes);
    else store_from_f32(cs.values16, t.pdtype, start, n, comp);
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
  } else if (final_pass || Rule::states_read_param(t.h)) {
    load_as_f32(t.param, t.pdtype, start, n, b.p);
    p = b.p;
  } else {  // pass 1 of a rule whose states ignore p: any finite values do (p is never stored)
    p = const_cast<float*>(g);
  }
  StateIn in[2];
  int io[2];
  bool generic_reduce[2] = {false, false};
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    io[k] = state_io(st, start, n);
    StateIn& s = in[k];
    if (!final_pass) {  // pass 1 needs only two-pass states, rank-1 ones in one loop of their own
      if (rank1_reduce_applies(t, st, io[k], start, n)) {
        uint32_t* partial = st.partial + tid * st.num_scales;
        if (k == 0) {
          io[k] == kIOQ4 ? rank1_reduce<Rule, 0, kIOQ4>(t, start, n, p, g, partial, b.s[k], b.next)
                         : rank1_reduce<Rule, 0, kIOQ8>(t, start, n, p, g, partial, b.s[k], b.next);
        } else if constexpr (Rule::kStates == 2) {
          io[k] == kIOQ4 ? rank1_reduce<Rule, 1, kIOQ4>(t, start, n, p, g, partial, b.s[k], b.next)
                         : rank1_reduce<Rule, 1, kIOQ8>(t, start, n, p, g, partial, b.s[k], b.next);
        }
        io[k] = kIONone;
        continue;
      }
      if (!(st.kind == kQuant && st.two_pass)) {
        io[k] = kIONone;
        continue;
      }
      generic_reduce[k] = true;
    }
    if (st.kind == kFp32) {
      if (final_pass) {
        s.values = s.out = st.values + start;
      } else {
        load_as_f32(st.values, kF32, start, n, b.s[k]);
        s.values = s.out = b.s[k];
      }
    } else if (st.kind == kQuant) {
      s.out = b.s[k];
      if (io[k] == kIOF32) {  // other widths / irregular tiles: generic dequantize into the buffer
        dequantize(st, t, start, n, b.s[k], b.codes);
        s.values = b.s[k];
      } else {
        if (st.two_pass) fill_per_element(st.codec, t, st.scales, true, start, n, b.sc[k]);
        else fill_per_vector(st.codec, st.scales, start, n, b.sc[k]);
        s.codes = st.codes + start * st.codec.bits / 8;
        s.scale = b.sc[k];
        s.qmap = st.codec.qmap;
        if (io_q8(io[k])) prepare_codes8(s, st, n, b.s[k]);
      }
    }
  }
  if (!final_pass && !generic_reduce[0] && !generic_reduce[1]) return;
  b.next.main_elems = final_pass && (io_q4(io[0]) || io_q8(io[0]) || io_q4(io[1]) || io_q8(io[1])) ? 32 : 16;
  bool update_v = true;
  if (t.factored) {
    fill_vhat(t, start, n, b.vhat);
    in[1].values = b.vhat;
    io[1] = kIOF32;
    update_v = false;
  }
  if (final_pass) run_main_loop<Rule, true>(p, g, io[0], in[0], io[1], in[1], n, t.h, update_v, b.next);
  else run_main_loop<Rule, false>(p, g, io[0], in[0], io[1], in[1], n, t.h, update_v, b.next);
  if (!final_pass) {
    for (int k = 0; k < 2; ++k) {
      const StateDesc& st = t.st[k];
      if (generic_reduce[k]) reduce_absmax(st, t, start, n, b.s[k], st.partial + tid * st.num_scales);
    }
    return;
  }
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    if (st.kind != kQuant) continue;
    const bool sr = st.codec.stochastic != 0;
    const bool grid = !sr && st.codec.grid[0] != 0.0f;
    const int lines = sr || grid ? 0 : static_cast<int>(st.codec.lines[kLinesForm]);
    if (io_q4(io[k])) sr ? quantize_fast<4, true>(st, t, start, n, b.s[k], b.sc[k], b.next)
                      : grid ? quantize_fast<4, false, kNearGrid>(st, t, start, n, b.s[k], b.sc[k], b.next)
                             : quantize_fast<4, false>(st, t, start, n, b.s[k], b.sc[k], b.next);
    else if (io_q8(io[k])) {
      if (sr) quantize_fast<8, true>(st, t, start, n, b.s[k], b.sc[k], b.next);
      else if (grid) quantize_fast<8, false, kNearGrid>(st, t, start, n, b.s[k], b.sc[k], b.next);
      else if (!quantize_lines(lines, st, t, start, n, b.s[k], b.sc[k], b.next))
        quantize_fast<8, false>(st, t, start, n, b.s[k], b.sc[k], b.next);
    } else quantize(st, t, start, n, b.s[k], b.codes);
  }
  if (t.pdtype != kF32) {
    if (t.w_stochastic || t.w_kahan) write_params(t, start, n, p, b);
    else store_from_f32(t.param, t.pdtype, start, n, p);
  }
}

// Starts loading the first lines of the next tile's states (codes, scales, fp32 values), and
// points `next` at its parameter and gradient, which the current tile's loops request line by
// line. The first tile of each tensor would otherwise wait on memory, which with thousands of
// small tensors is a large part of the step.
inline void prefetch_tile(const TensorDesc& t, int64_t start, int64_t n, bool param_read, NextLines& next) {
  const int psize = t.pdtype == kF32 ? 4 : 2, gsize = t.gdtype == kF32 ? 4 : 2;
  next = NextLines{static_cast<const char*>(t.param) + start * psize, static_cast<const char*>(t.grad) + start * gsize,
                   param_read ? n * psize : 0, n * gsize, 0};
  for (const StateDesc& st : t.st) {
    if (st.kind == kFp32) {
      __builtin_prefetch(st.values + start, 1);
    } else if (st.kind == kQuant) {
      __builtin_prefetch(st.codes + start * st.codec.bits / 8, 1);
      __builtin_prefetch(st.scales + (st.codec.scale_kind == kBlock ? start / st.codec.block : 0), 1);
    }
  }
}

template <class Rule>
inline void run_items_rule(const StepContext& ctx, const WorkItem* items, int64_t begin, int64_t end, int32_t phase,
                           int32_t tid) {
  Buffers b(ctx.max_tile);
  for (int64_t k = begin; k < end; ++k) {
    b.next = NextLines{};
    if (k + 1 < end && phase != kPassFactor) {
      const TensorDesc& nt = ctx.tensors[items[k + 1].tensor];
      const bool param_read = phase == kPassApply || Rule::states_read_param(nt.h);
      prefetch_tile(nt, items[k + 1].start, items[k + 1].len, param_read, b.next);
    }
    TensorDesc& t = ctx.tensors[items[k].tensor];
    if (phase == kPassFactor) {
      if constexpr (Rule::kStates == 2) factor_reduce<Rule>(t, items[k].start, b);
    } else {
      process_tile<Rule>(t, items[k].start, items[k].len, phase, tid, b);
    }
    b.next.finish();
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

// Standalone encode/decode of one tensor (the generic tile functions, no update rule).
void run_codec_items(const CodecJob& job, const WorkItem* items, int64_t begin, int64_t end, int32_t op,
                     int32_t tid) {
  uint32_t* codes = new uint32_t[job.tile + 64];
  StateDesc& st = *job.st;
  for (int64_t k = begin; k < end; ++k) {
    const int64_t start = items[k].start, n = items[k].len;
    if (op == kCodecReduce) reduce_absmax(st, *job.t, start, n, job.x + start, st.partial + tid * st.num_scales);
    else if (op == kCodecQuantize) quantize(st, *job.t, start, n, job.x + start, codes);
    else dequantize(st, *job.t, start, n, job.out + start, codes);
  }
  delete[] codes;
}
