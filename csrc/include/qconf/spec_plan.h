// Host-side planning of the specialized CUDA step (spec.h): which tensors of a call take a
// specialized kernel and which the generic one (spec_key.h), the launches (tensors of one spec,
// one set of codec tables and one step, at most kLaunchTensors each), every tensor's geometry
// (tile rows and columns, units), the rank-1 scratch and the scale copies. Plain C++ without CUDA
// headers: the CUDA driver (csrc/cuda/spec_step.cu) builds a plan once per parameter set and, on
// every later step, only refreshes the gradients and scalars in it (refresh_plan); the host tests
// (tests/test_spec_host.py) check the plans and run them through the host model of the kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "qconf/spec.h"
#include "qconf/spec_key.h"
#include "qconf/step_types.h"

namespace qconf {
namespace spec {

constexpr int32_t kUnitIters = 16;  // block iterations per unit (32K elements of a kStrip tensor)

// The rows + cols entries of one rank-1 state in the scratch.
struct Rank1Range {
  int64_t first, n;
};

// One launch: its spec, its codec tables (indices into the call's tables, -1 where a state is not
// quantized) and kernel parameters, the call indices of its tensors, and whether it has a reduce
// pass (rank-1 states).
struct Launch {
  SpecKey key;
  int32_t table[3] = {-1, -1, -1};
  SpecArgs args;
  std::vector<int32_t> tensors;
  bool two_pass = false;
  std::vector<Rank1Range> rank1;  // its rank-1 states' entries in the scratch (the finalize's work)
};

// A rank-1 state's new scales, copied over its stored ones once the apply pass is done.
struct ScaleCopy {
  float* dst;
  int64_t src;  // offset in the scale region of the scratch
  int64_t n;
};

// A call's plan. Scratch (device memory, `scratch_floats` floats): [partials | recips | scales],
// rank1_entries each; the partials are in the CPU split step's order of maxima (tensors in order,
// state 0 then state 1), rank1_offset says where each state's start.
struct SpecPlan {
  std::vector<Launch> launches;
  std::vector<int32_t> generic;      // call indices the generic kernel takes
  std::vector<std::string> reasons;  // per call index: "" if specialized, else why not
  int64_t rank1_entries = 0;
  std::vector<ScaleCopy> copies;
  std::vector<int64_t> rank1_offset;  // [T * 2]: tensor i's state k in the partials, -1 if none
  int64_t scratch_floats() const { return 3 * rank1_entries; }
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Why tensor t's own buffers (parameter, states, Kahan buffer) are not where the vector loads of
// the specialized kernels can read them ("" if they are); gradients are checked per call.
inline std::string buffers_unaligned(const TensorDesc& t) {
  if (!aligned16(t.param)) return "a parameter not 16-byte aligned";
  for (const StateDesc* st : {&t.st[0], &t.st[1], &t.comp}) {
    const void* data = st->kind == kFp32 ? static_cast<const void*>(st->values)
                       : st->kind == kParamDtype ? static_cast<const void*>(st->values16)
                                                 : static_cast<const void*>(st->codes);
    if (st->kind != kNone && !aligned16(data)) return "a state not 16-byte aligned";
  }
  return "";
}

// The tile and units of tensor t (its SpecTensor's numel, rows, cols, unit_rows, units).
inline void plan_geometry(const TensorDesc& t, const SpecKey& key, SpecTensor& g) {
  const bool rank1 = key.st[0].scale == kRank1 && key.st[0].kind == kQuant;
  const bool rank1b = key.st[1].scale == kRank1 && key.st[1].kind == kQuant;
  g.numel = t.numel;
  g.cols = static_cast<int32_t>(rank1 || rank1b ? t.shape[1] : kStrip);
  g.rows = rank1 || rank1b ? t.shape[0] : (t.numel + kStrip - 1) / kStrip;
  const int32_t width = g.cols < kStrip ? g.cols : kStrip;
  const int64_t rpi = kStrip / width;  // rows per iteration of the first strip
  int64_t unit_rows = std::min<int64_t>(kUnitIters * rpi, g.rows);
  unit_rows = std::min<int64_t>(unit_rows, (int64_t{1} << 31) / g.cols - 1);  // offsets stay 32-bit
  g.unit_rows = static_cast<int32_t>(std::max<int64_t>(unit_rows, 1));
  g.units = static_cast<int32_t>(strips_of(g.cols) * ((g.rows + g.unit_rows - 1) / g.unit_rows));
}

// Whether tensor i can join launch L: same spec, tables and step, room left, and for a two-pass
// spec the gradients of the launch still within `l2_budget` bytes (its reduce pass then leaves
// them in L2 for the apply pass) -- or every tensor of the launch over the budget on its own.
inline bool joins(const Launch& L, const SpecKey& key, const int32_t* table, const TensorDesc& t,
                  const std::vector<TensorDesc>& descs, int64_t l2_budget) {
  if (L.key != key || L.args.ntensors >= kLaunchTensors || L.args.step != t.step ||
      std::memcmp(&L.args.h, &t.h, sizeof(Scalars)) != 0)
    return false;
  for (int k = 0; k < 3; ++k)
    if (L.table[k] != table[k]) return false;
  if (!L.two_pass) return true;
  const auto bytes = [](const TensorDesc& d) { return d.numel * (d.gdtype == kF32 ? 4 : 2); };
  int64_t sum = bytes(t);
  bool all_big = bytes(t) > l2_budget;
  for (int32_t i : L.tensors) {
    sum += bytes(descs[i]);
    all_big = all_big && bytes(descs[i]) > l2_budget;
  }
  return sum <= l2_budget || all_big;
}

// The kernel descriptor of tensor t (its buffers and geometry; the gradient is refreshed per call).
inline SpecTensor tensor_args(const TensorDesc& t, const SpecKey& key) {
  SpecTensor g;
  plan_geometry(t, key, g);
  g.param = t.param;
  g.grad = t.grad;
  const StateDesc* sts[3] = {&t.st[0], &t.st[1], &t.comp};
  for (int k = 0; k < 3; ++k) {
    const StateDesc& st = *sts[k];
    g.data[k] = st.kind == kFp32 ? static_cast<void*>(st.values)
                : st.kind == kParamDtype ? static_cast<void*>(st.values16)
                                         : static_cast<void*>(st.codes);
    g.scales[k] = st.kind == kQuant ? st.scales : nullptr;
  }
  g.index = t.index;
  g.rng_offset = t.pkey.offset;
  return g;
}

// The codecs of a launch: each quantized state's table (`tab_device` + its index) and scalars
// (read from the host copy `tab_host`).
inline SpecTables launch_tables(const TensorDesc& t, const int32_t* table, const float* tab_host,
                                const float* tab_device) {
  SpecTables out;
  const StateDesc* sts[3] = {&t.st[0], &t.st[1], &t.comp};
  for (int k = 0; k < 3; ++k) {
    if (table[k] < 0) continue;
    const int64_t at = static_cast<int64_t>(table[k]) * kTableRows * kTableSize;
    describe_codec(tab_host + at, sts[k]->codec.levels, out.c[k]);
    out.c[k].table = tab_device + at;
  }
  return out;
}

// The launch tensor i of the call joins (a new one if none can take it).
inline Launch& launch_for(SpecPlan& plan, const SpecKey& key, const int32_t* table, const std::vector<TensorDesc>& descs,
                          int32_t i, const float* tab_host, const float* tab_device, int64_t l2_budget) {
  for (Launch& L : plan.launches)
    if (joins(L, key, table, descs[i], descs, l2_budget)) return L;
  plan.launches.emplace_back();
  Launch& L = plan.launches.back();
  L.key = key;
  std::copy(table, table + 3, L.table);
  L.two_pass = (key.st[0].kind == kQuant && key.st[0].scale == kRank1) ||
               (key.st[1].kind == kQuant && key.st[1].scale == kRank1);
  L.args.tables = launch_tables(descs[i], table, tab_host, tab_device);
  L.args.h = descs[i].h;
  L.args.step = descs[i].step;
  return L;
}

// The rank-1 scratch, in tensor order then state 0 and 1 (the CPU split step's order of maxima),
// each launch's ranges, and the copies of the new scales.
inline void plan_rank1(SpecPlan& plan, const std::vector<TensorDesc>& descs) {
  std::vector<std::pair<int32_t, int32_t>> where(descs.size(), {-1, -1});  // launch, slot
  for (int32_t l = 0; l < static_cast<int32_t>(plan.launches.size()); ++l)
    for (int32_t j = 0; j < plan.launches[l].args.ntensors; ++j) where[plan.launches[l].tensors[j]] = {l, j};
  int64_t at = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    if (where[i].first < 0) continue;
    Launch& L = plan.launches[where[i].first];
    SpecTensor& g = L.args.t[where[i].second];
    for (int k = 0; k < 2; ++k) {
      if (!(L.key.st[k].kind == kQuant && L.key.st[k].scale == kRank1)) continue;
      const int64_t n = g.rows + g.cols;
      g.rank1_at[k] = static_cast<int32_t>(at);
      plan.rank1_offset[2 * i + k] = at;
      plan.copies.push_back({descs[i].st[k].scales, at, n});
      L.rank1.push_back({at, n});
      at += n;
    }
  }
  plan.rank1_entries = at;
}

// Plans a call from the tensors' descriptions: tab_host / tab_device are the codec tables' host
// copy and the device copy the kernels read; l2_budget the gradient bytes a two-pass launch keeps
// within (half the GPU's L2); `excluded`: specs whose kernels are unavailable (their tensors take
// the generic kernel). Scratch pointers: assign_scratch.
inline SpecPlan plan_specs(int32_t rule, const std::vector<TensorDesc>& descs, const float* tab_host,
                           const float* tab_device, int64_t l2_budget, const std::vector<SpecKey>& excluded = {}) {
  SpecPlan plan;
  const int32_t T = static_cast<int32_t>(descs.size());
  plan.reasons.assign(T, "");
  plan.rank1_offset.assign(2 * static_cast<size_t>(T), -1);
  for (int32_t i = 0; i < T; ++i) {
    const TensorDesc& t = descs[i];
    SpecKey key;
    std::string why = spec_key(rule, t, key);
    if (why.empty()) why = buffers_unaligned(t);
    if (why.empty() && std::find(excluded.begin(), excluded.end(), key) != excluded.end())
      why = "its spec's kernel (" + spec_name(key) + ") did not compile";
    if (!why.empty()) {
      plan.reasons[i] = why;
      plan.generic.push_back(i);
      continue;
    }
    int32_t table[3] = {-1, -1, -1};
    const StateDesc* sts[3] = {&t.st[0], &t.st[1], &t.comp};
    for (int k = 0; k < 3; ++k)
      if (sts[k]->kind == kQuant)
        table[k] = static_cast<int32_t>((sts[k]->codec.base - tab_host) / (kTableRows * kTableSize));
    Launch& L = launch_for(plan, key, table, descs, i, tab_host, tab_device, l2_budget);
    L.args.t[L.args.ntensors] = tensor_args(t, key);
    L.args.nunits += L.args.t[L.args.ntensors].units;
    ++L.args.ntensors;
    L.tensors.push_back(i);
  }
  plan_rank1(plan, descs);
  return plan;
}

// Points the launches at the scratch (device memory, plan.scratch_floats() floats).
inline void assign_scratch(SpecPlan& plan, float* scratch) {
  for (Launch& L : plan.launches) {
    L.args.partial = reinterpret_cast<uint32_t*>(scratch);
    L.args.recip = scratch + plan.rank1_entries;
  }
}

// This call's gradients, scalars and seed in an unchanged plan: false if the plan no longer fits
// (a launch's tensors no longer share one step), so the caller plans again. The gradients must be
// 16-byte aligned (the driver copies one that is not).
inline bool refresh_plan(SpecPlan& plan, const std::vector<TensorDesc>& descs, uint64_t seed) {
  for (Launch& L : plan.launches) {
    const TensorDesc& first = descs[L.tensors[0]];
    for (size_t j = 0; j < L.tensors.size(); ++j) {
      const TensorDesc& t = descs[L.tensors[j]];
      if (t.step != first.step || std::memcmp(&t.h, &first.h, sizeof(Scalars)) != 0) return false;
      L.args.t[j].grad = t.grad;
    }
    L.args.h = first.h;
    L.args.step = first.step;
    L.args.seed = seed;
  }
  return true;
}

// What a plan depends on besides gradients and scalar values: every buffer, shape, dtype, codec
// (and table) and flag of every tensor, and which tensors share a step. A plan stays valid while
// the signature of the call's descriptions is unchanged.
inline std::vector<uint64_t> plan_signature(int32_t rule, const std::vector<TensorDesc>& descs, const float* tab_host) {
  std::vector<uint64_t> s;
  s.reserve(descs.size() * 48 + 2);
  s.push_back(static_cast<uint64_t>(rule));
  s.push_back(descs.size());
  const auto word = [&s](const void* p) { s.push_back(reinterpret_cast<uintptr_t>(p)); };
  for (const TensorDesc& t : descs) {
    s.insert(s.end(), {t.index, t.step - descs[0].step, static_cast<uint64_t>(t.numel), static_cast<uint64_t>(t.ndim),
                       static_cast<uint64_t>(t.pdtype), static_cast<uint64_t>(t.gdtype),
                       static_cast<uint64_t>(t.factored), static_cast<uint64_t>(t.w_stochastic),
                       static_cast<uint64_t>(t.w_kahan), static_cast<uint64_t>(rule_flags(t.h)),
                       static_cast<uint64_t>(t.h.first), t.pkey.offset});
    for (int d = 0; d < t.ndim; ++d) s.push_back(static_cast<uint64_t>(t.shape[d]));
    word(t.param);
    for (const StateDesc* st : {&t.st[0], &t.st[1], &t.comp}) {
      const CodecDesc& c = st->codec;
      s.insert(s.end(), {static_cast<uint64_t>(st->kind), static_cast<uint64_t>(c.bits), static_cast<uint64_t>(c.levels),
                         static_cast<uint64_t>(c.scale_kind), static_cast<uint64_t>(c.block),
                         static_cast<uint64_t>(c.stochastic)});
      word(st->values);
      word(st->values16);
      word(st->codes);
      word(st->scales);
      s.push_back(st->kind == kQuant ? static_cast<uint64_t>(c.base - tab_host) : 0);
    }
  }
  return s;
}

}  // namespace spec
}  // namespace qconf
