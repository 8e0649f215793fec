// Driver of the fused CPU optimizer step: validates the arguments, builds one TensorDesc per
// parameter (codecs, scalars, RNG keys), splits all tensors of the call into tiles and runs
//
//   [factor pass]   row/column sums of g^2 for factored second moments, then the statistics update
//   [reduce pass]   new absmax of states whose scales need the whole tensor (tensor/dim1/rank1)
//   apply pass      dequantize -> rule -> quantize -> store, every tile independently
//
// each as one at::parallel_for over the work items of *all* tensors (multi-tensor). The ISA
// (AVX-512 / AVX2 / scalar) is chosen per call; all give identical results.
#include "qconf/step_driver.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "qconf/isa.h"
#include "qconf/step_types.h"

namespace qconf {
namespace {

constexpr int64_t kTileTarget = 1024;   // elements per work item (8 tile buffers stay in L1/L2)
constexpr int64_t kMaxUnit = 16384;     // largest block kept single-pass
constexpr int64_t kFactorChunks = 16;   // fixed row chunking of the factor pass (thread-count independent)

int32_t dtype_code(const at::Tensor& t, const char* what, int64_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default:
      TORCH_CHECK(false, "qconf fused_step: ", what, " ", i, " has dtype ", t.scalar_type(),
                  "; supported: float32, bfloat16, float16");
  }
}

int64_t num_scales_of(const CodecDesc& c, const TensorDesc& t) {
  if (c.scale_kind == kBlock) return (t.numel + c.block - 1) / c.block;
  if (c.scale_kind == kDim1) return c.d1;
  int64_t s = 0;
  for (int d = 0; d < t.ndim; ++d) s += t.shape[d];
  return s;
}

Scalars make_scalars(int64_t rule, c10::ArrayRef<double> hp, double step, bool first) {
  // hyper: lr, beta1, beta2, eps, weight_decay, momentum, dampening, maximize, nesterov, decoupled
  const double lr = hp[0], b1 = hp[1], b2 = hp[2], eps = hp[3], wd = hp[4], mom = hp[5], damp = hp[6];
  Scalars h{};
  h.lr = static_cast<float>(lr);
  h.b1 = static_cast<float>(b1);
  h.omb1 = static_cast<float>(1.0 - b1);
  h.b2 = static_cast<float>(b2);
  h.omb2 = static_cast<float>(1.0 - b2);
  h.eps = static_cast<float>(eps);
  h.wd = static_cast<float>(wd);
  h.decay = static_cast<float>(1.0 - lr * wd);
  h.momentum = static_cast<float>(mom);
  h.omdamp = static_cast<float>(1.0 - damp);
  h.maximize = hp[7] != 0.0;
  h.nesterov = hp[8] != 0.0;
  h.decoupled = hp[9] != 0.0;
  h.has_wd = wd != 0.0;
  h.has_momentum = mom != 0.0;
  h.first = first;
  if (rule == kRuleAdam) {
    // the reference computes these in Python doubles: lr / (1 - b1**t), 1 / (1 - b2**t) ** 0.5
    h.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, step)));
    h.inv_bc2_sqrt = static_cast<float>(1.0 / std::pow(1.0 - std::pow(b2, step), 0.5));
  }
  return h;
}

int64_t lcm64(int64_t a, int64_t b) { return a / std::gcd(a, b) * b; }

RunItemsFn isa_function() {
  switch (selected_isa()) {
    case Isa::avx512: return &isa_avx512::run_items;
    case Isa::avx2: return &isa_avx2::run_items;
    default: return &isa_scalar::run_items;
  }
}

void run_phase(RunItemsFn fn, const StepContext& ctx, const std::vector<WorkItem>& items, int32_t phase) {
  if (items.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    fn(ctx, items.data(), begin, end, phase, static_cast<int32_t>(at::get_thread_num()));
  });
}

}  // namespace

