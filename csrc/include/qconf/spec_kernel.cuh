// The specialized CUDA step's kernels: a persistent grid over the units of one spec (spec.h),
// each thread running spec_octet.h's per-thread pipeline on its octet per iteration. This file
// holds only what threads do together: filling the shared tables, the group maxima (warp
// shuffles, and one exchange through shared memory for groups wider than a warp), the rank-1
// row and column maxima of the reduce pass, and the loop over units. tests/test_spec_host.py runs
// a host model of exactly these exchanges (spec_emulate.h) around the same per-thread code.
//
//   spec_apply_body   every element once: load -> dequantize -> rule -> group maxima -> quantize
//                     -> store; rank-1 states quantize with the reciprocals the finalize kernel
//                     made from the reduce pass
//   spec_reduce_body  the reduce pass of a spec with a rank-1 state: only that state's new values,
//                     their row maxima (shuffles, one atomicMax per warp and row) and column
//                     maxima (kept per thread over the unit's rows, one atomicMax per column and
//                     unit)
//
// Compiled ahead of time by nvcc (csrc/cuda/spec_aot.cu: template kernels) and at run time by
// NVRTC (QCONF_SPEC_KERNELS: extern "C" entry points for one spec per module).
#pragma once

#include "qconf/spec_octet.h"

namespace qconf {
namespace spec {

// Max over the `tpg` aligned lanes of a group (tpg a power of two; at most a warp here).
template <int TPG>
__device__ __forceinline__ uint32_t lanes_max(uint32_t m) {
#pragma unroll
  for (int o = (TPG < kWarp ? TPG : kWarp) / 2; o > 0; o >>= 1) {
    const uint32_t x = __shfl_xor_sync(0xffffffffu, m, o);
    m = x > m ? x : m;
  }
  return m;
}

// Group maxima wider than a warp: the warps' maxima through shared memory (one barrier; `slot`
// alternates between iterations, so a warp that runs ahead never overwrites a slot being read).
template <int TPG>
__device__ __forceinline__ uint32_t warps_max(uint32_t m, volatile uint32_t* slot) {
  if constexpr (TPG > kWarp) {
    constexpr int kWarps = TPG / kWarp;
    const int warp = threadIdx.x / kWarp;
    const int first = warp & ~(kWarps - 1);
    uint32_t r = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const uint32_t x = slot[first + w];
      r = x > r ? x : r;
    }
    return r;
  }
  return m;
}

// The maxima of each group-scaled state over its group (0 from threads without elements).
template <class S>
__device__ __forceinline__ Maxima group_maxima(Maxima mx, uint32_t (*xchg)[kThreads / kWarp], int parity) {
  constexpr int t0 = S::St0::kGroupThreads, t1 = S::St1::kGroupThreads, tc = S::Comp::kGroupThreads;
  if constexpr (t0 > 1) mx.m[0] = lanes_max<t0>(mx.m[0]);
  if constexpr (t1 > 1) mx.m[1] = lanes_max<t1>(mx.m[1]);
  if constexpr (tc > 1) mx.m[2] = lanes_max<tc>(mx.m[2]);
  if constexpr (t0 > kWarp || t1 > kWarp || tc > kWarp) {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) {
#pragma unroll
      for (int k = 0; k < 3; ++k) xchg[3 * parity + k][warp] = mx.m[k];
    }
    __syncthreads();
    mx.m[0] = warps_max<t0>(mx.m[0], xchg[3 * parity + 0]);
    mx.m[1] = warps_max<t1>(mx.m[1], xchg[3 * parity + 1]);
    mx.m[2] = warps_max<tc>(mx.m[2], xchg[3 * parity + 2]);
  }
  return mx;
}

// One octet of the apply pass. Every thread runs it, with or without elements (cnt = 0: zeros
// loaded, nothing stored), so the warp stays converged for the group exchange.
template <class S, bool FULL>
__device__ __forceinline__ void apply_octet(const SpecArgs& a, const SpecLooks<S>& tabs, const View& v,
                                            const Keys& keys, const At& at, uint32_t (*xchg)[kThreads / kWarp],
                                            int parity) {
  Octet o;
  compute_octet<S, FULL>(a, tabs, v, keys, at, o);
  const Maxima mx = group_maxima<S>(octet_maxima<S, FULL>(o, at.cnt), xchg, parity);
  store_states<S, FULL>(tabs, v, keys, at, o, mx);
}

// The block's current unit: thread 0 writes its View (and, for the apply pass, the tensor's
// random-stream keys) to shared memory, where every iteration reads the streams' pointers and keys
// when it needs them (a dozen pointers held in registers across the loop would leave too few for
// the octet; keys held there were recomputed -- four splitmix64 chains -- in every iteration).
// Returns the thread's span of the unit.
template <class S>
__device__ __forceinline__ UnitSpan enter_unit(const SpecArgs& a, const Unit& u, View& shared_view,
                                               Keys* shared_keys = nullptr) {
  const SpecTensor& t = a.t[u.tensor];
  __syncthreads();  // every thread is done with the previous unit's view
  if (threadIdx.x == 0) {
    shared_view = view_of<S>(a, t, u);
    if (shared_keys != nullptr) *shared_keys = unit_keys(a, t, shared_view);
  }
  __syncthreads();
  return UnitSpan(t, u, shared_view, threadIdx.x);
}

