// The CPU optimizer-step pipeline (part 3 of 3 of the per-ISA step template, see tile_codec.h):
// one tile of one tensor at a time,
//
//   load grad/param -> dequantize states -> update rule (fp32) -> new scales -> quantize -> store
//
// with every intermediate in a per-thread L1/L2-resident tile buffer (never O(numel) scratch).
// The update rule is a policy (AdamRule, SgdRule, LionRule in element.h); the state format comes
// from the StateDesc at run time (fp32, or codes + scales of any codec), so the rule never knows
// how a state is stored.
//
// Tiles start at multiples of 64 elements and, for states whose blocks fit a tile, at block
// boundaries: such a state is finished inside the tile (single pass). States whose scales need
// the whole tensor (tensor/dim1/rank1, huge blocks) take two passes: pass 1 computes the new
// values and reduces their absmax into per-thread partials, the driver combines them, pass 2
// recomputes the values and quantizes with the new scales.

struct Buffers {
  NextLines next;
  float* g;
  float* p;
  float* s[2];   // new state values
  float* sc[2];  // old scales (per chunk or per element), then new reciprocals (per vector or per element)
  float* vhat;
  uint32_t* codes;
  uint32_t* chunk_max[2];  // kIOQ*B: per main-loop chunk, the lane-wise max of the new values' |bits|
  float* storage;
  explicit Buffers(int64_t tile) {
    const int64_t n = tile + 64;
    storage = new float[10 * n];
    g = storage;
    p = storage + n;
    s[0] = storage + 2 * n;
    s[1] = storage + 3 * n;
    sc[0] = storage + 4 * n;
    sc[1] = storage + 5 * n;
    vhat = storage + 6 * n;
    codes = reinterpret_cast<uint32_t*>(storage + 7 * n);
    chunk_max[0] = reinterpret_cast<uint32_t*>(storage + 8 * n);  // (n / kMainChunk vectors of W <= 16 lanes)
    chunk_max[1] = reinterpret_cast<uint32_t*>(storage + 9 * n);
  }
  ~Buffers() { delete[] storage; }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
};

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
// every ISA) and per column within this row chunk (rows added in order); a square that is not
// finite adds 0 (finite_square)
template <class Rule>
inline void factor_reduce(const TensorDesc& t, int64_t chunk, Buffers& b) {
  const int64_t C = t.cols, R = t.shape[t.ndim - 2];
  const int64_t r0 = chunk * t.rows_per_chunk;
  const int64_t r1 = r0 + t.rows_per_chunk < t.rows ? r0 + t.rows_per_chunk : t.rows;
  float* colp = t.col_partial + chunk * (t.rows / R) * C;  // this chunk's column sums: [batch][C]
  for (int64_t r = r0; r < r1; ++r) {
    load_as_f32(t.grad, t.gdtype, r * C, C, b.g);
    load_as_f32(t.param, t.pdtype, r * C, C, b.p);
    for (int64_t j = 0; j < C; ++j) b.vhat[j] = finite_square(Rule::effective_grad(b.p[j], b.g[j], t.h));
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
//   kIOQ4B/kIOQ8B: the same codes with one old scale per main-loop chunk (single-pass blocks,
//   block % kMainChunk == 0)
enum StateIO : int { kIONone = 0, kIOF32 = 1, kIOQ4 = 4, kIOQ4B = 5, kIOQ8 = 8, kIOQ8B = 9 };
constexpr bool io_q4(int io) { return io == kIOQ4 || io == kIOQ4B; }
constexpr bool io_q8(int io) { return io == kIOQ8 || io == kIOQ8B; }
constexpr bool io_chunk_scale(int io) { return io == kIOQ4B || io == kIOQ8B; }

struct StateIn {
  const float* values = nullptr;  // kIOF32: read from here
  float* out = nullptr;           // new values go here (in place for kIOF32 on the final pass)
  const uint8_t* codes = nullptr; // kIOQ4/kIOQ8: packed codes of the tile
  const float* scale = nullptr;   // old scales of the tile: per element, or per chunk (kIOQ*B)
  const float* qmap = nullptr;
  const float* decoded = nullptr; // kIOQ8: qmap[code] of the whole tile (decode8)
  uint32_t* chunk_max = nullptr;  // kIOQ*B: where the main loop puts each chunk's max |bits| (W lanes)
};

// Fills s for the 8-bit codes of state st in a tile: decoded into `scratch` ahead of the loop
// that reads them
inline void prepare_codes8(StateIn& s, const StateDesc& st, int64_t n, float* scratch) {
  decode8(st.codec, s.codes, n, scratch);
  s.decoded = scratch;
}

// One old scale per main-loop chunk of a single-pass block state (kIOQ*B): out[q] is the scale
// of elements start + q * kMainChunk .. of the tile (a chunk never straddles two blocks), for the
// tile's chunks only: a block may be longer than the tile (a one-tile tensor smaller than its
// group), and its chunks past the tile have no entry. Whole-register stores: the last store of a
// block may run up to W-1 entries past its chunks (the next block's stores overwrite them;
// Buffers leaves room after the tile's last chunk).
inline void fill_per_chunk(const CodecDesc& c, const float* scales, int64_t start, int64_t n, float* out) {
  const int64_t per_block = c.block / kMainChunk, chunks = (n + kMainChunk - 1) / kMainChunk;
  int64_t blk = start / c.block, q = 0;
  for (int64_t k = (start % c.block) / kMainChunk; q < chunks; ++blk, k = 0) {
    const F s(scales[blk]);
    const int64_t in_tile = per_block - k < chunks - q ? per_block - k : chunks - q;
    for (int64_t j = 0; j < in_tile; j += W) Isa::store(out + q + j, s);
    q += in_tile;
  }
}

// A state's input to one chunk of the main loop, from element i of the tile on (i a multiple of
// kMainChunk): value(k) is the old state of elements i + k .. i + k + W - 1. With one scale per
// chunk (kIOQ4B) the 16-entry table is multiplied by it once per chunk: qmap[c] * s is the same
// product either way, so the values are those of qmap[code] * scale.
template <int IO>
struct ChunkIn {
  const float* values;
  const uint8_t* codes;
  const float* scale;  // per element (kIOQ4 / kIOQ8)
  float* out;
  uint32_t* chunk_max;  // kIOQ*B
  Isa::T16 table;  // kIOQ4*: qmap, times the chunk's scale (kIOQ4B)
  F chunk_scale;   // kIOQ*B
  ChunkIn(const StateIn& s, int64_t i) : out(s.out + i) {
    const uint64_t u = static_cast<uint64_t>(i);  // (i >= 0: the divisions are shifts)
    if constexpr (IO == kIOF32) values = s.values + i;
    if constexpr (io_q4(IO)) codes = s.codes + u / 2;
    if constexpr (io_q8(IO)) values = s.decoded + i;
    if constexpr (IO == kIOQ4 || IO == kIOQ8) scale = s.scale + i;
    if constexpr (io_chunk_scale(IO)) {
      chunk_scale = F(s.scale[u / kMainChunk]);
      chunk_max = s.chunk_max + u / kMainChunk * W;
    }
    if constexpr (IO == kIOQ4) table = Isa::table16(s.qmap);
    if constexpr (IO == kIOQ4B) table = Isa::scale16(Isa::table16(s.qmap), chunk_scale);
  }
  F value(int64_t k) const {
    if constexpr (IO == kIOF32) return Isa::load(values + k);
    else if constexpr (IO == kIOQ4B) return Isa::lookup16_packed4(table, codes + k / 2);
    else if constexpr (IO == kIOQ4) return Isa::lookup16_packed4(table, codes + k / 2) * Isa::load(scale + k);
    else if constexpr (IO == kIOQ8B) return Isa::load(values + k) * chunk_scale;
    else if constexpr (IO == kIOQ8) return Isa::load(values + k) * Isa::load(scale + k);
    else return F(0.0f);
  }
  // the new values' |bits| (raw_absmax_bits' terms) folded into the chunk's lane-wise max
  void fold(I& acc, F x) const {
    if constexpr (io_chunk_scale(IO) && Isa::kBlockMaxLanes) acc = Isa::max_u(acc, Isa::bits(x) & I(0x7fffffffu));
  }
  void finish(I acc) const {
    if constexpr (io_chunk_scale(IO) && Isa::kBlockMaxLanes) Isa::store_i(chunk_max, acc);
  }
};

// (the 4/8-bit kinds only occur for whole vectors: state_io)
template <int IO>
inline float load_state_scalar(const StateIn& s, int64_t i) {
  if constexpr (IO == kIOF32) return s.values[i];
  else return 0.0f;
}

// One vector of the main loop: elements k .. k+W-1 of a chunk (see main_loop); the states' new
// |bits| folded into max0, max1 (single-pass block states: their new scales).
template <class Rule, int IO0, int IO1, bool StoreP, bool Plain>
inline __attribute__((always_inline)) void main_vector(float* p, const float* g, const ChunkIn<IO0>& s0,
                                                       const ChunkIn<IO1>& s1, int64_t k, const Scalars& h,
                                                       bool update_v, I& max0, I& max1) {
  F P = Isa::load(p + k);
  F A = s0.value(k);
  F B = s1.value(k);
  if constexpr (Plain) Rule::apply_plain(P, Isa::load(g + k), A, B, h);
  else Rule::apply(P, Isa::load(g + k), A, B, h, update_v);
  if constexpr (StoreP) Isa::store(p + k, P);
  s0.fold(max0, A);
  s1.fold(max1, B);
  if constexpr (IO0 != kIONone) Isa::store(s0.out + k, A);
  if constexpr (IO1 != kIONone) {
    if (Plain || update_v) Isa::store(s1.out + k, B);
  }
}

// StoreP=false (pass 1): only the states' new values are needed; the parameter math is dead code.
// Plain: the rule's flags were checked once here (Rule::plain), so the loop runs
// Rule::apply_plain, with no branch per vector (the final pass of the common AdamW step).
// The vectors go in chunks of kMainChunk elements, unrolled, with the chunk's prefetch steps
// first, every address a constant offset from the chunk's pointers and the chunk's old scale
// applied once (ChunkIn): the per-vector index arithmetic, flag tests and scale broadcasts were
// a fifth of the loop.
template <class Rule, int IO0, int IO1, bool StoreP = true, bool Plain = false>
void main_loop(float* p, const float* g, const StateIn& s0_, const StateIn& s1_, int64_t n, const Scalars& hs,
               bool update_v, NextLines& next) {
  if constexpr (Rule::kHasPlain && StoreP && !Plain) {
    if (Rule::plain(hs, update_v)) return main_loop<Rule, IO0, IO1, StoreP, true>(p, g, s0_, s1_, n, hs, true, next);
  }
  const Scalars h = hs;  // local copies: the rule's scalars, the state pointers and the
  const StateIn s0 = s0_, s1 = s1_;  // prefetch cursor stay in registers (stores through float*
  NextLines nx = next;               // could alias the references)
  int64_t i = 0;
  if constexpr (W > 1) {
    const bool two_steps = nx.main_elems < kMainChunk;
    for (; i + kMainChunk <= n; i += kMainChunk) {
      nx.step();
      if (two_steps) nx.step();
      const ChunkIn<IO0> c0(s0, i);
      const ChunkIn<IO1> c1(s1, i);
      I max0(0u), max1(0u);
#pragma GCC unroll 8
      for (int64_t k = 0; k < kMainChunk; k += W)
        main_vector<Rule, IO0, IO1, StoreP, Plain>(p + i, g + i, c0, c1, k, h, update_v, max0, max1);
      c0.finish(max0);
      c1.finish(max1);
    }
    if (i + W <= n) {  // the whole vectors of a last, partial chunk
      const ChunkIn<IO0> c0(s0, i);
      const ChunkIn<IO1> c1(s1, i);
      I max0(0u), max1(0u);
      int64_t k = 0;
      for (; i + k + W <= n; k += W) {
        if ((k & (nx.main_elems - 1)) == 0) nx.step();
        main_vector<Rule, IO0, IO1, StoreP, Plain>(p + i, g + i, c0, c1, k, h, update_v, max0, max1);
      }
      c0.finish(max0);
      c1.finish(max1);
      i += k;
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

// Whether the 4/8-bit register paths apply to this state in this tile: whole vectors, and every
// single-pass block a multiple of kMainChunk (so no main-loop chunk straddles two blocks; other
// block sizes take the generic dequantize and quantize).
inline int state_io(const StateDesc& st, int64_t start, int64_t n) {
  if (st.kind == kNone) return kIONone;
  if (st.kind == kFp32) return kIOF32;
  const CodecDesc& c = st.codec;
  if (!Isa::kFastPack || W == 1 || (c.bits != 4 && c.bits != 8) || n % W != 0 || start % W != 0) return kIOF32;
  if (!st.two_pass) return c.block % kMainChunk != 0 ? kIOF32 : c.bits + 1;  // kIOQ4B / kIOQ8B
  return c.bits;  // kIOQ4 / kIOQ8
}


// ---------------------------------------------------------------------------------------------
// The inputs of rank1_reduce from element i of the tile on (one chunk of a row run, or one
// vector of its tail), every address a constant offset from these pointers once the chunk's
// vectors are unrolled (the index shifts per vector were a tenth of the loop).
template <int IO>
struct Rank1In {
  const float *p, *g, *col_scale;
  uint32_t* col_max;
  const uint8_t* codes;  // kIOQ4
  const float* decoded;  // kIOQ8: qmap[code] (decode8)
  Rank1In(const StateIn& in, const float* p_, const float* g_, int64_t i, const float* col_scale_,
          uint32_t* col_max_)
      : p(p_ + i), g(g_ + i), col_scale(col_scale_), col_max(col_max_) {
    if constexpr (io_q4(IO)) codes = in.codes + static_cast<uint64_t>(i) / 2;  // (i >= 0: a shift)
    else decoded = in.decoded + i;
  }
  // qmap[code] of elements k .. k+W-1 from here (k a multiple of W)
  F code_value(const Isa::T16& qmap16, int64_t k) const {
    if constexpr (io_q4(IO)) return Isa::lookup16_packed4(qmap16, codes + k / 2);
    else return Isa::load(decoded + k);
  }
};

// One vector of rank1_reduce: elements k .. k+W-1 from `in`. RowNan: the row's part is NaN,
// and fmin_nan(NaN, col) = col.
template <class Rule, int K, int IO, bool Plain, bool RowNan>
inline __attribute__((always_inline)) void rank1_vector(const Rank1In<IO>& in, int64_t k, const Isa::T16& qmap16,
                                                        F row_scale, const Scalars& h, I& row_max) {
  const F col_j = Isa::load(in.col_scale + k);
  F scale = col_j;
  if constexpr (!RowNan) scale = Isa::min_or(col_j, row_scale);
  F P = Isa::load(in.p + k);
  F S[2] = {F(0.0f), F(0.0f)};
  S[K] = in.code_value(qmap16, k) * scale;
  if constexpr (Plain) Rule::apply_plain(P, Isa::load(in.g + k), S[0], S[1], h);
  else Rule::apply(P, Isa::load(in.g + k), S[0], S[1], h, true);
  const I a = finite_abs_v(S[K]);
  row_max = Isa::max_u(row_max, a);
  Isa::store_i(in.col_max + k, Isa::max_u(Isa::load_i(in.col_max + k), a));
}

// One row run of rank1_reduce (elements off .. off+len-1 of the tile): the columns' partial
// maxima folded in place; returns the run's maximum for the row.
template <class Rule, int K, int IO, bool Plain, bool RowNan>
inline uint32_t rank1_row(const StateIn& in_, const float* p, const float* g, int64_t off, int64_t len,
                          const float* col_scale, uint32_t* col_max, float part, const Scalars& h_, NextLines& next) {
  const StateIn in = in_;  // (locals: the stores to col_max could alias the references, and every
  const Scalars h = h_;    // vector would reload them)
  const Isa::T16 qmap16 = Isa::table16(in.qmap);
  const F row_scale(part);
  I row_max(0u);
  NextLines nx = next;
  // pass 1 streams p and g: one line of each per 16 elements; the vectors of a chunk unrolled
  int64_t j = 0;
  for (; j + kMainChunk <= len; j += kMainChunk) {
    for (int64_t q = 0; q < kMainChunk; q += 16) nx.step();
    const Rank1In<IO> c(in, p, g, off + j, col_scale + j, col_max + j);
#pragma GCC unroll 8
    for (int64_t k = 0; k < kMainChunk; k += W)
      rank1_vector<Rule, K, IO, Plain, RowNan>(c, k, qmap16, row_scale, h, row_max);
  }
  for (; j < len; j += W) {
    if (((off + j) & 15) == 0) nx.step();
    const Rank1In<IO> c(in, p, g, off + j, col_scale + j, col_max + j);
    rank1_vector<Rule, K, IO, Plain, RowNan>(c, 0, qmap16, row_scale, h, row_max);
  }
  next = nx;
  return Isa::hmax_u(row_max);
}

// Pass 1 of a rank-1 state with 4/8-bit codes, in one loop per row run: old scale
// min(row, col) -> dequantize -> rule -> fold |new| into the row's and the columns' partial
// maxima. (The generic pass writes the old scales, the new values and re-reads both.) Only state
// K's new value is used; the other state's math is dead code.
// Plain: as in main_loop, the rule's flags checked once (Rule::plain), no branch per vector.
template <class Rule, int K, int IO, bool Plain = false>
inline void rank1_reduce(const TensorDesc& t, int64_t start, int64_t n, const float* p, const float* g,
                         uint32_t* partial, float* scratch, NextLines& next) {
  if constexpr (Rule::kHasPlain && !Plain) {
    if (Rule::plain(t.h, true)) return rank1_reduce<Rule, K, IO, true>(t, start, n, p, g, partial, scratch, next);
  }
  const StateDesc& st = t.st[K];
  const uint8_t* codes = st.codes + start * st.codec.bits / 8;
  const float* scales = st.scales;
  const Scalars h = t.h;
  StateIn in;
  in.codes = codes;
  in.qmap = st.codec.qmap;
  if constexpr (io_q8(IO)) prepare_codes8(in, st, n, scratch);
  for_each_rank1_row(t, start, n, [&](int64_t off, int64_t len, const int64_t* lead, int nlead, int64_t col) {
    const float part = rank1_row_part(scales, lead, nlead, true);
    const float* col_scale = scales + col;
    uint32_t* col_max = partial + col;
    const uint32_t m = part != part
                           ? rank1_row<Rule, K, IO, Plain, true>(in, p, g, off, len, col_scale, col_max, part, h, next)
                           : rank1_row<Rule, K, IO, Plain, false>(in, p, g, off, len, col_scale, col_max, part, h, next);
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
          Isa::store_u16(dst + i, sr ? bf16_sr_bits(pn, half_bits_vec(t.pkey, start + i)) : bf16_rne_bits(pn));
          continue;
        }
        const F po = Isa::load_bf16(dst + i);  // the old parameter is still in memory
        const F c1 = Isa::load(comp + i) + (pn - po);
        const F target = po + c1;
        const I r = sr ? bf16_sr_bits(target, half_bits_vec(t.pkey, start + i)) : bf16_rne_bits(target);
        Isa::store(comp + i, c1 + (po - Isa::from_bits(r << 16)));
        Isa::store_u16(dst + i, r);
      }
    }
  }
  const bool bf16 = t.pdtype == kBF16;
  for (; i < n; ++i) {  // the element functions the CUDA kernel uses too (qconf/element.h)
    const uint32_t h = sr ? param_bits(t.pkey, start + i, bf16) : 0u;
    dst[i] = kahan ? kahan_write(p[i], dst[i], comp[i], bf16, sr, h) : round_half(p[i], bf16, sr, h);
  }
  if (kahan) {
    if (cs.kind == kQuant) quantize(cs, t, start, n, comp, b.codes);
    else store_from_f32(cs.values16, t.pdtype, start, n, comp);
  }
}

// The stages of process_tile. (always_inline: one function per tile, as if written in one.)

// 1. The tile's gradient and parameter as fp32: pointers into fp32 tensors, converted copies
// otherwise. Pass 1 of a rule whose states ignore p reads no parameter: any finite values do
// there (p is never stored), so p points at g.
template <class Rule>
inline __attribute__((always_inline)) void load_grad_param(const TensorDesc& t, int64_t start, int64_t n,
                                                           bool final_pass, Buffers& b, const float*& g, float*& p) {
  if (t.gdtype == kF32) {
    g = static_cast<const float*>(t.grad) + start;
  } else {
    load_as_f32(t.grad, t.gdtype, start, n, b.g);
    g = b.g;
  }
  if (t.pdtype == kF32 && final_pass) {
    p = static_cast<float*>(t.param) + start;
  } else if (final_pass || Rule::states_read_param(t.h)) {
    load_as_f32(t.param, t.pdtype, start, n, b.p);
    p = b.p;
  } else {
    p = const_cast<float*>(g);
  }
}

// 2a. Pass 1 needs only two-pass states: a rank-1 one with 4/8-bit codes is reduced here in one
// loop of its own (rank1_reduce), any other goes through the main loop (returns true). `io`
// becomes kIONone for every state the main loop skips.
template <class Rule>
inline __attribute__((always_inline)) bool route_reduce(const TensorDesc& t, int k, int& io, int64_t start,
                                                        int64_t n, const float* p, const float* g, int32_t tid,
                                                        Buffers& b) {
  const StateDesc& st = t.st[k];
  if (rank1_reduce_applies(t, st, io, start, n)) {
    uint32_t* partial = st.partial + tid * st.num_scales;
    if (k == 0) {
      io == kIOQ4 ? rank1_reduce<Rule, 0, kIOQ4>(t, start, n, p, g, partial, b.s[k], b.next)
                  : rank1_reduce<Rule, 0, kIOQ8>(t, start, n, p, g, partial, b.s[k], b.next);
    } else if constexpr (Rule::kStates == 2) {
      io == kIOQ4 ? rank1_reduce<Rule, 1, kIOQ4>(t, start, n, p, g, partial, b.s[k], b.next)
                  : rank1_reduce<Rule, 1, kIOQ8>(t, start, n, p, g, partial, b.s[k], b.next);
    }
    io = kIONone;
    return false;
  }
  if (!(st.kind == kQuant && st.two_pass)) {
    io = kIONone;
    return false;
  }
  return true;
}

// 2b. State k's input to the main loop: fp32 values (in place on the final pass), a generic
// dequantize into the buffer (other widths, irregular tiles), or 4/8-bit codes with their old
// scales per vector (single-pass blocks) or per element (two-pass layouts).
inline __attribute__((always_inline)) void prepare_state(const TensorDesc& t, int k, int io, int64_t start, int64_t n,
                                                         bool final_pass, Buffers& b, StateIn& s) {
  const StateDesc& st = t.st[k];
  if (st.kind == kFp32) {
    if (final_pass) {
      s.values = s.out = st.values + start;
    } else {
      load_as_f32(st.values, kF32, start, n, b.s[k]);
      s.values = s.out = b.s[k];
    }
  } else if (st.kind == kQuant) {
    s.out = b.s[k];
    if (io == kIOF32) {
      dequantize(st, t, start, n, b.s[k], b.codes);
      s.values = b.s[k];
    } else {
      if (st.two_pass) fill_per_element(st.codec, t, st.scales, true, start, n, b.sc[k]);
      else fill_per_chunk(st.codec, st.scales, start, n, b.sc[k]);
      s.chunk_max = b.chunk_max[k];
      s.codes = st.codes + start * st.codec.bits / 8;
      s.scale = b.sc[k];
      s.qmap = st.codec.qmap;
      if (io_q8(io)) prepare_codes8(s, st, n, b.s[k]);
    }
  }
}

// 3. The main loop over the tile: the factored second moment reads v = row_factor * col instead
// of a stored state (and keeps no new v).
template <class Rule>
inline __attribute__((always_inline)) void run_tile_main(const TensorDesc& t, int64_t start, int64_t n, float* p,
                                                         const float* g, int* io, StateIn* in, bool final_pass,
                                                         Buffers& b) {
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
}

// 4a. Pass 1: the absmax of the new values of the states the main loop reduced, folded into
// this thread's partials.
inline __attribute__((always_inline)) void fold_partials(const TensorDesc& t, const bool* generic_reduce,
                                                         int64_t start, int64_t n, int32_t tid, Buffers& b) {
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    if (generic_reduce[k]) reduce_absmax(st, t, start, n, b.s[k], st.partial + tid * st.num_scales);
  }
}

// 4b. Final pass: the new values of every quantized state -> (new block scales) -> codes, by the
// fastest exact quantizer for its width, rounding and map (grid, octave lines or search).
inline __attribute__((always_inline)) void quantize_states(const TensorDesc& t, const int* io, int64_t start,
                                                           int64_t n, Buffers& b) {
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    if (st.kind != kQuant) continue;
    const bool sr = st.codec.stochastic != 0;
    const bool grid = !sr && st.codec.grid[kGridL] != 0.0f;
    const int lines = sr || grid ? 0 : static_cast<int>(st.codec.lines[kLinesForm]);
    const float* x = b.s[k];
    float* rbuf = b.sc[k];
    const uint32_t* cmax = b.chunk_max[k];  // (written by the main loop where Isa::kBlockMaxLanes)
    if (io_q4(io[k])) sr ? quantize_fast<4, true>(st, t, start, n, x, rbuf, b.next, cmax)
                      : grid ? quantize_fast<4, false, kNearGrid>(st, t, start, n, x, rbuf, b.next, cmax)
                             : quantize_fast<4, false>(st, t, start, n, x, rbuf, b.next, cmax);
    else if (io_q8(io[k])) {
      if (sr) quantize_fast<8, true>(st, t, start, n, x, rbuf, b.next, cmax);
      else if (grid) quantize_fast<8, false, kNearGrid>(st, t, start, n, x, rbuf, b.next, cmax);
      else if (!quantize_lines(lines, st, t, start, n, x, rbuf, b.next, cmax))
        quantize_fast<8, false>(st, t, start, n, x, rbuf, b.next, cmax);
    } else quantize(st, t, start, n, x, b.codes);
  }
}

// 5. Final pass: the new bf16/fp16 parameter (fp32 parameters were updated in place).
inline __attribute__((always_inline)) void store_params(TensorDesc& t, int64_t start, int64_t n, const float* p,
                                                        Buffers& b) {
  if (t.pdtype == kF32) return;
  if (t.w_stochastic || t.w_kahan) write_params(t, start, n, p, b);
  else store_from_f32(t.param, t.pdtype, start, n, p);
}

// One tile of one tensor in `phase` (kPassReduce or kPassApply) on thread `tid`.
template <class Rule>
inline void process_tile(TensorDesc& t, int64_t start, int64_t n, int32_t phase, int32_t tid, Buffers& b) {
  const bool final_pass = phase == kPassApply;
  const float* g;
  float* p;
  load_grad_param<Rule>(t, start, n, final_pass, b, g, p);
  StateIn in[2];
  int io[2];
  bool generic_reduce[2] = {false, false};
  for (int k = 0; k < 2; ++k) {
    io[k] = state_io(t.st[k], start, n);
    if (!final_pass) {
      generic_reduce[k] = route_reduce<Rule>(t, k, io[k], start, n, p, g, tid, b);
      if (!generic_reduce[k]) continue;
    }
    prepare_state(t, k, io[k], start, n, final_pass, b, in[k]);
  }
  if (!final_pass && !generic_reduce[0] && !generic_reduce[1]) return;
  run_tile_main<Rule>(t, start, n, p, g, io, in, final_pass, b);
  if (!final_pass) {
    fold_partials(t, generic_reduce, start, n, tid, b);
    return;
  }
  quantize_states(t, io, start, n, b);
  store_params(t, start, n, p, b);
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
    case kRuleLion: run_items_rule<LionRule>(ctx, items, begin, end, phase, tid); break;
    case kRuleMuonMomentum: run_items_rule<MuonMomentumRule>(ctx, items, begin, end, phase, tid); break;
    default: run_items_rule<MuonUpdateRule>(ctx, items, begin, end, phase, tid); break;
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

