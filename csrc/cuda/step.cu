// The fused optimizer step on CUDA: the same contract and the same per-element math as the CPU
// driver (csrc/cpu/step.cpp), run as a few multi-tensor launches on the current stream.
//
// Host: the arguments are checked and described by the shared code in qconf/step_host.h (one copy
// of the Scalars, RNG keys, codec descriptions and single/two-pass decisions for both drivers).
// The descriptors, the chunk table and the codec tables are packed into one pinned buffer and
// copied to the device once per call; scratch (absmax partials, new reciprocals and scales,
// factored sums) is one device allocation.
//
// Device: a chunk table covers the elements of every tensor of the call; one thread block per
// chunk, one octet (8 consecutive elements, i.e. `bits` whole bytes of packed codes) per thread
// and iteration. Chunks start at multiples of 8 and of every single-pass group block, so a group
// and a code byte never straddle two blocks. Passes, each one launch over all tensors:
//
//   factor   (factored second moments) row sums of g_eff^2 (16 strided lanes + tree, the CPU's
//            association), column sums per fixed row chunk, then the statistics update and the
//            row factors in the CPU's order -- results bit-identical to the CPU driver
//   reduce   (two-pass states: tensor/dim1/rank1 scales, huge blocks) new state values -> abs
//            bits -> atomicMax into shared-memory slots per scale index, flushed with atomicMax
//            into a per-state device array; a small kernel turns them into scales/reciprocals
//   apply    dequantize -> rule -> new group absmax (shared-memory atomicMax over abs bits, one
//            slot per group of the chunk) -> quantize -> pack -> store; new scales of the
//            single-pass groups are written by their block, those of two-pass states by a final
//            copy kernel (the old scales are read until every chunk is dequantized)
//
// Every element operation is a call into qconf/element.h (the rules, quantize_*, normalize,
// conversions, RNG, abs_bits / scale_from_absmax_bits, fmin_nan / fmax_nan): the same code the
// CPU scalar path runs. Compiled with --fmad=false: no contraction, every op rounded as written.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qconf/element.h"
#include "qconf/step_driver.h"
#include "qconf/step_host.h"
#include "qconf/step_types.h"

namespace qconf {
namespace {

constexpr int kThreads = 256;           // threads per block of every kernel
constexpr int64_t kChunkTarget = 2048;  // elements per block: one octet per thread
constexpr int kSlotBudget = 8192;       // shared absmax slots per block (32 KB)
constexpr int kFactorRowsPerBlock = kThreads / 16;  // one half-warp per row

// ---------------------------------------------------------------------------------------------
// descriptors (host-built, read by the kernels)

// Scale index of element e for one term: (e / div) % mod + off. A block/dim1 layout has one term;
// rank1 one per dimension (leading dims first, the last dim last).
struct Term {
  int64_t div = 1, mod = 1, off = 0;
  int32_t slot = -1;  // reduce pass: first shared slot of this term, -1 = atomics on the device array
  int32_t pad = 0;
};

struct GpuState {
  int32_t nterms = 0;
  int32_t single = 0;      // quantized, single-pass on the GPU (kBlock, whole groups per chunk)
  int32_t apply_slot = 0;  // apply pass: first shared slot of the groups (single-pass states)
  int32_t load_reduce = 0; // the reduce pass needs this state (two-pass quantized)
  Term term[kMaxDims];
};

struct GpuTensor {
  TensorDesc d;
  GpuState gs[2];
  int32_t apply_slots = 0, reduce_slots = 0;  // shared slots used per block
  int64_t R = 0, batches = 0, chunks = 0;     // factored: rows per batch, batches, row chunks
};
static_assert(std::is_trivially_copyable<GpuTensor>::value, "GpuTensor is copied as bytes");
static_assert(sizeof(GpuTensor) % 4 == 0, "GpuTensor is copied as 32-bit words");

struct FactorItem {  // rows / columns / statistics work of one factored tensor
  int32_t tensor;
  int32_t kind;  // stats kernel: 0 = rows, 1 = columns
  int64_t a, b;  // rows kernel: first row; cols kernel: row chunk, first column; stats: first entry
};

struct CopyItem {
  float* dst;
  const float* src;
  int64_t n;
};

// ---------------------------------------------------------------------------------------------
// small device helpers (no element math here: indices, loads, stores, bit packing)

__device__ __forceinline__ void divmod64(int64_t a, int64_t b, int64_t& q, int64_t& r) {
  if ((static_cast<uint64_t>(a) | static_cast<uint64_t>(b)) < (1ull << 32)) {
    const uint32_t qa = static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
    q = qa;
    r = static_cast<int64_t>(static_cast<uint32_t>(a) - qa * static_cast<uint32_t>(b));
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// Walks the scale index of one term along consecutive elements.
struct TermWalk {
  int64_t q, rem, qm;
  __device__ __forceinline__ void begin(const Term& t, int64_t e) {
    divmod64(e, t.div, q, rem);
    int64_t d;
    divmod64(q, t.mod, d, qm);
  }
  __device__ __forceinline__ void next(const Term& t) {
    if (++rem == t.div) {
      rem = 0;
      ++q;
      if (++qm == t.mod) qm = 0;
    }
  }
  __device__ __forceinline__ int64_t index(const Term& t) const { return qm + t.off; }
};

// Per-element values of a state's scale layout for an octet: the stored value (block, dim1) or
// the rank-1 combination in the CPU's order (leading dims from the last one down, then the last
// dim), with fmin_nan for scales (kMin) or fmax_nan for reciprocals.
template <bool kMin>
__device__ __forceinline__ float combine(float a, float b) {
  return kMin ? fmin_nan(a, b) : fmax_nan(a, b);
}

// rank1: the combination of the leading dims' values for row r (elements r*C .. r*C + C-1)
template <bool kMin>
__device__ __forceinline__ float rank1_leading(const TensorDesc& t, const float* vals, int64_t r) {
  const int nd = t.ndim;
  int64_t off = 0;
  for (int d = 0; d < nd - 1; ++d) off += t.shape[d];
  int64_t rem = r;
  float part = 0.0f;
  for (int d = nd - 2; d >= 0; --d) {
    off -= t.shape[d];
    int64_t q, idx;
    divmod64(rem, t.shape[d], q, idx);
    rem = q;
    const float v = vals[off + idx];
    part = d == nd - 2 ? v : combine<kMin>(part, v);
  }
  return part;
}

template <bool kMin>
__device__ __forceinline__ void layout_values(const TensorDesc& t, const GpuState& g, const float* vals, int64_t e0,
                                              int cnt, float out[8]) {
  if (g.nterms == 1) {
    const Term& tm = g.term[0];
    TermWalk w;
    w.begin(tm, e0);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) out[j] = vals[w.index(tm)];
      w.next(tm);
    }
    return;
  }
  const int64_t C = t.shape[t.ndim - 1];
  const float* last = vals + g.term[t.ndim - 1].off;
  int64_t r, c;
  divmod64(e0, C, r, c);
  float part = rank1_leading<kMin>(t, vals, r);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < cnt) {
      out[j] = combine<kMin>(part, last[c]);
      if (++c == C && j + 1 < cnt) {
        c = 0;
        ++r;
        part = rank1_leading<kMin>(t, vals, r);
      }
    }
  }
}

