// The generic fused optimizer step on CUDA: the same contract and the same per-element math as the
// CPU driver (csrc/cpu/step.cpp), run as a few multi-tensor launches on the current stream, for
// any codec; the entry points (csrc/cuda/cuda_step.cu) give it the tensors that no specialized
// kernel (qconf/spec.h) takes, and all of them unless QCONF_CUDA_KERNELS=specialized.
//
// Host: the tensors come described by the shared code in qconf/step_host.h (one copy of the
// Scalars, RNG keys, codec descriptions and single/two-pass decisions for both drivers), then are
// planned by qconf/cuda_plan.h (chunks, shared slots, work items, scratch layout, the buffer
// of descriptors, work items and tables); this file only allocates, copies and launches. The
// buffer goes to the device in one copy from pinned memory; scratch (absmax partials, new
// reciprocals and scales, factored sums) is one device allocation.
//
// Device: one thread block per chunk, one octet (8 consecutive elements, i.e. `bits` whole bytes
// of packed codes) per thread and iteration. Passes, each one launch over all tensors:
//
//   factor   (factored second moments) row sums of finite g_eff^2 (16 strided lanes + tree, the CPU's
//            association), column sums per fixed row chunk, then the statistics update and the
//            row factors of qconf/factored.h -- results bit-identical to the CPU driver
//   reduce   (two-pass states: tensor/dim1/rank1 scales, huge blocks) new state values -> abs
//            bits of the finite ones -> atomicMax into shared-memory slots per scale index, flushed with atomicMax
//            into a per-state device array; a small kernel turns them into scales/reciprocals
//            (finalize_scale, element.h)
//   apply    dequantize -> rule -> new group absmax (shared-memory atomicMax over abs bits, one
//            slot per group of the chunk) -> quantize -> pack -> store; new scales of the
//            single-pass groups are written by their block, those of two-pass states by a final
//            copy kernel (the old scales are read until every chunk is dequantized)
//
// Every element operation is a call into qconf/element.h (the rules, quantize_*, normalize,
// conversions, RNG, finite_abs_bits / scale_from_absmax_bits, fmin_nan / fmax_nan), and the per-element
// scales come from the CPU's scale-layout walker (qconf/scale_walk.h): the same code the CPU
// scalar path runs. Compiled with --fmad=false: no contraction, every op rounded as written.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda_driver.h"
#include "qconf/cuda_plan.h"
#include "qconf/element.h"
#include "qconf/factored.h"
#include "qconf/scale_walk.h"
#include "qconf/step_driver.h"
#include "qconf/step_host.h"
#include "qconf/step_types.h"

namespace qconf {
namespace {

using namespace gpu;  // the planner's descriptors and launch geometry (qconf/cuda_plan.h)

// ---------------------------------------------------------------------------------------------
// small device helpers (no element math here: indices, loads, stores, bit packing)

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

// Per-element values of a state's scale layout for an octet at e0 (cnt elements): the stored
// value (block, dim1) or the rank-1 combination, with fmin_nan for scales (kMin) or fmax_nan for
// reciprocals, walked as the CPU walks them (qconf/scale_walk.h).
template <bool kMin>
__device__ __forceinline__ float combine(float a, float b) {
  return kMin ? fmin_nan(a, b) : fmax_nan(a, b);
}

template <bool kMin>
__device__ __forceinline__ void layout_values(const TensorDesc& t, const CodecDesc& c, const float* vals, int64_t e0,
                                              int cnt, float out[8]) {
  ScaleRuns runs(c, t, vals, kMin, e0, cnt);
  ScaleRun r;
  runs.next(r);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < cnt) {
      if (j == r.off + r.len) runs.next(r);
      const int64_t k = j - r.off;
      out[j] = r.vec == nullptr ? r.value : (r.comb ? combine<kMin>(r.value, r.vec[k]) : r.vec[k]);
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
      layout_values<true>(t, st.codec, st.scales, e0, cnt, sc);
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
    b[j] = finite_abs_bits(x[j]);
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
  for (int j = 0; j < 8; ++j) b[j] = finite_abs_bits(x[j]);
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
    layout_values<false>(T.d, c, st.new_recip, e0, cnt, r);
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
    const uint32_t h = sr ? param_bits(t.pkey, static_cast<uint64_t>(e0 + j), bf16) : 0u;
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
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    finalize_scale(partial, n, 1, j, recip, scale);
}

__global__ void __launch_bounds__(kThreads) copy_kernel(const CopyItem* __restrict__ items) {
  const CopyItem it = items[blockIdx.x];
  for (int64_t j = threadIdx.x; j < it.n; j += blockDim.x) it.dst[j] = it.src[j];
}

// Factored second moment, pass 1a: sum of g_eff^2 per row, as the CPU: 16 lanes, lane k adds the
// elements j = k (mod 16) in order, then a tree 8, 4, 2, 1. (g_eff: Rule::effective_grad.)
template <class Rule>
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
      const float ge = Rule::effective_grad(load_elem(t.param, t.pdtype, e), load_elem(t.grad, t.gdtype, e), h);
      acc = acc + finite_square(ge);
    }
  }
  for (int w = 8; w > 0; w >>= 1) acc = acc + __shfl_down_sync(0xffffffffu, acc, w, 16);
  if (valid && lane == 0) t.row_sum[r] = acc;
}

