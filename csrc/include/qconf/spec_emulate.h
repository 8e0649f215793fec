// A host model of the specialized CUDA kernels (spec_kernel.cuh) for the tests: the same
// per-thread code (spec_octet.h) run for each of a block's kThreads threads in turn, with the
// exchanges between threads done as the device does them -- a group's maximum over its aligned
// threads before any of them stores, a row's maximum and each column's over the unit's threads --
// and the finalize and scale-copy kernels of the driver. The units run one after another; as on
// the GPU, no unit reads what another writes. tests/test_spec_host.py runs whole steps through it
// and compares them bit for bit with the CPU kernel.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "qconf/spec_octet.h"
#include "qconf/spec_plan.h"

namespace qconf {
namespace spec {
namespace emulate {

// Each state's group maxima over the aligned runs of its kGroupThreads threads (spec_kernel.cuh
// group_maxima: warp shuffles, then shared memory across warps).
template <class S>
void group_maxima(std::vector<Maxima>& mx) {
  const int tpg[3] = {S::St0::kGroupThreads, S::St1::kGroupThreads, S::Comp::kGroupThreads};
  for (int k = 0; k < 3; ++k) {
    if (tpg[k] < 1) continue;
    for (int g = 0; g < kThreads; g += tpg[k]) {
      uint32_t m = 0;
      for (int i = g; i < g + tpg[k]; ++i) m = mx[i].m[k] > m ? mx[i].m[k] : m;
      for (int i = g; i < g + tpg[k]; ++i) mx[i].m[k] = m;
    }
  }
}

// On the GPU every lane of a warp executes each warp shuffle (Lanes16: __shfl_sync over the whole
// warp); `shuffles` holds what each thread of the block did in one phase, which must be the same
// for the 32 lanes of each warp (a lane that skips a lookup its neighbours make reads garbage).
inline void expect_converged(const std::vector<uint64_t>& shuffles, const char* phase) {
  for (int w = 0; w < kThreads; w += kWarp)
    for (int i = w + 1; i < w + kWarp; ++i)
      if (shuffles[i] != shuffles[w])
        throw std::runtime_error(std::string("spec kernels: in the ") + phase + " of an octet, lane " +
                                 std::to_string(i - w) + " of warp " + std::to_string(w / kWarp) + " made " +
                                 std::to_string(shuffles[i]) + " warp shuffles and lane 0 made " +
                                 std::to_string(shuffles[w]) + " (divergent lanes in a whole-warp shuffle)");
}

// The warp shuffles that fn() models (host_shuffles), for expect_converged.
template <class Fn>
uint64_t shuffles_of(Fn&& fn) {
  const uint64_t before = host_shuffles();
  fn();
  return host_shuffles() - before;
}

// Each of a block's threads' span of unit u (spec_octet.h UnitSpan).
inline std::vector<UnitSpan> block_spans(const SpecTensor& t, const Unit& u, const View& v) {
  std::vector<UnitSpan> span;
  span.reserve(kThreads);
  for (int i = 0; i < kThreads; ++i) span.emplace_back(t, u, v, i);
  return span;
}

// One block iteration of the apply pass: every thread's octet computed, the groups' maxima, then
// every thread's stores (each phase's warp shuffles checked for convergence).
template <class S, bool FULL>
void apply_iteration(const SpecArgs& a, const SpecLooks<S>& tabs, const View& v, const Keys& keys,
                     const std::vector<At>& at) {
  std::vector<Octet> o(kThreads);
  std::vector<Maxima> mx(kThreads);
  std::vector<uint64_t> shuffles(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    shuffles[i] = shuffles_of([&] { compute_octet<S, FULL>(a, tabs, v, keys, at[i], o[i]); });
    mx[i] = octet_maxima<S, FULL>(o[i], at[i].cnt);
  }
  expect_converged(shuffles, "loads and update");
  group_maxima<S>(mx);
  for (int i = 0; i < kThreads; ++i)
    shuffles[i] = shuffles_of([&] { store_states<S, FULL>(tabs, v, keys, at[i], o[i], mx[i]); });
  expect_converged(shuffles, "quantize and stores");
}

template <class S>
void apply(const SpecArgs& a) {
  SpecTabs<S> store;
  store.fill(a.tables, 0, 1);
  const SpecLooks<S> tabs = looks_of(store, a.tables);
  for (int32_t ui = 0; ui < a.nunits; ++ui) {
    const Unit u = unit_at(a, ui);
    const SpecTensor& t = a.t[u.tensor];
    const View v = view_of<S>(a, t, u);
    const Keys keys = unit_keys(a, t, v);
    const std::vector<UnitSpan> span = block_spans(t, u, v);
    std::vector<At> at(kThreads);
    for (int32_t it = 0; it < span[0].iters; ++it) {
      for (int i = 0; i < kThreads; ++i) at[i] = full_at(span[i], it, u.rpi);
      apply_iteration<S, true>(a, tabs, v, keys, at);
    }
    if (span[0].partial) {
      for (int i = 0; i < kThreads; ++i) at[i] = partial_at(span[i], u.rpi);
      apply_iteration<S, false>(a, tabs, v, keys, at);
    }
  }
}

// The reduce pass: the rank-1 states' row and column maxima (spec_kernel.cuh spec_reduce_body).
// Every thread runs every iteration, as on the GPU (a thread without elements reads the unit's
// first octet and folds nothing), so that the iteration's warp shuffles can be checked.
template <class S>
void reduce(const SpecArgs& a) {
  SpecTabs<S> store;
  store.fill(a.tables, 0, 1);
  const SpecLooks<S> tabs = looks_of(store, a.tables);
  const bool rank1[2] = {S::St0::kRank1Scale, S::St1::kRank1Scale};
  std::vector<uint64_t> shuffles(kThreads);
  for (int32_t ui = 0; ui < a.nunits; ++ui) {
    const Unit u = unit_at(a, ui);
    const SpecTensor& t = a.t[u.tensor];
    const View v = view_of<S>(a, t, u);
    const std::vector<UnitSpan> span = block_spans(t, u, v);
    for (int32_t it = 0; it < span[0].iters; ++it) {
      for (int i = 0; i < kThreads; ++i) {
        const At at = full_at(span[i], it, u.rpi);
        uint32_t bits[2][kElems];
        shuffles[i] = shuffles_of([&] { reduce_octet<S>(a, tabs, v, at, bits); });
        if (at.cnt == 0) continue;
        for (int k = 0; k < 2; ++k) {
          if (!rank1[k]) continue;
          for (int j = 0; j < kElems; ++j) {
            uint32_t& row = v.row_partial[k][at.r];
            uint32_t& col = v.col_partial[k][at.c8 + j];
            row = bits[k][j] > row ? bits[k][j] : row;
            col = bits[k][j] > col ? bits[k][j] : col;
          }
        }
      }
      expect_converged(shuffles, "reduce pass");
    }
  }
}

// The finalize kernel: entries [first, first + n) of the scratch's rank-1 partials to
// reciprocals and scales (element.h finalize_scale_bits).
inline void finalize(const SpecPlan& plan, float* scratch, int64_t first, int64_t n) {
  const uint32_t* partial = reinterpret_cast<const uint32_t*>(scratch);
  for (int64_t j = first; j < first + n; ++j)
    finalize_scale_bits(partial[j], j, scratch + plan.rank1_entries, scratch + 2 * plan.rank1_entries);
}

// The copies of the new rank-1 scales over the stored ones.
inline void copy_scales(const SpecPlan& plan, const float* scratch) {
  for (const ScaleCopy& c : plan.copies)
    for (int64_t j = 0; j < c.n; ++j) c.dst[j] = scratch[2 * plan.rank1_entries + c.src + j];
}

// A whole planned step, in the driver's order (csrc/cuda/spec_step.cu): per launch its reduce
// pass and finalize, then its apply pass; the scale copies last. `kernels(name)` gives the
// emulated reduce and apply of a spec (the test instantiates them); `scratch`: the plan's
// scratch_floats(), assigned to the plan.
struct Kernels {
  void (*reduce)(const SpecArgs&);
  void (*apply)(const SpecArgs&);
};

template <class Lookup>
void run_plan(const SpecPlan& plan, float* scratch, const Lookup& kernels) {
  for (int64_t j = 0; j < plan.rank1_entries; ++j) scratch[j] = 0.0f;  // partials: absmax bits 0
  for (const Launch& L : plan.launches) {
    const Kernels k = kernels(spec_name(L.key));
    if (L.two_pass) {
      k.reduce(L.args);
      for (const Rank1Range& r : L.rank1) finalize(plan, scratch, r.first, r.n);
    }
    k.apply(L.args);
  }
  copy_scales(plan, scratch);
}

}  // namespace emulate
}  // namespace spec
}  // namespace qconf