__device__ __forceinline__ float load_elem(const void* src, int32_t dtype, int64_t e) {
  if (dtype == kF32) return static_cast<const float*>(src)[e];
  const uint16_t h = static_cast<const uint16_t*>(src)[e];
  return dtype == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// 8 elements from e0 (cnt valid) of a float32 / bfloat16 / float16 tensor as fp32.
__device__ __forceinline__ void load8(const void* src, int32_t dtype, int64_t e0, int cnt, float out[8]) {
  if (dtype == kF32) {
    const float* s = static_cast<const float*>(src) + e0;
    if (cnt == 8 && (reinterpret_cast<uintptr_t>(s) & 15u) == 0) {
      const float4 a = reinterpret_cast<const float4*>(s)[0];
      const float4 b = reinterpret_cast<const float4*>(s)[1];
      out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
      out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
      return;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = j < cnt ? s[j] : 0.0f;
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src) + e0;
  uint16_t h[8];
  if (cnt == 8 && (reinterpret_cast<uintptr_t>(s) & 15u) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(s);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      h[2 * j] = static_cast<uint16_t>(w[j] & 0xffffu);
      h[2 * j + 1] = static_cast<uint16_t>(w[j] >> 16);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = j < cnt ? s[j] : static_cast<uint16_t>(0);
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = dtype == kBF16 ? bf16_to_f32(h[j]) : f16_to_f32(h[j]);
}

// Store 8 fp32 values (cnt valid), rounding to nearest even for bfloat16 / float16.
__device__ __forceinline__ void store8(void* dst, int32_t dtype, int64_t e0, int cnt, const float in[8]) {
  if (dtype == kF32) {
    float* d = static_cast<float*>(dst) + e0;
    if (cnt == 8 && (reinterpret_cast<uintptr_t>(d) & 15u) == 0) {
      reinterpret_cast<float4*>(d)[0] = make_float4(in[0], in[1], in[2], in[3]);
      reinterpret_cast<float4*>(d)[1] = make_float4(in[4], in[5], in[6], in[7]);
      return;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < cnt) d[j] = in[j];
    return;
  }
  uint16_t h[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) h[j] = dtype == kBF16 ? f32_to_bf16_rne(in[j]) : f32_to_f16_rne(in[j]);
  uint16_t* d = static_cast<uint16_t*>(dst) + e0;
  if (cnt == 8 && (reinterpret_cast<uintptr_t>(d) & 15u) == 0) {
    uint4 v;
    v.x = static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
    v.y = static_cast<uint32_t>(h[2]) | (static_cast<uint32_t>(h[3]) << 16);
    v.z = static_cast<uint32_t>(h[4]) | (static_cast<uint32_t>(h[5]) << 16);
    v.w = static_cast<uint32_t>(h[6]) | (static_cast<uint32_t>(h[7]) << 16);
    *reinterpret_cast<uint4*>(d) = v;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < cnt) d[j] = h[j];
}

// The `bits` bytes of one octet of packed codes as a little-endian word (element j of the octet
// is bits [j*bits, (j+1)*bits)); only the first `nbytes` bytes exist at the end of a tensor.
__device__ __forceinline__ uint64_t load_codes(const uint8_t* codes, int bits, int64_t e0, int cnt) {
  const uint8_t* b = codes + (e0 / 8) * bits;
  const int nbytes = (cnt * bits + 7) / 8;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(b);
  if (nbytes == bits) {
    if (bits == 8 && (addr & 7u) == 0) return *reinterpret_cast<const uint64_t*>(b);
    if (bits == 4 && (addr & 3u) == 0) return *reinterpret_cast<const uint32_t*>(b);
    if (bits == 2 && (addr & 1u) == 0) return *reinterpret_cast<const uint16_t*>(b);
    if (bits == 1) return *b;
  }
  uint64_t w = 0;
  for (int k = 0; k < nbytes; ++k) w |= static_cast<uint64_t>(b[k]) << (8 * k);
  return w;
}

__device__ __forceinline__ void store_codes(uint8_t* codes, int bits, int64_t e0, int cnt, uint64_t w) {
  uint8_t* b = codes + (e0 / 8) * bits;
  const int nbytes = (cnt * bits + 7) / 8;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(b);
  if (nbytes == bits) {
    if (bits == 8 && (addr & 7u) == 0) { *reinterpret_cast<uint64_t*>(b) = w; return; }
    if (bits == 4 && (addr & 3u) == 0) { *reinterpret_cast<uint32_t*>(b) = static_cast<uint32_t>(w); return; }
    if (bits == 2 && (addr & 1u) == 0) { *reinterpret_cast<uint16_t*>(b) = static_cast<uint16_t>(w); return; }
    if (bits == 1) { *b = static_cast<uint8_t>(w); return; }
  }
  for (int k = 0; k < nbytes; ++k) b[k] = static_cast<uint8_t>(w >> (8 * k));
}

// ---------------------------------------------------------------------------------------------
// per-block state of the step kernels

struct TermChunk {  // a term's scale indices within the current chunk
  int64_t q0;       // (chunk start) / div
  int64_t nq;       // number of distinct quotients in the chunk
  int32_t wrap;     // mod <= nq: slots are indexed by (q % mod) instead of q - q0
  int32_t pad;
};

struct BlockShared {
  float qmap[2][kTableSize];    // the map (dequantize, stochastic rounding)
  float search[2][kTableSize];  // midpoints (nearest) or the map padded with +inf (stochastic)
  TermChunk tc[2][kMaxDims];
  int64_t start, len;
};

// Copy the chunk's tensor descriptor, its codec tables and the chunk's term bookkeeping into
// shared memory, and zero the tensor's absmax slots. Ends with __syncthreads().
__device__ __forceinline__ void block_setup(const GpuTensor* __restrict__ tensors, const WorkItem& item, GpuTensor& T,
                                            BlockShared& sh, uint32_t* slots, bool reduce) {
  const int tid = threadIdx.x;
  {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(tensors + item.tensor);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&T);
    for (int i = tid; i < static_cast<int>(sizeof(GpuTensor) / 4); i += blockDim.x) dst[i] = src[i];
  }
  if (tid == 0) {
    sh.start = item.start;
    sh.len = item.len;
  }
  __syncthreads();
  const int nslots = reduce ? T.reduce_slots : T.apply_slots;  // this tensor's slots
  for (int i = tid; i < nslots; i += blockDim.x) slots[i] = 0u;
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = T.d.st[k];
    if (st.kind != kQuant) continue;
    const float* search = st.codec.stochastic ? st.codec.qsearch : st.codec.mids;
    for (int i = tid; i < kTableSize; i += blockDim.x) {
      sh.qmap[k][i] = st.codec.qmap[i];
      sh.search[k][i] = search[i];
    }
    const GpuState& g = T.gs[k];
    if (tid < g.nterms && (reduce ? g.load_reduce : g.single)) {
      const Term& t = g.term[tid];
      int64_t q0, q1, r;
      divmod64(item.start, t.div, q0, r);
      divmod64(item.start + item.len - 1, t.div, q1, r);
      TermChunk& c = sh.tc[k][tid];
      c.q0 = q0;
      c.nq = q1 - q0 + 1;
      c.wrap = t.mod <= c.nq;
    }
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// the per-octet pipeline

struct Octet {
  float p[8];
  float s[2][8];
};

// New parameter and state values of the octet at e0 (cnt elements). final: the apply pass (all
// states, the real parameter, the factored second moment); otherwise the reduce pass (only the
// states that need it; the parameter only if the rule's states read it).
template <class Rule>
__device__ __forceinline__ void compute_octet(const GpuTensor& T, const BlockShared& sh, int64_t e0, int cnt, bool final,
                                              Octet& o) {
  const TensorDesc& t = T.d;
  const Scalars h = t.h;
  float g[8];
  load8(t.grad, t.gdtype, e0, cnt, g);
  if (final || Rule::states_read_param(h)) {
    load8(t.param, t.pdtype, e0, cnt, o.p);
  } else {  // the states ignore p: any finite values do (p is not stored)
#pragma unroll
    for (int j = 0; j < 8; ++j) o.p[j] = g[j];
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = t.st[k];
    const bool need = final ? st.kind != kNone : T.gs[k].load_reduce != 0;
    if (!need) {
#pragma unroll
      for (int j = 0; j < 8; ++j) o.s[k][j] = 0.0f;
    } else if (st.kind == kFp32) {
      load8(st.values, kF32, e0, cnt, o.s[k]);
    } else {
      const int bits = st.codec.bits;
      const uint32_t mask = (1u << bits) - 1u;
      const uint64_t w = load_codes(st.codes, bits, e0, cnt);
      float sc[8];
      layout_values<true>(t, T.gs[k], st.scales, e0, cnt, sc);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t code = static_cast<uint32_t>(w >> (j * bits)) & mask;
        o.s[k][j] = j < cnt ? sh.qmap[k][code] * sc[j] : 0.0f;
      }
    }
  }
  bool update_v = true;
  if (t.factored) {
    update_v = false;
    if (final) {  // v = row_factor[r] * col[batch, c]
      int64_t r, c;
      divmod64(e0, t.cols, r, c);
      int64_t b, unused;
      divmod64(r, T.R, b, unused);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o.s[1][j] = j < cnt ? t.row_factor[r] * t.col[b * t.cols + c] : 0.0f;
        if (++c == t.cols) {
          c = 0;
          ++r;
          divmod64(r, T.R, b, unused);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) Rule::apply(o.p[j], g[j], o.s[0][j], o.s[1][j], h, update_v);
}

// atomicMax of each run of equal slot indices of the octet (values as abs bits).
__device__ __forceinline__ void fold_runs(uint32_t* base, const int64_t idx[8], const uint32_t bits[8], int cnt) {
  int64_t cur = idx[0];
  uint32_t m = bits[0];
#pragma unroll
  for (int j = 1; j < 8; ++j) {
    if (j < cnt) {
      if (idx[j] == cur) {
        m = bits[j] > m ? bits[j] : m;
      } else {
        atomicMax(base + cur, m);
        cur = idx[j];
        m = bits[j];
      }
    }
  }
  atomicMax(base + cur, m);
}

// Fold the octet's new values of state k into the group slots (single-pass, apply pass).
__device__ __forceinline__ void fold_single(const GpuTensor& T, const BlockShared& sh, int k, const float x[8],
                                            int64_t e0, int cnt, uint32_t* slots) {
  const Term& t = T.gs[k].term[0];
  const int64_t q0 = sh.tc[k][0].q0;
  TermWalk w;
  w.begin(t, e0);
  int64_t idx[8];
  uint32_t b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    idx[j] = w.q - q0;
    b[j] = abs_bits(x[j]);
    w.next(t);
  }
  fold_runs(slots + T.gs[k].apply_slot, idx, b, cnt);
}

// Fold the octet's new values of a two-pass state into the term slots or the device partials.
__device__ __forceinline__ void fold_reduce(const GpuTensor& T, const BlockShared& sh, int k, const float x[8],
                                            int64_t e0, int cnt, uint32_t* slots) {
  const GpuState& g = T.gs[k];
  uint32_t b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) b[j] = abs_bits(x[j]);
  for (int d = 0; d < g.nterms; ++d) {
    const Term& t = g.term[d];
    const TermChunk& c = sh.tc[k][d];
    TermWalk w;
    w.begin(t, e0);
    int64_t idx[8];
    if (t.slot < 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        idx[j] = w.index(t);
        w.next(t);
      }
      fold_runs(T.d.st[k].partial, idx, b, cnt);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        idx[j] = c.wrap ? w.qm : w.q - c.q0;
        w.next(t);
      }
      fold_runs(slots + t.slot, idx, b, cnt);
    }
  }
}