// Pass 1b: column sums of g_eff^2 within one fixed row chunk, rows in order, per batch.
template <class Rule>
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
    const float ge = Rule::effective_grad(load_elem(t.param, t.pdtype, e), load_elem(t.grad, t.gdtype, e), h);
    s = s + finite_square(ge);
  }
  if (r1 > r0) colp[batch * t.cols + c] = s;
}

// Statistics update (qconf/factored.h): rows (kind 0) and columns (kind 1).
__global__ void __launch_bounds__(kThreads) factor_stats_kernel(const GpuTensor* __restrict__ tensors,
                                                                const FactorItem* __restrict__ items) {
  const FactorItem it = items[blockIdx.x];
  const GpuTensor& G = tensors[it.tensor];
  const TensorDesc& t = G.d;
  const int64_t j = it.a + threadIdx.x;
  if (it.kind == 0) {
    if (j < t.rows) factored_update_row(t, j);
  } else {
    if (j < G.batches * t.cols) factored_update_col(t, j, G.R, G.batches, G.chunks);
  }
}

// Row factors r / mean(r) per batch (qconf/factored.h).
__global__ void __launch_bounds__(kThreads) factor_rowfactor_kernel(const GpuTensor* __restrict__ tensors,
                                                                    const FactorItem* __restrict__ items) {
  const FactorItem it = items[blockIdx.x];
  const GpuTensor& G = tensors[it.tensor];
  const int64_t b = it.a + threadIdx.x;
  if (b < G.batches) factored_row_factors(G.d, b, G.R);
}

// ---------------------------------------------------------------------------------------------
// host side

unsigned grid_of(size_t n) {
  TORCH_CHECK(n <= 0x7fffffffu, "qconf fused_step (CUDA): too many work items");
  return static_cast<unsigned>(n);
}

// The buffer's parts on the device.
struct DeviceBuffer {
  const GpuTensor* tensors;
  const WorkItem* items;
  const FactorItem *rows, *cols, *stats, *rf;
  const CopyItem* copies;
};

