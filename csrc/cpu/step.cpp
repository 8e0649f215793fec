// Driver of the fused CPU optimizer step: validates the arguments, builds one TensorDesc per
// parameter (codecs, scalars, RNG keys), splits all tensors of the call into tiles and runs
//
//   [factor pass]   row/column sums of g^2 for factored second moments, then the statistics update
//   [reduce pass]   new absmax of states whose scales need the whole tensor (tensor/dim1/rank1)
//   apply pass      dequantize -> rule -> quantize -> store, every tile independently
//
// each as one at::parallel_for over the work items of *all* tensors (multi-tensor). The ISA
// (AVX-512 with or without VBMI / AVX2 / scalar) is chosen per call; all give identical results.
#include "qconf/step_driver.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
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
    case Isa::avx512vbmi: return &isa_avx512vbmi::run_items;
    case Isa::avx512: return &isa_avx512::run_items;
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
      if (st.kind == kQuant && st.two_pass)
        std::memcpy(st.scales, st.new_recip + st.num_scales, sizeof(float) * st.num_scales);
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
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  if (T == 0) return;

  // one TensorDesc per parameter (codecs, scalars, RNG keys, tiles), as the CUDA driver builds them
  host::CallDescs& call = ws.call;
  struct ReleaseGrads {  // the workspace outlives the call; the gradients must not
    host::CallDescs& c;
    ~ReleaseGrads() {
      for (auto& g : c.grad_storage) g.reset();
    }
  } release{call};
  host::describe_tensors(rule, params, grads, steps, states, meta, tables.data_ptr<float>(), tables.size(0), hyper,
                         seed, at::Device(at::kCPU), "CPU", call);
  std::vector<TensorDesc>& descs = call.descs;
  const int nthreads = at::get_num_threads();
  assign_scratch(ws, descs, nthreads);

  StepContext ctx;
  ctx.rule = static_cast<int32_t>(rule);
  ctx.tensors = descs.data();
  ctx.max_tile = static_cast<int32_t>(call.max_tile);
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

}  // namespace qconf