// Quantize the octet's new values of state k, pack and store the codes.
__device__ __forceinline__ void quantize_octet(const GpuTensor& T, const BlockShared& sh, int k, const float x[8],
                                               int64_t e0, int cnt, const uint32_t* slots) {
  const StateDesc& st = T.d.st[k];
  const CodecDesc& c = st.codec;
  const GpuState& g = T.gs[k];
  float r[8];
  if (g.single) {  // the group's new scale from the block's absmax slot
    const Term& t = g.term[0];
    const int64_t q0 = sh.tc[k][0].q0;
    TermWalk w;
    w.begin(t, e0);
    int64_t cur = -1;
    float rc = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt && w.q != cur) {
        cur = w.q;
        rc = qdiv(1.0f, scale_from_absmax_bits(slots[g.apply_slot + (cur - q0)]));
      }
      r[j] = rc;
      w.next(t);
    }
  } else {  // two-pass: the reciprocals of the new scales from the reduce pass
    layout_values<false>(T.d, g, st.new_recip, e0, cnt, r);
  }
  const int bits = c.bits;
  uint64_t word = 0;
  if (c.stochastic) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) {
        const float u = uniform01(hash_bits(st.key, static_cast<uint64_t>(e0 + j)));
        const int code = quantize_stochastic(normalize(x[j], r[j]), u, sh.qmap[k], sh.search[k], c.levels, bits);
        word |= static_cast<uint64_t>(static_cast<uint32_t>(code)) << (j * bits);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) {
        const int code = quantize_nearest(normalize(x[j], r[j]), sh.search[k], bits);
        word |= static_cast<uint64_t>(static_cast<uint32_t>(code)) << (j * bits);
      }
    }
  }
  store_codes(st.codes, bits, e0, cnt, word);
}