void fused_step_cpu(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                    at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                    c10::ArrayRef<double> hyper, int64_t seed) {
  const int64_t T = static_cast<int64_t>(params.size());
  TORCH_CHECK(rule >= kRuleAdam && rule <= kRuleLion, "qconf fused_step: unknown rule ", rule);
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == T && static_cast<int64_t>(steps.size()) == T &&
                  static_cast<int64_t>(states.size()) == kStateSlots * T,
              "qconf fused_step: expected ", T, " grads and steps and ", kStateSlots * T, " state tensors, got ",
              grads.size(), ", ", steps.size(), ", ", states.size());
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(0) == T && meta.size(1) == kMetaCols &&
                  meta.is_contiguous(),
              "qconf fused_step: meta must be a contiguous int64 tensor of shape (", T, ", ", kMetaCols, ")");
  TORCH_CHECK(tables.scalar_type() == at::kFloat && tables.dim() == 3 && tables.size(1) == kTableRows &&
                  tables.size(2) == kTableSize && tables.is_contiguous(),
              "qconf fused_step: tables must be a contiguous float32 tensor of shape (N, ", kTableRows, ", ",
              kTableSize, ")");
  TORCH_CHECK(hyper.size() == kHyperLen, "qconf fused_step: hyper must have ", kHyperLen, " values");
  if (T == 0) return;

  const int64_t* M = meta.data_ptr<int64_t>();
  const float* tab = tables.data_ptr<float>();
  const int64_t ntab = tables.size(0);
  std::vector<TensorDesc> descs(T);
  std::vector<at::Tensor> grad_storage(T);  // contiguous views (a copy only for strided gradients)
  std::vector<std::vector<float>> scratch_f;
  std::vector<std::vector<uint32_t>> scratch_u;
  const int nthreads = at::get_num_threads();
  int64_t max_tile = 64;
  bool any_two_pass = false, any_factored = false;

  for (int64_t i = 0; i < T; ++i) {
    const int64_t* m = M + i * kMetaCols;
    TensorDesc& t = descs[i];
    const at::Tensor& p = params[i];
    TORCH_CHECK(!grads[i].is_sparse(), "qconf fused_step: gradient ", i, " is sparse; sparse gradients are not supported");
    grad_storage[i] = grads[i].contiguous();
    const at::Tensor& g = grad_storage[i];
    TORCH_CHECK(p.device().is_cpu() && g.device().is_cpu(), "qconf fused_step (CPU): parameter ", i, " is not on the CPU");
    TORCH_CHECK(p.is_contiguous(), "qconf fused_step: parameter ", i, " must be contiguous");
    TORCH_CHECK(g.numel() == p.numel(), "qconf fused_step: gradient ", i, " has ", g.numel(), " elements, the parameter ", p.numel());
    t.numel = p.numel();
    t.ndim = static_cast<int32_t>(m[kColNdim]);
    TORCH_CHECK(t.ndim == p.dim() && t.ndim <= kMaxDims, "qconf fused_step: meta ndim of parameter ", i, " is wrong");
    for (int d = 0; d < t.ndim; ++d) {
      t.shape[d] = m[kColShape + d];
      TORCH_CHECK(t.shape[d] == p.size(d), "qconf fused_step: meta shape of parameter ", i, " is wrong");
    }
    t.param = p.data_ptr();
    t.pdtype = dtype_code(p, "parameter", i);
    t.grad = g.data_ptr();
    t.gdtype = dtype_code(g, "gradient", i);
    const at::Tensor& step = steps[i];
    TORCH_CHECK(step.scalar_type() == at::kFloat && step.numel() == 1 && step.device().is_cpu(),
                "qconf fused_step: step ", i, " must be a one-element float32 CPU tensor");
    float* step_ptr = step.data_ptr<float>();
    *step_ptr += 1.0f;
    const double step_value = static_cast<double>(*step_ptr);
    t.h = make_scalars(rule, hyper, step_value, m[kColFirst] != 0);
    t.factored = static_cast<int32_t>(m[kColFactored]);

    int64_t unit = 64;  // tile granularity: whole vectors and bytes of codes, whole single-pass blocks
    for (int k = 0; k < 2; ++k) {
      const int64_t* sm = m + kColState + k * kStateCols;
      StateDesc& st = t.st[k];
      st.kind = static_cast<int32_t>(sm[0]);
      const at::Tensor& a = states[i * kStateSlots + 2 * k];
      const at::Tensor& b = states[i * kStateSlots + 2 * k + 1];
      if (st.kind == kFp32) {
        TORCH_CHECK(a.scalar_type() == at::kFloat && a.numel() == t.numel && a.is_contiguous(),
                    "qconf fused_step: fp32 state ", k, " of parameter ", i, " must be a contiguous float32 tensor of ",
                    t.numel, " elements");
        st.values = a.data_ptr<float>();
      } else if (st.kind == kQuant) {
        CodecDesc& c = st.codec;
        const int64_t table = sm[1];
        TORCH_CHECK(table >= 0 && table < ntab, "qconf fused_step: table index out of range");
        c.bits = static_cast<int32_t>(sm[2]);
        c.levels = static_cast<int32_t>(sm[3]);
        c.scale_kind = static_cast<int32_t>(sm[4]);
        c.block = sm[5];
        c.d1 = sm[6];
        c.inner = sm[7];
        c.stochastic = static_cast<int32_t>(sm[8]);
        TORCH_CHECK(c.bits >= 1 && c.bits <= 8 && c.levels >= 2 && c.levels <= (1 << c.bits) &&
                        c.scale_kind >= kBlock && c.scale_kind <= kRank1 &&
                        (c.scale_kind != kBlock || c.block >= 1) && (c.scale_kind != kDim1 || (c.d1 >= 1 && c.inner >= 1)) &&
                        (c.scale_kind != kRank1 || t.ndim >= 2),
                    "qconf fused_step: invalid codec description for state ", k, " of parameter ", i);
        const float* base = tab + table * kTableRows * kTableSize;
        c.qmap = base;
        c.mids = base + kTableSize;
        c.qsearch = base + 2 * kTableSize;
        c.coarse_mids = base + 3 * kTableSize;
        c.coarse_qsearch = base + 3 * kTableSize + 16;
        c.coarse32_mids = base + 4 * kTableSize;
        c.coarse32_qsearch = base + 4 * kTableSize + 32;
        c.cols_mids = base + 5 * kTableSize;
        c.cols_qsearch = base + 6 * kTableSize;
        st.num_scales = num_scales_of(c, t);
        const int64_t nbytes = (t.numel * c.bits + 7) / 8;
        TORCH_CHECK(a.scalar_type() == at::kByte && a.numel() == nbytes && a.is_contiguous(),
                    "qconf fused_step: codes of state ", k, " of parameter ", i, " must be ", nbytes, " contiguous uint8");
        TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == st.num_scales && b.is_contiguous(),
                    "qconf fused_step: scales of state ", k, " of parameter ", i, " must be ", st.num_scales,
                    " contiguous float32");
        st.codes = a.data_ptr<uint8_t>();
        st.scales = b.data_ptr<float>();
        st.key = stream_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(step_value),
                            static_cast<uint64_t>(m[kColIndex]), static_cast<uint64_t>(k));
        st.two_pass = c.scale_kind != kBlock || c.block > kMaxUnit;
        if (!st.two_pass) unit = lcm64(unit, c.block);
      } else {
        TORCH_CHECK(st.kind == kNone, "qconf fused_step: unknown state kind ", st.kind);
      }
    }
    // keep single-pass blocks within one tile; if their common multiple is too large, the larger
    // block goes through the two-pass path instead
    if (unit > kMaxUnit && t.numel > kMaxUnit) {
      unit = 64;
      StateDesc* big = t.st[0].kind == kQuant && !t.st[0].two_pass ? &t.st[0] : nullptr;
      StateDesc* other = t.st[1].kind == kQuant && !t.st[1].two_pass ? &t.st[1] : nullptr;
      if (big && other && other->codec.block > big->codec.block) std::swap(big, other);
      if (big) big->two_pass = 1;
      if (other) unit = lcm64(unit, other->codec.block);
      if (unit > kMaxUnit && other) {
        other->two_pass = 1;
        unit = 64;
      }
    }
    if (t.numel <= kMaxUnit) {
      t.tile = t.numel;  // one tile holds the whole tensor: every block is inside it
      for (auto& st : t.st)
        if (st.kind == kQuant && st.codec.scale_kind == kBlock) st.two_pass = 0;
    } else {
      t.tile = ((kTileTarget + unit - 1) / unit) * unit;
    }
    t.two_pass = (t.st[0].kind == kQuant && t.st[0].two_pass) || (t.st[1].kind == kQuant && t.st[1].two_pass);
    any_two_pass |= t.two_pass != 0;
    if (t.factored) {
      TORCH_CHECK(rule == kRuleAdam && t.ndim >= 2 && t.st[1].kind == kNone,
                  "qconf fused_step: a factored second moment needs Adam, ndim >= 2 and no dense exp_avg_sq");
      const at::Tensor& row = states[i * kStateSlots + 4];
      const at::Tensor& col = states[i * kStateSlots + 5];
      t.cols = t.shape[t.ndim - 1];
      t.rows = t.numel / std::max<int64_t>(t.cols, 1);
      const int64_t R = t.shape[t.ndim - 2];
      const int64_t batches = t.rows / std::max<int64_t>(R, 1);
      TORCH_CHECK(row.scalar_type() == at::kFloat && row.numel() == t.rows && row.is_contiguous() &&
                      col.scalar_type() == at::kFloat && col.numel() == batches * t.cols && col.is_contiguous(),
                  "qconf fused_step: factored statistics of parameter ", i, " have the wrong size or dtype");
      t.row = row.data_ptr<float>();
      t.col = col.data_ptr<float>();
      any_factored = true;
      max_tile = std::max(max_tile, t.cols);
    }
    max_tile = std::max(max_tile, t.tile);
  }

  // scratch: two-pass partial maxima and new reciprocals; factored sums
  for (auto& t : descs) {
    for (auto& st : t.st) {
      if (st.kind != kQuant || !st.two_pass || t.numel == 0) continue;
      scratch_u.emplace_back(static_cast<size_t>(nthreads) * st.num_scales, 0u);
      st.partial = scratch_u.back().data();
      scratch_f.emplace_back(static_cast<size_t>(2 * st.num_scales), 0.0f);  // reciprocals, then scales
      st.new_recip = scratch_f.back().data();
    }
    if (t.factored && t.numel > 0) {
      const int64_t R = t.shape[t.ndim - 2];
      const int64_t batches = t.rows / R;
      t.rows_per_chunk = (t.rows + kFactorChunks - 1) / kFactorChunks;
      const int64_t chunks = (t.rows + t.rows_per_chunk - 1) / t.rows_per_chunk;
      scratch_f.emplace_back(static_cast<size_t>(2 * t.rows + chunks * batches * t.cols), 0.0f);
      t.row_sum = scratch_f.back().data();
      t.row_factor = t.row_sum + t.rows;
      t.col_partial = t.row_factor + t.rows;
    }
  }

  StepContext ctx;
  ctx.rule = static_cast<int32_t>(rule);
  ctx.tensors = descs.data();
  ctx.num_tensors = static_cast<int32_t>(T);
  ctx.max_tile = static_cast<int32_t>(max_tile);
  const RunItemsFn fn = isa_function();

  if (any_factored) {
    std::vector<WorkItem> items;
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

  std::vector<WorkItem> items;
  for (int64_t i = 0; i < T; ++i) {
    const TensorDesc& t = descs[i];
    for (int64_t s = 0; s < t.numel; s += t.tile)
      items.push_back({static_cast<int32_t>(i), s, std::min(t.tile, t.numel - s)});
  }
  if (any_two_pass) {
    std::vector<WorkItem> reduce;
    for (const auto& it : items)
      if (descs[it.tensor].two_pass) reduce.push_back(it);
    run_phase(fn, ctx, reduce, kPassReduce);
    for (auto& t : descs) {
      for (auto& st : t.st) {
        if (st.kind != kQuant || !st.two_pass || t.numel == 0) continue;
        for (int64_t j = 0; j < st.num_scales; ++j) {
          uint32_t mx = 0;
          for (int th = 0; th < nthreads; ++th) mx = std::max(mx, st.partial[th * st.num_scales + j]);
          const float sc = scale_from_absmax_bits(mx);
          st.new_recip[j] = 1.0f / sc;
          st.new_recip[st.num_scales + j] = sc;
        }
      }
    }
  }
  run_phase(fn, ctx, items, kPassApply);
  if (any_two_pass) {  // the old scales were needed until every tile was dequantized
    for (auto& t : descs)
      for (auto& st : t.st)
        if (st.kind == kQuant && st.two_pass && t.numel > 0)
          std::memcpy(st.scales, st.new_recip + st.num_scales, sizeof(float) * st.num_scales);
  }
}

}  // namespace qconf