// Factored second moments (a rule with a second moment; describe_tensors admits Adam only): the
// sums, then the statistics and the row factors.
template <class Rule>
void launch_factor(cudaStream_t stream, const Plan& plan, const DeviceBuffer& d) {
  if constexpr (Rule::kStates == 2) {
    if (plan.row_items.empty()) return;
    factor_rows_kernel<Rule><<<grid_of(plan.row_items.size()), kThreads, 0, stream>>>(d.tensors, d.rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!plan.col_items.empty()) {
      factor_cols_kernel<Rule><<<grid_of(plan.col_items.size()), kThreads, 0, stream>>>(d.tensors, d.cols);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    factor_stats_kernel<<<grid_of(plan.stat_items.size()), kThreads, 0, stream>>>(d.tensors, d.stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!plan.rf_items.empty()) {
      factor_rowfactor_kernel<<<grid_of(plan.rf_items.size()), kThreads, 0, stream>>>(d.tensors, d.rf);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// The reduce pass and the new scales of two-pass states, the apply pass, the scale copies.
template <class Rule>
void launch_passes(cudaStream_t stream, const Plan& plan, const DeviceBuffer& d, float* scratch) {
  const ScratchLayout& L = plan.scratch;
  if (plan.n_reduce > 0) {
    reduce_kernel<Rule><<<grid_of(plan.n_reduce), kThreads, sizeof(uint32_t) * plan.reduce_slots, stream>>>(
        d.tensors, d.items);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (L.n_partial > 0) {
      const int64_t blocks = std::min<int64_t>((L.n_partial + kThreads - 1) / kThreads, 65535);
      finalize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          reinterpret_cast<const uint32_t*>(scratch + L.partial()), scratch + L.recip(), scratch + L.new_scale(),
          L.n_partial);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (!plan.items.empty()) {
    apply_kernel<Rule><<<grid_of(plan.items.size()), kThreads, sizeof(uint32_t) * plan.apply_slots, stream>>>(
        d.tensors, d.items);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (!plan.copies.empty()) {
    copy_kernel<<<grid_of(plan.copies.size()), kThreads, 0, stream>>>(d.copies);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <class Rule>
void launch_step(cudaStream_t stream, const Plan& plan, const DeviceBuffer& d, float* scratch) {
  launch_factor<Rule>(stream, plan, d);
  launch_passes<Rule>(stream, plan, d, scratch);
}

}  // namespace

void run_generic(int64_t rule, const std::vector<TensorDesc>& descs, const at::Tensor& tables, const float* tab,
                 const at::Device& device, cudaStream_t stream) {
  if (descs.empty()) return;
  check_supported(descs);
  Plan plan = plan_call(descs);

  at::Tensor scratch = at::empty({std::max<int64_t>(plan.scratch.total(), 1)},
                                 at::TensorOptions().dtype(at::kFloat).device(device));
  float* sbase = scratch.data_ptr<float>();
  if (plan.scratch.zeroed() > 0)
    C10_CUDA_CHECK(cudaMemsetAsync(sbase, 0, sizeof(float) * plan.scratch.zeroed(), stream));
  assign_scratch(plan, sbase);

  // One buffer, one copy: descriptors, work items, copy items, and the tables if they are on the
  // host, in which case every table pointer moves to the tables' copy in the device buffer.
  const bool tables_on_host = tables.is_cpu();
  const size_t table_bytes = tables_on_host ? sizeof(float) * static_cast<size_t>(tables.numel()) : 0;
  const BufferLayout L = buffer_layout(plan, table_bytes);
  at::Tensor dbuf = at::empty({static_cast<int64_t>(L.size)}, at::TensorOptions().dtype(at::kByte).device(device));
  uint8_t* dbase = dbuf.data_ptr<uint8_t>();
  if (tables_on_host) rebase_plan_tables(plan, tab, reinterpret_cast<const float*>(dbase + L.tables));
  at::Tensor hbuf = at::empty({static_cast<int64_t>(L.size)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  pack_buffer(plan, L, tables_on_host ? tab : nullptr, table_bytes, hbuf.data_ptr<uint8_t>());
  dbuf.copy_(hbuf, /*non_blocking=*/true);  // on the current stream; torch keeps the pinned block alive

  DeviceBuffer d;
  d.tensors = reinterpret_cast<const GpuTensor*>(dbase + L.tensors);
  d.items = reinterpret_cast<const WorkItem*>(dbase + L.items);
  d.rows = reinterpret_cast<const FactorItem*>(dbase + L.rows);
  d.cols = reinterpret_cast<const FactorItem*>(dbase + L.cols);
  d.stats = reinterpret_cast<const FactorItem*>(dbase + L.stats);
  d.rf = reinterpret_cast<const FactorItem*>(dbase + L.rf);
  d.copies = reinterpret_cast<const CopyItem*>(dbase + L.copies);
  switch (rule) {
    case kRuleAdam: launch_step<AdamRule>(stream, plan, d, sbase); break;
    case kRuleSgd: launch_step<SgdRule>(stream, plan, d, sbase); break;
    case kRuleLion: launch_step<LionRule>(stream, plan, d, sbase); break;
    case kRuleMuonMomentum: launch_step<MuonMomentumRule>(stream, plan, d, sbase); break;
    default: launch_step<MuonUpdateRule>(stream, plan, d, sbase); break;
  }
}

}  // namespace qconf
