// Driver of the fused CPU optimizer step: validates the arguments, builds one TensorDesc per
// parameter (codecs, scalars, RNG keys), splits all tensors of the call into tiles and runs
//
//   [factor pass]   row/column sums of g^2 for factored second moments, then the statistics update
//   [reduce pass]   new absmax of states whose scales need the whole tensor (tensor/dim1/rank1)
//   apply pass      dequantize -> rule -> quantize -> store, every tile independently
//
// each as one at::parallel_for over the work items of *all* tensors (multi-tensor). The ISA
// (AVX-512 with or without VBMI / AVX2 / scalar) is chosen per call; all give identical results.
//
// The same step also runs as two calls (fused_step_cpu_reduce, then fused_step_cpu_apply) so that
// the new absmax of every two-pass scale can be combined across ranks in between (FSDP): reduce
// runs the reduce pass over all tensors at once and returns the maxima; apply turns the (possibly
// larger) maxima into scales exactly as a plain step does and runs the apply pass.
#include "qconf/step_driver.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "qconf/factored.h"
#include "qconf/isa.h"
#include "qconf/parallel.h"
#include "qconf/step_host.h"
#include "qconf/step_types.h"

namespace qconf {
namespace {

// tile sizes, Scalars, codec parsing: shared with the CUDA driver (qconf/step_host.h)
using host::factor_chunks;
constexpr int64_t kCacheBatchBytes = 8 << 20;  // gradient bytes of two-pass tensors per batch

// The work items of tensor i: its tiles.
void append_tiles(const std::vector<TensorDesc>& descs, int64_t i, std::vector<WorkItem>& out) {
  const TensorDesc& t = descs[i];
  for (int64_t s = 0; s < t.numel; s += t.tile)
    out.push_back({static_cast<int32_t>(i), s, std::min(t.tile, t.numel - s)});
}

RunItemsFn isa_function() {
  switch (selected_isa()) {
#ifndef QCONF_NO_AVX512  // (detect_isa never gives them then)
    case Isa::avx512vbmi: return &isa_avx512vbmi::run_items;
    case Isa::avx512: return &isa_avx512::run_items;
#endif
    case Isa::avx2: return &isa_avx2::run_items;
    default: return &isa_scalar::run_items;
  }
}

void run_phase(RunItemsFn fn, const StepContext& ctx, const std::vector<WorkItem>& items, int32_t phase) {
  if (items.empty()) return;
  parallel_chunks(static_cast<int64_t>(items.size()), [&](int64_t begin, int64_t end, int32_t tid) {
    fn(ctx, items.data(), begin, end, phase, tid);
  });
}

// Floats of factored scratch: row sums, row factors, per row chunk column sums [batch][C].
int64_t factored_scratch(const TensorDesc& t) {
  return 2 * t.rows + factor_chunks(t) * (t.rows / t.shape[t.ndim - 2]) * t.cols;
}

// Scratch of the call: two-pass partial maxima (per thread) and new reciprocals + scales;
// factored sums. Sized first, then carved out of two flat buffers that a StepPlan keeps between
// steps.
void assign_scratch(CpuWorkspace& ws, std::vector<TensorDesc>& descs, int nthreads) {
  size_t need_f = 0, need_u = 0;
  for (auto& t : descs) {
    if (t.numel == 0) continue;
    for (auto& st : t.st) {
      if (st.kind != kQuant || !st.two_pass) continue;
      need_u += static_cast<size_t>(nthreads) * st.num_scales;
      need_f += static_cast<size_t>(2 * st.num_scales);
    }
    if (t.factored) need_f += static_cast<size_t>(factored_scratch(t));
  }
  ws.scratch_f.assign(need_f, 0.0f);
  ws.scratch_u.assign(need_u, 0u);
  float* next_f = ws.scratch_f.data();
  uint32_t* next_u = ws.scratch_u.data();
  for (auto& t : descs) {
    if (t.numel == 0) continue;
    for (auto& st : t.st) {
      if (st.kind != kQuant || !st.two_pass) continue;
      st.partial = next_u;
      next_u += static_cast<size_t>(nthreads) * st.num_scales;
      st.new_recip = next_f;  // reciprocals, then scales
      next_f += 2 * st.num_scales;
    }
    if (t.factored) {
      t.row_sum = next_f;
      t.row_factor = t.row_sum + t.rows;
      t.col_partial = t.row_factor + t.rows;
      next_f += factored_scratch(t);
    }
  }
}

// Factored second moments: the row / column sums of g^2 (in parallel over fixed row chunks),
// then the statistics update and the row factors in a fixed order (qconf/factored.h).
void run_factor_pass(RunItemsFn fn, const StepContext& ctx, CpuWorkspace& ws, std::vector<TensorDesc>& descs) {
  std::vector<WorkItem>& items = ws.factor_items;
  items.clear();
  for (size_t i = 0; i < descs.size(); ++i) {
    const TensorDesc& t = descs[i];
    if (!t.factored || t.numel == 0) continue;
    for (int64_t c = 0; c * t.rows_per_chunk < t.rows; ++c) items.push_back({static_cast<int32_t>(i), c, 0});
  }
  run_phase(fn, ctx, items, kPassFactor);
  for (auto& t : descs) {
    if (!t.factored || t.numel == 0) continue;
    const int64_t R = t.shape[t.ndim - 2], batches = t.rows / R, chunks = factor_chunks(t);
    for (int64_t r = 0; r < t.rows; ++r) factored_update_row(t, r);
    for (int64_t bc = 0; bc < batches * t.cols; ++bc) factored_update_col(t, bc, R, batches, chunks);
    for (int64_t b = 0; b < batches; ++b) factored_row_factors(t, b, R);
  }
}

// Elements per tile of a multi-tile tensor on this ISA. AVX2 takes 8192: with 2048 its step spent
// 2-4% more instructions on per-tile work (callgrind, `--size big` configs; docs/benchmarks.md,
// ninth round). The AVX-512 and scalar steps keep 2048: AVX-512 was not faster with 8192 there.
// Tiles never change the bits (tests/test_fused.py runs every ISA and compares).
int64_t isa_tile_target(Isa isa) { return isa == Isa::avx2 ? 8192 : host::kTileTarget; }

// The descriptions of the call's tensors (qconf/step_host.h) and their scratch, in `ws`; the step
// counters are incremented only if `advance_steps`. Returns the kernels' context.
StepContext describe_call(CpuWorkspace& ws, int64_t rule, at::TensorList params, at::TensorList grads,
                          at::TensorList steps, at::TensorList states, const at::Tensor& meta,
                          const at::Tensor& tables, c10::ArrayRef<double> hyper, int64_t seed, int nthreads,
                          bool advance_steps) {
  host::CallDescs& call = ws.call;
  call.tile_target = isa_tile_target(selected_isa());
  host::describe_tensors(rule, params, grads, steps, states, meta, tables.data_ptr<float>(), tables.size(0), hyper,
                         seed, at::Device(at::kCPU), "CPU", call, advance_steps);
  assign_scratch(ws, call.descs, nthreads);
  StepContext ctx;
  ctx.rule = static_cast<int32_t>(rule);
  ctx.tensors = call.descs.data();
  ctx.max_tile = call.max_tile;
  return ctx;
}

// Drops the call's gradients when it ends (the workspace outlives the call; the gradients must
// not), unless `keep` (a split step holds them from reduce() to apply()).
struct ReleaseGrads {
  host::CallDescs& c;
  bool keep = false;
  ~ReleaseGrads() {
    if (keep) return;
    for (auto& g : c.grad_storage) g.reset();
  }
};

// fn(i, k, st) for each two-pass quantized state k of each nonempty tensor i, in tensor order and
// within a tensor in slot order: the order of the split step's maxima. (The Kahan buffer's blocks
// always stay within a tile: it is never two-pass.)
template <class Fn>
void for_each_two_pass(std::vector<TensorDesc>& descs, Fn&& fn) {
  for (size_t i = 0; i < descs.size(); ++i) {
    if (descs[i].numel == 0) continue;
    for (int k = 0; k < 2; ++k) {
      StateDesc& st = descs[i].st[k];
      if (st.kind == kQuant && st.two_pass) fn(static_cast<int64_t>(i), k, st);
    }
  }
}

// After the apply pass of two-pass states: the new scales replace the old ones (which were needed
// until every tile was dequantized).
void store_new_scales(const StateDesc& st) {
  std::memcpy(st.scales, st.new_recip + st.num_scales, sizeof(float) * st.num_scales);
}

// Two-pass states of the tensors `batch`: the reduce pass, the new scales and reciprocals from
// the threads' partial maxima, the apply pass, then the new scales replace the old ones (which
// were needed until every tile was dequantized).
void run_two_pass(RunItemsFn fn, const StepContext& ctx, CpuWorkspace& ws, std::vector<TensorDesc>& descs,
                  int nthreads) {
  std::vector<WorkItem>& items = ws.batch_items;
  items.clear();
  for (int64_t i : ws.batch) append_tiles(descs, i, items);
  run_phase(fn, ctx, items, kPassReduce);
  for (int64_t i : ws.batch)
    for (auto& st : descs[i].st) {
      if (st.kind != kQuant || !st.two_pass) continue;
      for (int64_t j = 0; j < st.num_scales; ++j)
        finalize_scale(st.partial, st.num_scales, nthreads, j, st.new_recip, st.new_recip + st.num_scales);
    }
  run_phase(fn, ctx, items, kPassApply);
  for (int64_t i : ws.batch)
    for (auto& st : descs[i].st)
      if (st.kind == kQuant && st.two_pass) store_new_scales(st);
  ws.batch.clear();
}

}  // namespace

std::shared_ptr<CpuWorkspace> make_cpu_workspace() { return std::make_shared<CpuWorkspace>(); }

void fused_step_cpu(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                    at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                    c10::ArrayRef<double> hyper, int64_t seed) {
  CpuWorkspace ws;
  fused_step_cpu_reusing(ws, rule, params, grads, steps, states, meta, tables, hyper, seed);
}

void fused_step_cpu_reusing(CpuWorkspace& ws, int64_t rule, at::TensorList params, at::TensorList grads,
                    at::TensorList steps, at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                    c10::ArrayRef<double> hyper, int64_t seed) {
  const int64_t T = static_cast<int64_t>(params.size());
  ws.pending = false;  // a plain step replaces a split step's pending state
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  if (T == 0) return;

  // one TensorDesc per parameter (codecs, scalars, RNG keys, tiles), as the CUDA driver builds them
  host::CallDescs& call = ws.call;
  ReleaseGrads release{call};
  const int nthreads = at::get_num_threads();
  const StepContext ctx =
      describe_call(ws, rule, params, grads, steps, states, meta, tables, hyper, seed, nthreads, true);
  std::vector<TensorDesc>& descs = call.descs;
  const RunItemsFn fn = isa_function();
  if (call.any_factored) run_factor_pass(fn, ctx, ws, descs);

  // Two-pass tensors go in batches whose gradients fit the last-level cache, so pass 2 re-reads
  // them from cache instead of memory; single-pass tensors all run in one final apply phase.
  ws.single_items.clear();
  ws.batch.clear();
  int64_t batch_bytes = 0;
  for (int64_t i = 0; i < T; ++i) {
    const TensorDesc& t = descs[i];
    if (t.numel == 0) continue;
    if (!t.two_pass) {
      append_tiles(descs, i, ws.single_items);
      continue;
    }
    ws.batch.push_back(i);
    batch_bytes += t.numel * (t.gdtype == kF32 ? 4 : 2);
    if (batch_bytes >= kCacheBatchBytes) {
      run_two_pass(fn, ctx, ws, descs, nthreads);
      batch_bytes = 0;
    }
  }
  if (!ws.batch.empty()) run_two_pass(fn, ctx, ws, descs, nthreads);
  run_phase(fn, ctx, ws.single_items, kPassApply);
}

std::tuple<at::Tensor, at::Tensor> fused_step_cpu_reduce(CpuWorkspace& ws, int64_t rule, at::TensorList params,
                                                         at::TensorList grads, at::TensorList steps,
                                                         at::TensorList states, const at::Tensor& meta,
                                                         const at::Tensor& tables, c10::ArrayRef<double> hyper,
                                                         int64_t seed) {
  const int64_t T = static_cast<int64_t>(params.size());
  ws.pending = false;
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  host::CallDescs& call = ws.call;
  ReleaseGrads release{call};  // kept for apply() once the reduce pass has run
  const int nthreads = at::get_num_threads();
  const StepContext ctx =
      describe_call(ws, rule, params, grads, steps, states, meta, tables, hyper, seed, nthreads, false);
  std::vector<TensorDesc>& descs = call.descs;
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(!descs[i].factored, "qconf StepPlan.reduce: parameter ", i,
                " has a factored second moment, which the split step does not support (its row / column "
                "statistics would need a reduction of their own); use run()");

  // where each state's maxima go, and the reduce pass over every two-pass tensor at once
  at::Tensor offsets = at::full({T, 3}, -1, at::kLong);
  int64_t* off = offsets.data_ptr<int64_t>();
  int64_t total = 0;
  for_each_two_pass(descs, [&](int64_t i, int k, StateDesc& st) {
    off[i * 3 + k] = total;
    total += st.num_scales;
  });
  std::vector<WorkItem>& items = ws.batch_items;
  items.clear();
  for (int64_t i = 0; i < T; ++i)
    if (descs[i].numel > 0 && descs[i].two_pass) append_tiles(descs, i, items);
  run_phase(isa_function(), ctx, items, kPassReduce);

  // the threads' partial absmax bits combined: the absmax itself, a finite float >= 0
  at::Tensor maxima = at::empty({total}, at::kFloat);
  float* mx = maxima.data_ptr<float>();
  for_each_two_pass(descs, [&](int64_t i, int k, StateDesc& st) {
    float* dst = mx + off[i * 3 + k];
    for (int64_t j = 0; j < st.num_scales; ++j)
      dst[j] = bits_f32(combine_partials(st.partial, st.num_scales, nthreads, j));
  });
  ws.pending = true;
  ws.pending_rule = rule;
  ws.pending_maxima = total;
  release.keep = true;
  return {maxima, offsets};
}

void fused_step_cpu_apply(CpuWorkspace& ws, at::TensorList steps, const at::Tensor& maxima) {
  TORCH_CHECK(ws.pending, "qconf StepPlan.apply: no pending reduce() (apply() completes the step that the last "
              "reduce() of this plan started, once)");
  TORCH_CHECK(maxima.scalar_type() == at::kFloat && maxima.device().is_cpu() && maxima.dim() == 1 &&
                  maxima.numel() == ws.pending_maxima,
              "qconf StepPlan.apply: maxima must be a 1-D float32 CPU tensor of ", ws.pending_maxima,
              " elements (as reduce() returned it), got ", maxima.scalar_type(), " of shape ", maxima.sizes(),
              " on ", maxima.device());
  const at::Tensor mx_t = maxima.contiguous();
  const float* mx = mx_t.data_ptr<float>();
  for (int64_t j = 0; j < ws.pending_maxima; ++j)
    TORCH_CHECK(f32_bits(mx[j]) < 0x7f800000u, "qconf StepPlan.apply: maxima must be finite and >= +0; entry ", j,
                " is ", mx[j]);
  host::CallDescs& call = ws.call;
  ReleaseGrads release{call};
  ws.pending = false;
  std::vector<TensorDesc>& descs = call.descs;
  const int64_t T = static_cast<int64_t>(descs.size());

  // new scales and reciprocals as a plain step makes them from its own maxima
  const float* next = mx;
  for_each_two_pass(descs, [&](int64_t, int, StateDesc& st) {
    for (int64_t j = 0; j < st.num_scales; ++j)
      finalize_scale_bits(f32_bits(next[j]), j, st.new_recip, st.new_recip + st.num_scales);
    next += st.num_scales;
  });

  // the apply pass of every tensor, two-pass and single-pass alike (tiles are independent)
  StepContext ctx;
  ctx.rule = static_cast<int32_t>(ws.pending_rule);
  ctx.tensors = descs.data();
  ctx.max_tile = call.max_tile;
  std::vector<WorkItem>& items = ws.single_items;
  items.clear();
  for (int64_t i = 0; i < T; ++i)
    if (descs[i].numel > 0) append_tiles(descs, i, items);
  run_phase(isa_function(), ctx, items, kPassApply);
  for_each_two_pass(descs, [](int64_t, int, StateDesc& st) { store_new_scales(st); });
  for (int64_t i = 0; i < T; ++i) host::advance_step(steps[i], i);
}

}  // namespace qconf