// Store the octet: quantized states, fp32 states, the parameter.
// The new bf16/fp16 parameter with stochastic rounding and/or Kahan compensation (buffer in the
// parameter's dtype), with the element functions of the CPU kernel (qconf/element.h). The old
// parameter is still in memory: every element is stored once, in the last pass.
__device__ __forceinline__ void store_param_policy(const TensorDesc& t, int64_t e0, int cnt, const float p[8]) {
  uint16_t* dst = static_cast<uint16_t*>(t.param) + e0;
  const bool bf16 = t.pdtype == kBF16, sr = t.w_stochastic != 0, kahan = t.w_kahan != 0;
  float c[8];
  if (kahan) load8(t.comp.values16, t.pdtype, e0, cnt, c);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= cnt) continue;
    const uint32_t h = sr ? hash_bits(t.pkey, static_cast<uint64_t>(e0 + j)) : 0u;
    dst[j] = kahan ? kahan_write(p[j], dst[j], c[j], bf16, sr, h) : round_half(p[j], bf16, sr, h);
  }
  if (kahan) store8(t.comp.values16, t.pdtype, e0, cnt, c);
}

__device__ __forceinline__ void store_octet(const GpuTensor& T, const BlockShared& sh, const Octet& o, int64_t e0,
                                            int cnt, const uint32_t* slots) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const StateDesc& st = T.d.st[k];
    if (st.kind == kQuant) quantize_octet(T, sh, k, o.s[k], e0, cnt, slots);
    else if (st.kind == kFp32) store8(st.values, kF32, e0, cnt, o.s[k]);
  }
  if (T.d.w_stochastic || T.d.w_kahan) store_param_policy(T.d, e0, cnt, o.p);
  else store8(T.d.param, T.d.pdtype, e0, cnt, o.p);
}

// ---------------------------------------------------------------------------------------------
// kernels

// Pass "reduce": absmax of the new values of two-pass states into their device partials.
template <class Rule>
__global__ void __launch_bounds__(kThreads, 2) reduce_kernel(const GpuTensor* __restrict__ tensors,
                                                             const WorkItem* __restrict__ items) {
  extern __shared__ uint32_t slots[];
  __shared__ __align__(16) unsigned char t_raw[sizeof(GpuTensor)];
  __shared__ BlockShared sh;
  GpuTensor& T = *reinterpret_cast<GpuTensor*>(t_raw);
  const WorkItem item = items[blockIdx.x];
  block_setup(tensors, item, T, sh, slots, true);
  const int64_t noct = (sh.len + 7) / 8;
  for (int64_t o = threadIdx.x; o < noct; o += blockDim.x) {
    const int64_t e0 = sh.start + 8 * o;
    const int cnt = static_cast<int>(sh.start + sh.len - e0 < 8 ? sh.start + sh.len - e0 : 8);
    Octet v;
    compute_octet<Rule>(T, sh, e0, cnt, false, v);
#pragma unroll
    for (int k = 0; k < 2; ++k)
      if (T.gs[k].load_reduce) fold_reduce(T, sh, k, v.s[k], e0, cnt, slots);
  }
  __syncthreads();
  for (int k = 0; k < 2; ++k) {  // flush the shared slots
    const GpuState& g = T.gs[k];
    if (!g.load_reduce) continue;
    for (int d = 0; d < g.nterms; ++d) {
      const Term& t = g.term[d];
      if (t.slot < 0) continue;
      const TermChunk& c = sh.tc[k][d];
      const int64_t n = c.wrap ? t.mod : c.nq;
      for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
        const uint32_t m = slots[t.slot + s];
        if (m == 0u) continue;  // the partials start at 0
        int64_t idx = s;
        if (!c.wrap) {
          int64_t unused;
          divmod64(c.q0 + s, t.mod, unused, idx);
        }
        atomicMax(T.d.st[k].partial + idx + t.off, m);
      }
    }
  }
}

