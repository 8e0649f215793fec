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

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "qconf/isa.h"
#include "qconf/parallel.h"
#include "qconf/step_host.h"
#include "qconf/step_types.h"

namespace qconf {
namespace {

// tile sizes, Scalars, codec parsing: shared with the CUDA driver (qconf/step_host.h)
using host::kFactorChunks;
constexpr int64_t kCacheBatchBytes = 8 << 20;  // gradient bytes of two-pass tensors per batch

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
  int64_t max_tile = call.max_tile;
  bool any_factored = call.any_factored;

  // scratch: two-pass partial maxima and new reciprocals + scales; factored sums. Sized first,
  // then carved out of two flat buffers that a StepPlan keeps between steps.
  size_t need_f = 0, need_u = 0;
  for (auto& t : descs) {
    if (t.numel == 0) continue;
    for (auto& st : t.st) {
      if (st.kind != kQuant || !st.two_pass) continue;
      need_u += static_cast<size_t>(nthreads) * st.num_scales;
      need_f += static_cast<size_t>(2 * st.num_scales);
    }
    if (t.factored) {
      t.rows_per_chunk = (t.rows + kFactorChunks - 1) / kFactorChunks;
      const int64_t chunks = (t.rows + t.rows_per_chunk - 1) / t.rows_per_chunk;
      need_f += static_cast<size_t>(2 * t.rows + chunks * (t.rows / t.shape[t.ndim - 2]) * t.cols);
    }
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
      const int64_t chunks = (t.rows + t.rows_per_chunk - 1) / t.rows_per_chunk;
      t.row_sum = next_f;
      t.row_factor = t.row_sum + t.rows;
      t.col_partial = t.row_factor + t.rows;
      next_f += 2 * t.rows + chunks * (t.rows / t.shape[t.ndim - 2]) * t.cols;
    }
  }

  StepContext ctx;
  ctx.rule = static_cast<int32_t>(rule);
  ctx.tensors = descs.data();
  ctx.max_tile = static_cast<int32_t>(max_tile);
  const RunItemsFn fn = isa_function();

  if (any_factored) {
    std::vector<WorkItem>& items = ws.factor_items;
    items.clear();
    for (int64_t i = 0; i < T; ++i) {
      const TensorDesc& t = descs[i];
      if (!t.factored || t.numel == 0) continue;
      for (int64_t c = 0; c * t.rows_per_chunk < t.rows; ++c) items.push_back({static_cast<int32_t>(i), c, 0});
    }
    run_phase(fn, ctx, items, kPassFactor);
    for (auto& t : descs) {  // statistics update, in fixed order (same as the reference formulas)
      if (!t.factored || t.numel == 0) continue;
      const Scalars& h = t.h;
      const int64_t R = t.shape[t.ndim - 2], C = t.cols, batches = t.rows / R;
      const int64_t chunks = (t.rows + t.rows_per_chunk - 1) / t.rows_per_chunk;
      const float fC = static_cast<float>(C), fR = static_cast<float>(R);
      for (int64_t r = 0; r < t.rows; ++r) t.row[r] = t.row[r] * h.b2 + (t.row_sum[r] / fC) * h.omb2;
      for (int64_t bc = 0; bc < batches * C; ++bc) {
        float s = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) s = s + t.col_partial[c * batches * C + bc];
        t.col[bc] = t.col[bc] * h.b2 + (s / fR) * h.omb2;
      }
      for (int64_t b = 0; b < batches; ++b) {
        float s = 0.0f;
        for (int64_t r = 0; r < R; ++r) s = s + t.row[b * R + r];
        const float mean = s / fR;
        for (int64_t r = 0; r < R; ++r)
          t.row_factor[b * R + r] = mean > 0.0f ? t.row[b * R + r] / mean : 0.0f;
      }
    }
  }

  auto tiles = [&](int64_t i, std::vector<WorkItem>& out) {
    const TensorDesc& t = descs[i];
    for (int64_t s = 0; s < t.numel; s += t.tile)
      out.push_back({static_cast<int32_t>(i), s, std::min(t.tile, t.numel - s)});
  };
  // Two-pass tensors go in batches whose gradients fit the last-level cache, so pass 2 re-reads
  // them from cache instead of memory; single-pass tensors all run in one final apply phase.
  std::vector<WorkItem>& single_items = ws.single_items;
  std::vector<WorkItem>& batch_items = ws.batch_items;
  std::vector<int64_t>& batch = ws.batch;
  single_items.clear();
  batch.clear();
  int64_t batch_bytes = 0;
  auto flush = [&]() {
    if (batch.empty()) return;
    batch_items.clear();
    for (int64_t i : batch) tiles(i, batch_items);
    run_phase(fn, ctx, batch_items, kPassReduce);
    for (int64_t i : batch) {
      for (auto& st : descs[i].st) {
        if (st.kind != kQuant || !st.two_pass) continue;
        for (int64_t j = 0; j < st.num_scales; ++j) {
          uint32_t mx = 0;
          for (int th = 0; th < nthreads; ++th) mx = std::max(mx, st.partial[th * st.num_scales + j]);
          const float sc = scale_from_absmax_bits(mx);
          st.new_recip[j] = 1.0f / sc;
          st.new_recip[st.num_scales + j] = sc;
        }
      }
    }
    run_phase(fn, ctx, batch_items, kPassApply);
    for (int64_t i : batch)  // the old scales were needed until every tile was dequantized
      for (auto& st : descs[i].st)
        if (st.kind == kQuant && st.two_pass)
          std::memcpy(st.scales, st.new_recip + st.num_scales, sizeof(float) * st.num_scales);
    batch.clear();
    batch_bytes = 0;
  };
  for (int64_t i = 0; i < T; ++i) {
    const TensorDesc& t = descs[i];
    if (t.numel == 0) continue;
    if (!t.two_pass) {
      tiles(i, single_items);
      continue;
    }
    batch.push_back(i);
    batch_bytes += t.numel * (t.gdtype == kF32 ? 4 : 2);
    if (batch_bytes >= kCacheBatchBytes) flush();
  }
  flush();
  run_phase(fn, ctx, single_items, kPassApply);
}

}  // namespace qconf