template <class S>
__device__ __forceinline__ void spec_apply_body(const SpecArgs& a) {
  __shared__ SpecTabs<S> tab_store;
  __shared__ uint32_t xchg[6][kThreads / kWarp];
  __shared__ View view;
  __shared__ Keys keys;
  tab_store.fill(a.tables, threadIdx.x, kThreads);
  __syncthreads();
  const SpecLooks<S> tabs = looks_of(tab_store, a.tables);
  for (int32_t ui = blockIdx.x; ui < a.nunits; ui += gridDim.x) {
    const Unit u = unit_at(a, ui);
    const UnitSpan span = enter_unit<S>(a, u, view, &keys);
    for (int32_t it = 0; it < span.iters; ++it)
      apply_octet<S, true>(a, tabs, view, keys, full_at(span, it, u.rpi), xchg, it & 1);
    if (span.partial) apply_octet<S, false>(a, tabs, view, keys, partial_at(span, u.rpi), xchg, span.iters & 1);
  }
}

// Max over the threads of one row segment (tpr of them: a power of two up to a warp, or whole
// warps), into every lane: the exchanges at distances below the segment (unrolled, so the reduce
// loop holds no inner loop).
__device__ __forceinline__ uint32_t row_max(uint32_t m, int tpr) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const uint32_t x = __shfl_xor_sync(0xffffffffu, m, o);
    m = o < tpr && x > m ? x : m;
  }
  return m;
}

// The reduce pass: the absmax of the new values of the rank-1 states, per row (one atomicMax per
// warp and row) and per column (kept per thread over the unit's rows, one atomicMax per column
// and unit). A rank-1 tensor's rows are whole octets: no partial octet.
template <class S>
__device__ __forceinline__ void spec_reduce_body(const SpecArgs& a) {
  __shared__ SpecTabs<S> tab_store;
  __shared__ View view;
  tab_store.fill(a.tables, threadIdx.x, kThreads);
  __syncthreads();
  const SpecLooks<S> tabs = looks_of(tab_store, a.tables);
  constexpr bool kRank1[2] = {S::St0::kRank1Scale, S::St1::kRank1Scale};
  for (int32_t ui = blockIdx.x; ui < a.nunits; ui += gridDim.x) {
    const Unit u = unit_at(a, ui);
    const UnitSpan span = enter_unit<S>(a, u, view);
    const bool leader = threadIdx.x % (u.tpr < kWarp ? u.tpr : kWarp) == 0;
    uint32_t colmax[2][kElems];
#pragma unroll
    for (int j = 0; j < kElems; ++j) colmax[0][j] = colmax[1][j] = 0u;
    for (int32_t it = 0; it < span.iters; ++it) {
      const At at = full_at(span, it, u.rpi);
      uint32_t bits[2][kElems];
      reduce_octet<S>(a, tabs, view, at, bits);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (!kRank1[k]) continue;
        uint32_t m = 0;
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          const uint32_t b = at.cnt > 0 ? bits[k][j] : 0u;
          m = b > m ? b : m;
          colmax[k][j] = b > colmax[k][j] ? b : colmax[k][j];
        }
        m = row_max(m, u.tpr);
        if (leader && at.cnt > 0 && m != 0u) atomicMax(view.row_partial[k] + at.r, m);
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (!kRank1[k]) continue;
#pragma unroll
      for (int j = 0; j < kElems; ++j)
        if (colmax[k][j] != 0u) atomicMax(view.col_partial[k] + span.pl.c8 + j, colmax[k][j]);
    }
  }
}

// kMinBlocks blocks of kThreads per multiprocessor: at most 64 registers per thread.
constexpr int kMinBlocks = 4;

template <class S>
__global__ void __launch_bounds__(kThreads, kMinBlocks) spec_apply_kernel(const SpecArgs a) {
  spec_apply_body<S>(a);
}

template <class S>
__global__ void __launch_bounds__(kThreads, kMinBlocks) spec_reduce_kernel(const SpecArgs a) {
  if constexpr (S::kTwoPass) spec_reduce_body<S>(a);
}

}  // namespace spec
}  // namespace qconf

// A run-time compiled module's entry points: one spec, fixed names (csrc/cuda/spec_jit.cpp).
#define QCONF_SPEC_KERNELS(SPEC)                                                                      \
  extern "C" __global__ void __launch_bounds__(qconf::spec::kThreads, qconf::spec::kMinBlocks)       \
      qconf_spec_apply(const qconf::spec::SpecArgs a) {                                               \
    qconf::spec::spec_apply_body<SPEC>(a);                                                            \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(qconf::spec::kThreads, qconf::spec::kMinBlocks)       \
      qconf_spec_reduce(const qconf::spec::SpecArgs a) {                                              \
    if constexpr (SPEC::kTwoPass) qconf::spec::spec_reduce_body<SPEC>(a);                             \
  }