// Pass "apply": every element of every tensor, once.
template <class Rule>
__global__ void __launch_bounds__(kThreads, 2) apply_kernel(const GpuTensor* __restrict__ tensors,
                                                            const WorkItem* __restrict__ items) {
  extern __shared__ uint32_t slots[];
  __shared__ __align__(16) unsigned char t_raw[sizeof(GpuTensor)];
  __shared__ BlockShared sh;
  GpuTensor& T = *reinterpret_cast<GpuTensor*>(t_raw);
  const WorkItem item = items[blockIdx.x];
  block_setup(tensors, item, T, sh, slots, false);
  const int64_t noct = (sh.len + 7) / 8;
  const bool single = T.gs[0].single || T.gs[1].single;
  // One octet per thread (the usual chunk): the new values stay in registers while the group
  // maxima are reduced. Several octets per thread: pass 0 reduces the group maxima, pass 1
  // recomputes (nothing is stored before pass 1, so both passes see the same inputs) and stores.
  const int64_t iters = (noct + blockDim.x - 1) / blockDim.x;
  const bool regs = iters == 1;
  for (int pass = single && !regs ? 0 : 1; pass < 2; ++pass) {
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t o = it * blockDim.x + threadIdx.x;
      const bool valid = o < noct;
      const int64_t e0 = sh.start + 8 * o;
      const int cnt = valid ? static_cast<int>(sh.start + sh.len - e0 < 8 ? sh.start + sh.len - e0 : 8) : 0;
      Octet v;
      if (valid) compute_octet<Rule>(T, sh, e0, cnt, true, v);
      if (single && (pass == 0 || regs)) {  // block-uniform
        if (valid) {
#pragma unroll
          for (int k = 0; k < 2; ++k)
            if (T.gs[k].single) fold_single(T, sh, k, v.s[k], e0, cnt, slots);
        }
        if (regs) __syncthreads();
      }
      if (pass == 1 && valid) store_octet(T, sh, v, e0, cnt, slots);
    }
    if (pass == 0) __syncthreads();
  }
  if (single) {  // the groups' new scales, after every old scale of the chunk was read
    __syncthreads();
    for (int k = 0; k < 2; ++k) {
      const GpuState& g = T.gs[k];
      if (!g.single) continue;
      const TermChunk& c = sh.tc[k][0];
      for (int64_t s = threadIdx.x; s < c.nq; s += blockDim.x)
        T.d.st[k].scales[c.q0 + s] = scale_from_absmax_bits(slots[g.apply_slot + s]);
    }
  }
}

// Two-pass states: stored scale and reciprocal from the reduced absmax bits (all states of the
// call concatenated).
__global__ void __launch_bounds__(kThreads) finalize_kernel(const uint32_t* __restrict__ partial,
                                                            float* __restrict__ recip, float* __restrict__ scale,
                                                            int64_t n) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float sc = scale_from_absmax_bits(partial[j]);
    recip[j] = qdiv(1.0f, sc);
    scale[j] = sc;
  }
}

__global__ void __launch_bounds__(kThreads) copy_kernel(const CopyItem* __restrict__ items) {
  const CopyItem it = items[blockIdx.x];
  for (int64_t j = threadIdx.x; j < it.n; j += blockDim.x) it.dst[j] = it.src[j];
}

// Factored second moment, pass 1a: sum of g_eff^2 per row, as the CPU: 16 lanes, lane k adds the
// elements j = k (mod 16) in order, then a tree 8, 4, 2, 1.
__global__ void __launch_bounds__(kThreads) factor_rows_kernel(const GpuTensor* __restrict__ tensors,
                                                               const FactorItem* __restrict__ items) {
  const FactorItem it = items[blockIdx.x];
  const TensorDesc& t = tensors[it.tensor].d;
  const int lane = threadIdx.x & 15;
  const int64_t r = it.a + (threadIdx.x >> 4);
  const bool valid = r < t.rows;
  const Scalars h = t.h;
  float acc = 0.0f;
  if (valid) {
    for (int64_t j = lane; j < t.cols; j += 16) {
      const int64_t e = r * t.cols + j;
      const float ge = AdamRule::effective_grad(load_elem(t.param, t.pdtype, e), load_elem(t.grad, t.gdtype, e), h);
      acc = acc + ge * ge;
    }
  }
  for (int w = 8; w > 0; w >>= 1) acc = acc + __shfl_down_sync(0xffffffffu, acc, w, 16);
  if (valid && lane == 0) t.row_sum[r] = acc;
}

