// Host-side planning of the fused CUDA step (csrc/cuda/step.cu): everything between describing
// the tensors (qconf/step_host.h) and the CUDA calls -- the GPU's chunking of every tensor and
// its single-pass / two-pass states, the shared-memory slots, the work-item lists, the scratch
// layout and the one buffer of descriptors, work items and tables that is copied to the device.
// Plain C++ with no CUDA headers, so tests/test_cuda_plan_host.py builds and checks it on a
// machine without a GPU.
//
// A chunk table covers the elements of every tensor of the call; the kernels run one thread
// block per chunk and one octet (8 consecutive elements, i.e. `bits` whole bytes of packed codes)
// per thread and iteration. Chunks start at multiples of 8 and of every single-pass group block,
// so a group and a code byte never straddle two blocks.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "qconf/step_host.h"
#include "qconf/step_types.h"

namespace qconf {
namespace gpu {

constexpr int kThreads = 256;           // threads per block of every kernel
constexpr int64_t kChunkTarget = 2048;  // elements per block: one octet per thread
constexpr int kSlotBudget = 8192;       // shared absmax slots per block (32 KB)
constexpr int kFactorRowsPerBlock = kThreads / 16;  // one half-warp per row

// ---------------------------------------------------------------------------------------------
// descriptors (host-built, read by the kernels)

// Scale index of element e for one term: (e / div) % mod + off. A block/dim1 layout has one term;
// rank1 one per dimension (leading dims first, the last dim last). The kernels use the terms to
// index their shared-memory absmax slots; the scale values themselves are read through the
// shared walker (qconf/scale_walk.h).
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
// one tensor

// Scale-index terms of a quantized state (see Term).
inline void make_terms(const TensorDesc& t, const StateDesc& st, GpuState& g) {
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

// The states the CPU rules single-pass (kBlock, blocks within a tile) start single-pass on the
// GPU too; every quantized state gets its terms.
inline void init_states(GpuTensor& G) {
  TensorDesc& t = G.d;
  for (int k = 0; k < 2; ++k) {
    StateDesc& st = t.st[k];
    G.gs[k].single = st.kind == kQuant && !st.two_pass;
    if (st.kind == kQuant) make_terms(t, st, G.gs[k]);
  }
}

// The chunk length: whole groups of every single-pass state and whole bytes of codes. A state
// whose groups would need more shared slots per block than the budget is reduced in two passes
// instead (same results: the scale is the absmax of the group either way).
inline int64_t choose_chunk(GpuTensor& G) {
  TensorDesc& t = G.d;
  for (;;) {
    int64_t unit = 8;
    for (int k = 0; k < 2; ++k)
      if (G.gs[k].single) unit = host::lcm64(unit, t.st[k].codec.block);
    int64_t chunk = unit >= kChunkTarget ? unit : (kChunkTarget / unit) * unit;
    if (chunk >= t.numel) chunk = t.numel;
    int64_t slots[2] = {0, 0};
    for (int k = 0; k < 2; ++k)
      if (G.gs[k].single) slots[k] = (chunk + t.st[k].codec.block - 1) / t.st[k].codec.block;
    if (slots[0] + slots[1] <= kSlotBudget) {
      G.gs[0].apply_slot = 0;
      G.gs[1].apply_slot = static_cast<int32_t>(slots[0]);
      G.apply_slots = static_cast<int32_t>(slots[0] + slots[1]);
      return chunk;
    }
    const int worst = slots[0] >= slots[1] ? 0 : 1;
    G.gs[worst].single = 0;
    t.st[worst].two_pass = 1;
  }
}

// Two-pass states: reduced in the reduce pass, into shared slots per term while the budget lasts
// (then by atomics on the device partials).
inline void assign_reduce_slots(GpuTensor& G, int64_t chunk) {
  TensorDesc& t = G.d;
  t.two_pass = 0;
  int32_t used = 0;
  for (int k = 0; k < 2; ++k) {
    GpuState& g = G.gs[k];
    g.load_reduce = t.st[k].kind == kQuant && !g.single;
    t.st[k].two_pass = g.load_reduce;
    if (!g.load_reduce) continue;
    t.two_pass = 1;
    for (int d = 0; d < g.nterms; ++d) {
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
}

// The GPU's chunk length of a (non-empty) tensor, its single-pass states and shared slots.
inline int64_t plan_tensor(GpuTensor& G) {
  init_states(G);
  const int64_t chunk = choose_chunk(G);
  assign_reduce_slots(G, chunk);
  return chunk;
}

// ---------------------------------------------------------------------------------------------
// the call

// Scratch of a call, one device allocation of floats: [partials (zeroed, as uint32 absmax bits)
// | column partials (zeroed) | reciprocals | new scales | row sums | row factors]. Offsets in floats.
struct ScratchLayout {
  int64_t n_partial = 0, n_colp = 0, n_rows = 0;
  int64_t partial() const { return 0; }
  int64_t colp() const { return n_partial; }
  int64_t zeroed() const { return n_partial + n_colp; }  // floats to zero before the passes
  int64_t recip() const { return zeroed(); }
  int64_t new_scale() const { return recip() + n_partial; }
  int64_t row_sum() const { return new_scale() + n_partial; }
  int64_t row_factor() const { return row_sum() + n_rows; }
  int64_t total() const { return row_factor() + n_rows; }
};

struct Plan {
  std::vector<GpuTensor> tensors;
  std::vector<WorkItem> items;  // every chunk of every tensor; those of two-pass tensors first
  size_t n_reduce = 0;          // items[0, n_reduce): the reduce pass
  std::vector<FactorItem> row_items, col_items, stat_items, rf_items;  // factored second moments
  std::vector<CopyItem> copies;  // new scales of two-pass states, once every chunk is done (assign_scratch)
  int reduce_slots = 0, apply_slots = 0;  // shared slots per block of the two passes
  ScratchLayout scratch;
};

// The generic kernel has no quantized Kahan buffer; the driver refuses a call that would hand it
// one before anything runs (cuda_step.cu: check_generic_supported), so this only asserts.
inline void check_supported(const std::vector<TensorDesc>& descs) {
  for (const TensorDesc& t : descs)
    TORCH_INTERNAL_ASSERT(t.comp.kind != kQuant, "qconf: a quantized Kahan buffer reached the generic CUDA kernel");
}

// The factor pass's work of factored tensor i: row sums (kFactorRowsPerBlock rows per block),
// column sums (per fixed row chunk, kThreads columns per block), the statistics (rows, then
// columns) and the row factors (kThreads entries per block).
inline void plan_factored(Plan& plan, int32_t i) {
  GpuTensor& G = plan.tensors[i];
  TensorDesc& t = G.d;
  G.R = t.shape[t.ndim - 2];
  G.batches = t.rows / G.R;
  G.chunks = host::factor_chunks(t);
  plan.scratch.n_colp += G.chunks * G.batches * t.cols;
  plan.scratch.n_rows += t.rows;
  for (int64_t r = 0; r < t.rows; r += kFactorRowsPerBlock) plan.row_items.push_back({i, 0, r, 0});
  for (int64_t c = 0; c < G.chunks; ++c)
    for (int64_t j = 0; j < t.cols; j += kThreads) plan.col_items.push_back({i, 0, c, j});
  for (int64_t r = 0; r < t.rows; r += kThreads) plan.stat_items.push_back({i, 0, r, 0});
  for (int64_t j = 0; j < G.batches * t.cols; j += kThreads) plan.stat_items.push_back({i, 1, j, 0});
  for (int64_t b = 0; b < G.batches; b += kThreads) plan.rf_items.push_back({i, 0, b, 0});
}

// Plans a call from the tensors' descriptions (scratch pointers: assign_scratch).
inline Plan plan_call(const std::vector<TensorDesc>& descs) {
  Plan plan;
  const int64_t T = static_cast<int64_t>(descs.size());
  plan.tensors.resize(T);
  std::vector<WorkItem> one_items;  // chunks of the tensors without two-pass states
  for (int64_t i = 0; i < T; ++i) {
    GpuTensor& G = plan.tensors[i];
    G.d = descs[i];
    TensorDesc& t = G.d;
    if (t.numel == 0) continue;
    const int64_t chunk = plan_tensor(G);
    if (t.two_pass) plan.reduce_slots = std::max(plan.reduce_slots, G.reduce_slots);
    plan.apply_slots = std::max(plan.apply_slots, G.apply_slots);
    std::vector<WorkItem>& dst = t.two_pass ? plan.items : one_items;
    for (int64_t s = 0; s < t.numel; s += chunk)
      dst.push_back({static_cast<int32_t>(i), s, std::min(chunk, t.numel - s)});
    for (auto& st : t.st)
      if (st.kind == kQuant && st.two_pass) plan.scratch.n_partial += st.num_scales;
    if (t.factored) plan_factored(plan, static_cast<int32_t>(i));
  }
  plan.n_reduce = plan.items.size();
  plan.items.insert(plan.items.end(), one_items.begin(), one_items.end());
  return plan;
}

// Points the states and factored tensors at their parts of the scratch at `base` (device
// memory, plan.scratch.total() floats) and lists the copies of the new scales of two-pass states.
inline void assign_scratch(Plan& plan, float* base) {
  const ScratchLayout& L = plan.scratch;
  uint32_t* partial_all = reinterpret_cast<uint32_t*>(base + L.partial());
  int64_t po = 0, co = 0, ro = 0;
  plan.copies.clear();
  for (auto& G : plan.tensors) {
    TensorDesc& t = G.d;
    if (t.numel == 0) continue;
    for (auto& st : t.st) {
      if (st.kind != kQuant || !st.two_pass) continue;
      st.partial = partial_all + po;
      st.new_recip = base + L.recip() + po;
      plan.copies.push_back({st.scales, base + L.new_scale() + po, st.num_scales});
      po += st.num_scales;
    }
    if (t.factored) {
      t.col_partial = base + L.colp() + co;
      co += G.chunks * G.batches * t.cols;
      t.row_sum = base + L.row_sum() + ro;
      t.row_factor = base + L.row_factor() + ro;
      ro += t.rows;
    }
  }
}

// Re-points the codec tables of every quantized state (the Kahan buffer's too) from the tables
// at `old_base` to their copy at `new_base` (inside the device buffer).
inline void rebase_plan_tables(Plan& plan, const float* old_base, const float* new_base) {
  for (auto& G : plan.tensors) rebase_tables(G.d, old_base, new_base);
}

// ---------------------------------------------------------------------------------------------
// the buffer copied to the device: descriptors, work items, factor items, copy items and (if
// they are on the host) the tables, each at a 16-byte aligned byte offset

struct BufferLayout {
  size_t tensors = 0, items = 0, rows = 0, cols = 0, stats = 0, rf = 0, copies = 0, tables = 0, size = 0;
};

inline size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// `table_bytes`: 0 when the tables are already on the device
inline BufferLayout buffer_layout(const Plan& plan, size_t table_bytes) {
  BufferLayout L;
  size_t end = 0;
  auto place = [&end](size_t bytes) {
    const size_t off = align16(end);
    end = off + bytes;
    return off;
  };
  L.tensors = place(sizeof(GpuTensor) * plan.tensors.size());
  L.items = place(sizeof(WorkItem) * plan.items.size());
  L.rows = place(sizeof(FactorItem) * plan.row_items.size());
  L.cols = place(sizeof(FactorItem) * plan.col_items.size());
  L.stats = place(sizeof(FactorItem) * plan.stat_items.size());
  L.rf = place(sizeof(FactorItem) * plan.rf_items.size());
  L.copies = place(sizeof(CopyItem) * plan.copies.size());
  L.tables = table_bytes > 0 ? place(table_bytes) : 0;
  L.size = end;
  return L;
}

// Writes the buffer (L.size bytes) to `dst`; `tables`: the host tables (L's table_bytes), or null.
inline void pack_buffer(const Plan& plan, const BufferLayout& L, const float* tables, size_t table_bytes,
                        uint8_t* dst) {
  auto put = [dst](size_t off, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(dst + off, src, bytes);
  };
  put(L.tensors, plan.tensors.data(), sizeof(GpuTensor) * plan.tensors.size());
  put(L.items, plan.items.data(), sizeof(WorkItem) * plan.items.size());
  put(L.rows, plan.row_items.data(), sizeof(FactorItem) * plan.row_items.size());
  put(L.cols, plan.col_items.data(), sizeof(FactorItem) * plan.col_items.size());
  put(L.stats, plan.stat_items.data(), sizeof(FactorItem) * plan.stat_items.size());
  put(L.rf, plan.rf_items.data(), sizeof(FactorItem) * plan.rf_items.size());
  put(L.copies, plan.copies.data(), sizeof(CopyItem) * plan.copies.size());
  if (tables != nullptr) put(L.tables, tables, table_bytes);
}

}  // namespace gpu
}  // namespace qconf