// Pass 1b: column sums of g_eff^2 within one fixed row chunk, rows in order, per batch.
__global__ void __launch_bounds__(kThreads) factor_cols_kernel(const GpuTensor* __restrict__ tensors,
                                                               const FactorItem* __restrict__ items) {
  const FactorItem it = items[blockIdx.x];
  const GpuTensor& G = tensors[it.tensor];
  const TensorDesc& t = G.d;
  const int64_t c = it.b + threadIdx.x;
  if (c >= t.cols) return;
  const Scalars h = t.h;
  const int64_t r0 = it.a * t.rows_per_chunk;
  const int64_t r1 = r0 + t.rows_per_chunk < t.rows ? r0 + t.rows_per_chunk : t.rows;
  float* colp = t.col_partial + it.a * G.batches * t.cols;  // this chunk's sums: [batch][C]
  int64_t batch = r0 / G.R;
  int64_t batch_end = (batch + 1) * G.R;
  float s = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    if (r == batch_end) {
      colp[batch * t.cols + c] = s;
      s = 0.0f;
      ++batch;
      batch_end += G.R;
    }
    const int64_t e = r * t.cols + c;
    const float ge = AdamRule::effective_grad(load_elem(t.param, t.pdtype, e), load_elem(t.grad, t.gdtype, e), h);
    s = s + ge * ge;
  }
  if (r1 > r0) colp[batch * t.cols + c] = s;
}

// Statistics update, in the CPU driver's order: rows (kind 0) and columns (kind 1).
__global__ void __launch_bounds__(kThreads) factor_stats_kernel(const GpuTensor* __restrict__ tensors,
                                                                const FactorItem* __restrict__ items) {
  const FactorItem it = items[blockIdx.x];
  const GpuTensor& G = tensors[it.tensor];
  const TensorDesc& t = G.d;
  const Scalars& h = t.h;
  const int64_t j = it.a + threadIdx.x;
  if (it.kind == 0) {
    if (j >= t.rows) return;
    const float fC = static_cast<float>(t.cols);
    t.row[j] = __fadd_rn(__fmul_rn(t.row[j], h.b2), __fmul_rn(qdiv(t.row_sum[j], fC), h.omb2));
  } else {
    const int64_t n = G.batches * t.cols;
    if (j >= n) return;
    const float fR = static_cast<float>(G.R);
    float s = 0.0f;
    for (int64_t c = 0; c < G.chunks; ++c) s = __fadd_rn(s, t.col_partial[c * n + j]);
    t.col[j] = __fadd_rn(__fmul_rn(t.col[j], h.b2), __fmul_rn(qdiv(s, fR), h.omb2));
  }
}

// Row factors r / mean(r) per batch (rows summed in order), 0 for an all-zero batch.
__global__ void __launch_bounds__(kThreads) factor_rowfactor_kernel(const GpuTensor* __restrict__ tensors,
                                                                    const FactorItem* __restrict__ items) {
  const FactorItem it = items[blockIdx.x];
  const GpuTensor& G = tensors[it.tensor];
  const TensorDesc& t = G.d;
  const int64_t b = it.a + threadIdx.x;
  if (b >= G.batches) return;
  const float fR = static_cast<float>(G.R);
  const float* row = t.row + b * G.R;
  float s = 0.0f;
  for (int64_t r = 0; r < G.R; ++r) s = __fadd_rn(s, row[r]);
  const float mean = qdiv(s, fR);
  for (int64_t r = 0; r < G.R; ++r) t.row_factor[b * G.R + r] = mean > 0.0f ? qdiv(row[r], mean) : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// host side

// Scale-index terms of a quantized state (see Term).
void make_terms(const TensorDesc& t, const StateDesc& st, GpuState& g) {
  const CodecDesc& c = st.codec;
  if (c.scale_kind == kBlock) {
    g.nterms = 1;
    g.term[0].div = c.block;
    g.term[0].mod = std::max<int64_t>(st.num_scales, 1);
    g.term[0].off = 0;
  } else if (c.scale_kind == kDim1) {
    g.nterms = 1;
    g.term[0].div = c.inner;
    g.term[0].mod = c.d1;
    g.term[0].off = 0;
  } else {
    g.nterms = t.ndim;
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) {
      int64_t div = 1;
      for (int e = d + 1; e < t.ndim; ++e) div *= t.shape[e];
      g.term[d].div = std::max<int64_t>(div, 1);
      g.term[d].mod = std::max<int64_t>(t.shape[d], 1);
      g.term[d].off = off;
      off += t.shape[d];
    }
  }
}

// The GPU's chunk length of a tensor and its single-pass states: chunks hold whole groups of
// every single-pass state and whole bytes of codes; a state whose groups would need more shared
// slots per block than the budget is reduced in two passes instead (same results: the scale is
// the absmax of the group either way).
int64_t plan_tensor(GpuTensor& G) {
  TensorDesc& t = G.d;
  for (int k = 0; k < 2; ++k) {
    StateDesc& st = t.st[k];
    G.gs[k].single = st.kind == kQuant && !st.two_pass;
    if (st.kind == kQuant) make_terms(t, st, G.gs[k]);
  }
  int64_t chunk = 8;
  for (;;) {
    int64_t unit = 8;
    for (int k = 0; k < 2; ++k)
      if (G.gs[k].single) unit = host::lcm64(unit, t.st[k].codec.block);
    chunk = unit >= kChunkTarget ? unit : (kChunkTarget / unit) * unit;
    if (chunk >= t.numel) chunk = t.numel;
    int64_t slots[2] = {0, 0};
    for (int k = 0; k < 2; ++k)
      if (G.gs[k].single) slots[k] = (chunk + t.st[k].codec.block - 1) / t.st[k].codec.block;
    if (slots[0] + slots[1] <= kSlotBudget) {
      G.gs[0].apply_slot = 0;
      G.gs[1].apply_slot = static_cast<int32_t>(slots[0]);
      G.apply_slots = static_cast<int32_t>(slots[0] + slots[1]);
      break;
    }
    const int worst = slots[0] >= slots[1] ? 0 : 1;
    G.gs[worst].single = 0;
    t.st[worst].two_pass = 1;
  }
  t.two_pass = 0;
  int32_t used = 0;
  for (int k = 0; k < 2; ++k) {
    GpuState& g = G.gs[k];
    g.load_reduce = t.st[k].kind == kQuant && !g.single;
    t.st[k].two_pass = g.load_reduce;
    if (!g.load_reduce) continue;
    t.two_pass = 1;
    for (int d = 0; d < g.nterms; ++d) {  // shared slots per term while the budget lasts
      Term& term = g.term[d];
      const int64_t need = std::min<int64_t>(term.mod, (chunk - 1) / term.div + 2);
      if (used + need <= kSlotBudget) {
        term.slot = used;
        used += static_cast<int32_t>(need);
      } else {
        term.slot = -1;
      }
    }
  }
  G.reduce_slots = used;
  return chunk;
}

template <class T>
size_t append_bytes(std::vector<uint8_t>& buf, const std::vector<T>& v) {
  const size_t off = (buf.size() + 15) / 16 * 16;
  buf.resize(off + sizeof(T) * v.size());
  if (!v.empty()) std::memcpy(buf.data() + off, v.data(), sizeof(T) * v.size());
  return off;
}

unsigned grid_of(size_t n) {
  TORCH_CHECK(n <= 0x7fffffffu, "qconf fused_step (CUDA): too many work items");
  return static_cast<unsigned>(n);
}

template <class Rule>
void launch_passes(cudaStream_t stream, const GpuTensor* tensors, const WorkItem* items, size_t n_reduce,
                   size_t n_items, int reduce_slots, int apply_slots, const uint32_t* partial, float* recip,
                   float* newscale, int64_t n_partial, const CopyItem* copies, size_t n_copies) {
  if (n_reduce > 0) {
    reduce_kernel<Rule><<<grid_of(n_reduce), kThreads, sizeof(uint32_t) * reduce_slots, stream>>>(tensors, items);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (n_partial > 0) {
      const int64_t blocks = std::min<int64_t>((n_partial + kThreads - 1) / kThreads, 65535);
      finalize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(partial, recip, newscale, n_partial);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (n_items > 0) {
    apply_kernel<Rule><<<grid_of(n_items), kThreads, sizeof(uint32_t) * apply_slots, stream>>>(tensors, items);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (n_copies > 0) {
    copy_kernel<<<grid_of(n_copies), kThreads, 0, stream>>>(copies);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void fused_step_cuda(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                     at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                     c10::ArrayRef<double> hyper, int64_t seed) {
  const int64_t T = static_cast<int64_t>(params.size());
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  if (T == 0) return;
  TORCH_CHECK(params[0].is_cuda(), "qconf fused_step (CUDA): parameter 0 is not a CUDA tensor");
  const at::Device device = params[0].device();
  TORCH_CHECK(tables.is_cpu() || tables.device() == device, "qconf fused_step (CUDA): tables must be on the CPU or on ",
              device.str());
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  // Describe the tensors with the tables' host address, then move every table pointer to the
  // tables' place in the device buffer (or describe with the device address if they live there).
  const bool tables_on_host = tables.is_cpu();
  const float* tab = tables.data_ptr<float>();
  host::CallDescs call;
  host::describe_tensors(rule, params, grads, steps, states, meta, tab, tables.size(0), hyper, seed, device, "CUDA",
                         call);

  std::vector<GpuTensor> gts(T);
  std::vector<WorkItem> two_items, one_items;
  std::vector<FactorItem> row_items, col_items, stat_items, rf_items;
  int reduce_slots = 0, apply_slots = 0;
  int64_t n_partial = 0, n_colp = 0, n_rows = 0;
  for (int64_t i = 0; i < T; ++i) {
    GpuTensor& G = gts[i];
    G.d = call.descs[i];
    TensorDesc& t = G.d;
    TORCH_CHECK(t.comp.kind != kQuant, "qconf fused_step (CUDA): parameter ", i,
                " has a quantized Kahan buffer (weights.compensation_codec), which the CUDA kernels do not implement;"
                " the buffer in the parameter's dtype (no compensation_codec) is supported");
    if (t.numel == 0) continue;
    const int64_t chunk = plan_tensor(G);
    reduce_slots = std::max(reduce_slots, t.two_pass ? G.reduce_slots : 0);
    apply_slots = std::max(apply_slots, G.apply_slots);
    std::vector<WorkItem>& dst = t.two_pass ? two_items : one_items;
    for (int64_t s = 0; s < t.numel; s += chunk)
      dst.push_back({static_cast<int32_t>(i), s, std::min(chunk, t.numel - s)});
    for (auto& st : t.st)
      if (st.kind == kQuant && st.two_pass) n_partial += st.num_scales;
    if (t.factored) {
      G.R = t.shape[t.ndim - 2];
      G.batches = t.rows / G.R;
      t.rows_per_chunk = (t.rows + host::kFactorChunks - 1) / host::kFactorChunks;
      G.chunks = (t.rows + t.rows_per_chunk - 1) / t.rows_per_chunk;
      n_colp += G.chunks * G.batches * t.cols;
      n_rows += t.rows;
      const int32_t ti = static_cast<int32_t>(i);
      for (int64_t r = 0; r < t.rows; r += kFactorRowsPerBlock) row_items.push_back({ti, 0, r, 0});
      for (int64_t c = 0; c < G.chunks; ++c)
        for (int64_t j = 0; j < t.cols; j += kThreads) col_items.push_back({ti, 0, c, j});
      for (int64_t r = 0; r < t.rows; r += kThreads) stat_items.push_back({ti, 0, r, 0});
      for (int64_t j = 0; j < G.batches * t.cols; j += kThreads) stat_items.push_back({ti, 1, j, 0});
      for (int64_t b = 0; b < G.batches; b += kThreads) rf_items.push_back({ti, 0, b, 0});
    }
  }
  const size_t n_reduce = two_items.size();
  std::vector<WorkItem> items = std::move(two_items);  // two-pass tensors first: the reduce pass is a prefix
  items.insert(items.end(), one_items.begin(), one_items.end());

  // scratch: [partials (zeroed) | column partials (zeroed) | reciprocals | new scales | row sums | row factors]
  const int64_t n_zero = n_partial + n_colp;
  const int64_t n_scratch = n_zero + 2 * n_partial + 2 * n_rows;
  at::Tensor scratch = at::empty({std::max<int64_t>(n_scratch, 1)}, at::TensorOptions().dtype(at::kFloat).device(device));
  float* sbase = scratch.data_ptr<float>();
  if (n_zero > 0) C10_CUDA_CHECK(cudaMemsetAsync(sbase, 0, sizeof(float) * n_zero, stream));
  uint32_t* partial_all = reinterpret_cast<uint32_t*>(sbase);
  float* colp_all = sbase + n_partial;
  float* recip_all = sbase + n_zero;
  float* newscale_all = recip_all + n_partial;
  float* rows_all = newscale_all + n_partial;
  std::vector<CopyItem> copies;
  {
    int64_t po = 0, co = 0, ro = 0;
    for (auto& G : gts) {
      TensorDesc& t = G.d;
      if (t.numel == 0) continue;
      for (auto& st : t.st) {
        if (st.kind != kQuant || !st.two_pass) continue;
        st.partial = partial_all + po;
        st.new_recip = recip_all + po;
        copies.push_back({st.scales, newscale_all + po, st.num_scales});
        po += st.num_scales;
      }
      if (t.factored) {
        t.col_partial = colp_all + co;
        co += G.chunks * G.batches * t.cols;
        t.row_sum = rows_all + ro;
        t.row_factor = rows_all + n_rows + ro;
        ro += t.rows;
      }
    }
  }

  // one host buffer -> one copy: descriptors, work items, copy items, tables (if on the host)
  std::vector<uint8_t> buf;
  const size_t off_t = append_bytes(buf, gts);
  const size_t off_items = append_bytes(buf, items);
  const size_t off_rows = append_bytes(buf, row_items);
  const size_t off_cols = append_bytes(buf, col_items);
  const size_t off_stats = append_bytes(buf, stat_items);
  const size_t off_rf = append_bytes(buf, rf_items);
  const size_t off_copies = append_bytes(buf, copies);
  size_t off_tab = 0;
  if (tables_on_host) {
    off_tab = (buf.size() + 15) / 16 * 16;
    buf.resize(off_tab + sizeof(float) * static_cast<size_t>(tables.numel()));
    std::memcpy(buf.data() + off_tab, tab, sizeof(float) * static_cast<size_t>(tables.numel()));
  }
  at::Tensor dbuf = at::empty({static_cast<int64_t>(buf.size())}, at::TensorOptions().dtype(at::kByte).device(device));
  uint8_t* dbase = dbuf.data_ptr<uint8_t>();
  if (tables_on_host) {  // rebase the codec table pointers (inside the host copy) onto the device copy
    const float* dtab = reinterpret_cast<const float*>(dbase + off_tab);
    auto rebase = [&](const float* p) { return p == nullptr ? p : dtab + (p - tab); };
    GpuTensor* hts = reinterpret_cast<GpuTensor*>(buf.data() + off_t);
    for (int64_t i = 0; i < T; ++i) {
      for (auto& st : hts[i].d.st) {
        if (st.kind != kQuant) continue;
        CodecDesc& c = st.codec;
        c.qmap = rebase(c.qmap);
        c.mids = rebase(c.mids);
        c.qsearch = rebase(c.qsearch);
        c.coarse_mids = rebase(c.coarse_mids);
        c.coarse_qsearch = rebase(c.coarse_qsearch);
        c.coarse32_mids = rebase(c.coarse32_mids);
        c.coarse32_qsearch = rebase(c.coarse32_qsearch);
        c.cols_mids = rebase(c.cols_mids);
        c.cols_qsearch = rebase(c.cols_qsearch);
      }
    }
  }
  at::Tensor hbuf = at::empty({static_cast<int64_t>(buf.size())}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(hbuf.data_ptr<uint8_t>(), buf.data(), buf.size());
  dbuf.copy_(hbuf, /*non_blocking=*/true);  // on the current stream; torch keeps the pinned block alive

  const GpuTensor* d_tensors = reinterpret_cast<const GpuTensor*>(dbase + off_t);
  const WorkItem* d_items = reinterpret_cast<const WorkItem*>(dbase + off_items);
  const CopyItem* d_copies = reinterpret_cast<const CopyItem*>(dbase + off_copies);

  if (!row_items.empty()) {  // factored second moments: sums, then the statistics and row factors
    factor_rows_kernel<<<grid_of(row_items.size()), kThreads, 0, stream>>>(
        d_tensors, reinterpret_cast<const FactorItem*>(dbase + off_rows));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!col_items.empty()) {
      factor_cols_kernel<<<grid_of(col_items.size()), kThreads, 0, stream>>>(
          d_tensors, reinterpret_cast<const FactorItem*>(dbase + off_cols));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    factor_stats_kernel<<<grid_of(stat_items.size()), kThreads, 0, stream>>>(
        d_tensors, reinterpret_cast<const FactorItem*>(dbase + off_stats));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!rf_items.empty()) {
      factor_rowfactor_kernel<<<grid_of(rf_items.size()), kThreads, 0, stream>>>(
          d_tensors, reinterpret_cast<const FactorItem*>(dbase + off_rf));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  switch (rule) {
    case kRuleAdam:
      launch_passes<AdamRule>(stream, d_tensors, d_items, n_reduce, items.size(), reduce_slots, apply_slots,
                              partial_all, recip_all, newscale_all, n_partial, d_copies, copies.size());
      break;
    case kRuleSgd:
      launch_passes<SgdRule>(stream, d_tensors, d_items, n_reduce, items.size(), reduce_slots, apply_slots,
                             partial_all, recip_all, newscale_all, n_partial, d_copies, copies.size());
      break;
    default:
      launch_passes<LionRule>(stream, d_tensors, d_items, n_reduce, items.size(), reduce_slots, apply_slots,
                              partial_all, recip_all, newscale_all, n_partial, d_copies, copies.size());
      break;
  }
}

}  // namespace qconf
