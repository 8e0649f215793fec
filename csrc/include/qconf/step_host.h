// Host-side pieces of the fused optimizer step shared by the CPU driver (csrc/cpu/step.cpp) and
// the CUDA driver (csrc/cuda/step.cu), so that both read `meta` / `hyper` / `steps` exactly the
// same way: argument checks, per-tensor Scalars (computed in double precision as the reference
// does), stochastic-rounding keys, codec descriptions and the single-pass / two-pass decision.
//
// Everything here runs on the host; the kernels only read the resulting TensorDesc array.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "qconf/element.h"
#include "qconf/step_driver.h"
#include "qconf/step_types.h"

namespace qconf {
namespace host {

constexpr int64_t kTileTarget = 2048;   // elements per work item unless the driver asks for another
                                        // (CallDescs::tile_target; 1024 spent 5% more instructions
                                        // on per-tile setup)
constexpr int64_t kMaxUnit = 16384;     // largest block kept single-pass
constexpr int64_t kFactorChunks = 16;   // fixed row chunking of the factor pass (thread-count independent)

inline int32_t dtype_code(const at::Tensor& t, const char* what, int64_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default:
      TORCH_CHECK(false, "qconf fused_step: ", what, " ", i, " has dtype ", t.scalar_type(),
                  "; supported: float32, bfloat16, float16");
  }
}

inline int64_t num_scales_of(const CodecDesc& c, const TensorDesc& t) {
  if (c.scale_kind == kBlock) return (t.numel + c.block - 1) / c.block;
  if (c.scale_kind == kDim1) return c.d1;
  int64_t s = 0;
  for (int d = 0; d < t.ndim; ++d) s += t.shape[d];
  return s;
}

// Muon's lerps as torch.lerp computes them (element.h lerp_as_torch): the buffer's weight is
// 1 - momentum (a Python double, rounded once to fp32), Nesterov's is momentum.
inline void set_muon_lerps(Scalars& h, double mom) {
  h.buf_w = static_cast<float>(1.0 - mom);
  h.buf_wm1 = h.buf_w - 1.0f;
  h.buf_small = std::fabs(h.buf_w) < 0.5f;
  h.nes_w = static_cast<float>(mom);
  h.nes_wm1 = h.nes_w - 1.0f;
  h.nes_small = std::fabs(h.nes_w) < 0.5f;
}

inline Scalars make_scalars(int64_t rule, c10::ArrayRef<double> hp, double step, bool first) {
  const double lr = hp[kHyperLr], b1 = hp[kHyperBeta1], b2 = hp[kHyperBeta2], eps = hp[kHyperEps];
  const double wd = hp[kHyperWeightDecay], mom = hp[kHyperMomentum], damp = hp[kHyperDampening];
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
  h.maximize = hp[kHyperMaximize] != 0.0;
  h.nesterov = hp[kHyperNesterov] != 0.0;
  h.decoupled = hp[kHyperDecoupled] != 0.0;
  h.has_wd = wd != 0.0;
  h.has_momentum = mom != 0.0;
  h.first = first;
  if (rule == kRuleMuonMomentum) set_muon_lerps(h, mom);
  if (rule == kRuleMuonUpdate) h.step_size = static_cast<float>(hp[kHyperAdjustedLr]);
  if (rule == kRuleAdam) {
    // the reference computes these in Python doubles: lr / (1 - b1**t), 1 / (1 - b2**t) ** 0.5
    h.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, step)));
    h.inv_bc2_sqrt = static_cast<float>(1.0 / std::pow(1.0 - std::pow(b2, step), 0.5));
  }
  return h;
}

inline int64_t lcm64(int64_t a, int64_t b) { return a / std::gcd(a, b) * b; }

// Starts loading a tensor's metadata (its TensorImpl, then, once that is in cache, its
// StorageImpl): with 1000s of small parameters, reading the cold metadata of six tensors per
// parameter was most of the host's time per step. `deep` also follows the storage pointer, so
// call it a few tensors later than the shallow one.
inline void prefetch_meta(const at::Tensor& x, bool deep) {
  if (!x.defined()) return;
  const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  if (!deep) {
    __builtin_prefetch(impl);
    __builtin_prefetch(reinterpret_cast<const char*>(impl) + 64);
    __builtin_prefetch(reinterpret_cast<const char*>(impl) + 128);
  } else if (impl->has_storage()) {
    __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  }
}

// Checks of the whole call (before any tensor is looked at).
inline void check_call(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                       at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                       c10::ArrayRef<double> hyper) {
  const int64_t T = static_cast<int64_t>(params.size());
  TORCH_CHECK(rule >= kRuleAdam && rule <= kRuleLast, "qconf fused_step: unknown rule ", rule);
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == T && static_cast<int64_t>(steps.size()) == T &&
                  static_cast<int64_t>(states.size()) == kSlotLen * T,
              "qconf fused_step: expected ", T, " grads and steps and ", kSlotLen * T, " state tensors, got ",
              grads.size(), ", ", steps.size(), ", ", states.size());
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 && meta.size(0) == T && meta.size(1) == kMetaCols &&
                  meta.is_contiguous(),
              "qconf fused_step: meta must be a contiguous int64 tensor of shape (", T, ", ", kMetaCols, ")");
  TORCH_CHECK(tables.scalar_type() == at::kFloat && tables.dim() == 3 && tables.size(1) == kTableRows &&
                  tables.size(2) == kTableSize && tables.is_contiguous(),
              "qconf fused_step: tables must be a contiguous float32 tensor of shape (N, ", kTableRows, ", ",
              kTableSize, ")");
  TORCH_CHECK(hyper.size() == static_cast<size_t>(kHyperLen), "qconf fused_step: hyper must have ", kHyperLen,
              " values");
}

// What describing one parameter needs besides its own row of `meta`: the state tensors, the
// tables' address as the kernels will read it (host or device memory) and their count, the seed,
// and the device everything must be on (`where` names the driver in messages: "CPU", "CUDA").
struct CallContext {
  int64_t rule;
  at::TensorList states;
  const float* tab;
  int64_t ntab;
  int64_t seed;
  at::Device device;
  const char* where;
  std::string device_name;

  CallContext(int64_t rule_, at::TensorList states_, const float* tab_, int64_t ntab_, int64_t seed_,
              const at::Device& device_, const char* where_)
      : rule(rule_), states(states_), tab(tab_), ntab(ntab_), seed(seed_), device(device_), where(where_),
        device_name(device_.is_cpu() ? std::string("CPU") : device_.str()) {}
  // tensor `slot` (layout.h kSlot*) of parameter i
  const at::Tensor& state(int64_t i, int slot) const { return states[i * kSlotLen + slot]; }
  void check_device(const at::Tensor& s, int64_t i) const {
    TORCH_CHECK(s.device() == device, "qconf fused_step (", where, "): a state of parameter ", i, " is not on the ",
                device_name);
  }
  // the random stream `stream` of parameter i at this step: 0, 1 its states, 2 its own stochastic
  // rounding, 3 its quantized Kahan buffer (qconf/codec/rng.py); its element 0 draws stream
  // element m[kMetaRngOffset] (checked >= 0 in describe_param)
  StreamKey key(const int64_t* m, double step, uint64_t stream) const {
    StreamKey k = stream_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(step),
                             static_cast<uint64_t>(m[kMetaIndex]), stream);
    k.offset = static_cast<uint64_t>(m[kMetaRngOffset]);
    return k;
  }
};

// A quantized state's codec and storage from its meta column block `sm` (layout.h kStateCol*) and
// its tensors `a` (packed codes) / `b` (scales).
inline void describe_quant(const CallContext& cx, const int64_t* sm, const at::Tensor& a, const at::Tensor& b,
                           const TensorDesc& t, int64_t i, const char* what, int k, StateDesc& st) {
  CodecDesc& c = st.codec;
  const int64_t table = sm[kStateColTable];
  TORCH_CHECK(table >= 0 && table < cx.ntab, "qconf fused_step: table index out of range");
  read_codec(c, sm + kStateColCodec);
  TORCH_CHECK(codec_valid(c, t.ndim), "qconf fused_step: invalid codec description for ", what, " ", k,
              " of parameter ", i);
  point_tables(c, cx.tab + table * kTableRows * kTableSize);
  st.num_scales = num_scales_of(c, t);
  const int64_t nbytes = (t.numel * c.bits + 7) / 8;
  TORCH_CHECK(a.scalar_type() == at::kByte && a.numel() == nbytes && a.is_contiguous(),
              "qconf fused_step: codes of ", what, " ", k, " of parameter ", i, " must be ", nbytes, " contiguous uint8");
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == st.num_scales && b.is_contiguous(),
              "qconf fused_step: scales of ", what, " ", k, " of parameter ", i, " must be ", st.num_scales,
              " contiguous float32");
  // dtypes checked above; the untyped data_ptr skips the typed one's repeated checks (this runs
  // for every state of every parameter on every step)
  st.codes = static_cast<uint8_t*>(a.data_ptr());
  st.scales = static_cast<float*>(b.data_ptr());
}

// The per-tensor descriptions of one call.
struct CallDescs {
  std::vector<TensorDesc> descs;
  std::vector<at::Tensor> grad_storage;  // contiguous views (a copy only for strided gradients)
  int64_t max_tile = 64;
  bool any_factored = false;
  int64_t tile_target = kTileTarget;  // elements per work item of a multi-tile tensor (set by the driver)
};

// Parameter i and its gradient (made contiguous into `g`): shape, dtypes, data.
inline void describe_param(const CallContext& cx, int64_t i, const at::Tensor& p, const at::Tensor& grad,
                           const int64_t* m, at::Tensor& g, TensorDesc& t) {
  TORCH_CHECK(!grad.is_sparse(), "qconf fused_step: gradient ", i, " is sparse; sparse gradients are not supported");
  g = grad.contiguous();
  TORCH_CHECK(p.device() == cx.device && g.device() == cx.device, "qconf fused_step (", cx.where, "): parameter ", i,
              " is not on the ", cx.device_name);
  TORCH_CHECK(p.is_contiguous(), "qconf fused_step: parameter ", i, " must be contiguous");
  TORCH_CHECK(g.numel() == p.numel(), "qconf fused_step: gradient ", i, " has ", g.numel(), " elements, the parameter ", p.numel());
  t.numel = p.numel();
  TORCH_CHECK(m[kMetaRngOffset] >= 0, "qconf fused_step: meta rng_offset of parameter ", i, " is negative");
  t.ndim = static_cast<int32_t>(m[kMetaNdim]);
  TORCH_CHECK(t.ndim == p.dim() && t.ndim <= kMaxDims, "qconf fused_step: meta ndim of parameter ", i, " is wrong");
  for (int d = 0; d < t.ndim; ++d) {
    t.shape[d] = m[kMetaShape + d];
    TORCH_CHECK(t.shape[d] == p.size(d), "qconf fused_step: meta shape of parameter ", i, " is wrong");
  }
  t.param = p.data_ptr();
  t.pdtype = dtype_code(p, "parameter", i);
  t.grad = g.data_ptr();
  t.gdtype = dtype_code(g, "gradient", i);
}

// Parameter i's step at this step (its counter + 1), written to the counter if `advance` (the
// split CPU step reads it in reduce() and writes it in apply()).
inline double advance_step(const at::Tensor& step, int64_t i, bool advance = true) {
  TORCH_CHECK(step.scalar_type() == at::kFloat && step.numel() == 1 && step.device().is_cpu(),
              "qconf fused_step: step ", i, " must be a one-element float32 CPU tensor");
  float* step_ptr = static_cast<float*>(step.data_ptr());
  const float next = *step_ptr + 1.0f;
  if (advance) *step_ptr = next;
  return static_cast<double>(next);
}

// One Scalars per distinct (step, first) (usually one per call): std::pow is not free either.
struct ScalarsCache {
  double step = -1.0;
  bool first = false;
  Scalars h{};
  const Scalars& get(int64_t rule, c10::ArrayRef<double> hyper, double step_value, bool first_step) {
    if (step_value != step || first_step != first) {
      step = step_value;
      first = first_step;
      h = make_scalars(rule, hyper, step_value, first_step);
    }
    return h;
  }
};

// States 0 and 1 (fp32 or quantized) of parameter i. Returns the tile unit: 64 (whole vectors and
// bytes of codes), times the blocks of single-pass states.
inline int64_t describe_states(const CallContext& cx, int64_t i, const int64_t* m, double step, TensorDesc& t) {
  int64_t unit = 64;
  for (int k = 0; k < 2; ++k) {
    const int64_t* sm = m + meta_state(k);
    StateDesc& st = t.st[k];
    st.kind = static_cast<int32_t>(sm[kStateColKind]);
    const at::Tensor& a = cx.state(i, slot_state(k));
    if (st.kind == kFp32) {
      TORCH_CHECK(a.scalar_type() == at::kFloat && a.numel() == t.numel && a.is_contiguous(),
                  "qconf fused_step: fp32 state ", k, " of parameter ", i, " must be a contiguous float32 tensor of ",
                  t.numel, " elements");
      cx.check_device(a, i);
      st.values = static_cast<float*>(a.data_ptr());
    } else if (st.kind == kQuant) {
      const at::Tensor& b = cx.state(i, slot_scales(k));
      describe_quant(cx, sm, a, b, t, i, "state", k, st);
      cx.check_device(a, i);
      cx.check_device(b, i);
      st.key = cx.key(m, step, static_cast<uint64_t>(k));
      st.two_pass = st.codec.scale_kind != kBlock || st.codec.block > kMaxUnit;
      if (!st.two_pass) unit = lcm64(unit, st.codec.block);
    } else {
      TORCH_CHECK(st.kind == kNone, "qconf fused_step: unknown state kind ", st.kind);
    }
  }
  return unit;
}

// How parameter i's new values reach a bf16/fp16 parameter: stochastic rounding (stream 2) and/or
// the Kahan buffer (in the parameter's dtype, or quantized: stream 3). Returns the tile unit of
// the buffer: 64, times its block if quantized (its blocks always stay within one tile).
inline int64_t describe_weights(const CallContext& cx, int64_t i, const at::Tensor& p, const int64_t* m, double step,
                                TensorDesc& t) {
  const int64_t wflags = m[kMetaWeights];
  TORCH_CHECK((wflags & ~static_cast<int64_t>(kWeightsStochastic | kWeightsKahan)) == 0,
              "qconf fused_step: invalid weights flags ", wflags, " of parameter ", i);
  TORCH_CHECK(wflags == 0 || t.pdtype != kF32, "qconf fused_step: parameter ", i,
              " is float32; stochastic rounding / Kahan compensation apply to bfloat16 and float16 parameters");
  t.w_stochastic = (wflags & kWeightsStochastic) != 0;
  t.w_kahan = (wflags & kWeightsKahan) != 0;
  t.pkey = cx.key(m, step, 2);
  const int64_t* cm = m + kMetaComp;
  StateDesc& cs = t.comp;
  cs.kind = static_cast<int32_t>(cm[kStateColKind]);
  const at::Tensor& a = cx.state(i, kSlotComp);
  TORCH_CHECK(t.w_kahan ? (cs.kind == kParamDtype || cs.kind == kQuant) : cs.kind == kNone,
              "qconf fused_step: the Kahan buffer of parameter ", i, " does not match its weights flags");
  if (cs.kind == kParamDtype) {
    TORCH_CHECK(a.scalar_type() == p.scalar_type() && a.numel() == t.numel && a.is_contiguous(),
                "qconf fused_step: the Kahan buffer of parameter ", i, " must be a contiguous ", p.scalar_type(),
                " tensor of ", t.numel, " elements");
    cx.check_device(a, i);
    cs.values16 = static_cast<uint16_t*>(a.data_ptr());
  } else if (cs.kind == kQuant) {
    const at::Tensor& b = cx.state(i, kSlotCompScales);
    describe_quant(cx, cm, a, b, t, i, "Kahan buffer", 0, cs);
    TORCH_CHECK(cs.codec.scale_kind == kBlock, "qconf fused_step: the Kahan buffer of parameter ", i,
                " must use group scales");
    cx.check_device(a, i);
    cx.check_device(b, i);
    cs.key = cx.key(m, step, 3);
    return lcm64(64, cs.codec.block);
  }
  return 64;
}

// The tile length and the single-pass / two-pass decision of each state. Single-pass blocks stay
// within one tile (`unit`: their common multiple with `base_unit`, the Kahan buffer's); if that
// is too large, the larger block goes through the two-pass path instead. A multi-tile tensor's
// tiles are `tile_target` elements rounded up to a multiple of the unit, and never longer than
// the tensor (the unit, 64 * 16383 elements for a quantized Kahan buffer of blocks of 16383,
// would otherwise size every thread's tile buffers for elements that do not exist).
inline void choose_tiling(TensorDesc& t, int64_t unit, int64_t base_unit, int64_t tile_target) {
  if (unit > kMaxUnit && t.numel > kMaxUnit) {
    unit = base_unit;
    StateDesc* big = t.st[0].kind == kQuant && !t.st[0].two_pass ? &t.st[0] : nullptr;
    StateDesc* other = t.st[1].kind == kQuant && !t.st[1].two_pass ? &t.st[1] : nullptr;
    if (big && other && other->codec.block > big->codec.block) std::swap(big, other);
    if (big) big->two_pass = 1;
    if (other) unit = lcm64(unit, other->codec.block);
    if (unit > kMaxUnit && other) {
      other->two_pass = 1;
      unit = base_unit;
    }
  }
  if (t.numel <= kMaxUnit) {
    t.tile = t.numel;  // one tile holds the whole tensor: every block is inside it
    for (auto& st : t.st)
      if (st.kind == kQuant && st.codec.scale_kind == kBlock) st.two_pass = 0;
    t.comp.two_pass = 0;
  } else {
    t.tile = std::min(((tile_target + unit - 1) / unit) * unit, t.numel);
  }
  t.two_pass = (t.st[0].kind == kQuant && t.st[0].two_pass) || (t.st[1].kind == kQuant && t.st[1].two_pass);
}

// The factored second moment's row / column statistics of parameter i (Adam, ndim >= 2).
inline void describe_factored(const CallContext& cx, int64_t i, TensorDesc& t) {
  TORCH_CHECK(cx.rule == kRuleAdam && t.ndim >= 2 && t.st[1].kind == kNone,
              "qconf fused_step: a factored second moment needs Adam, ndim >= 2 and no dense exp_avg_sq");
  const at::Tensor& row = cx.state(i, kSlotRow);
  const at::Tensor& col = cx.state(i, kSlotCol);
  // rows = prod(shape[:-1]), batches = prod(shape[:-2]) from the shape itself: a zero-size
  // parameter (e.g. [5, 0]) still has shape[:-1]-sized row statistics
  t.cols = t.shape[t.ndim - 1];
  int64_t batches = 1;
  for (int64_t d = 0; d + 2 < t.ndim; ++d) batches *= t.shape[d];
  t.rows = batches * t.shape[t.ndim - 2];
  TORCH_CHECK(row.scalar_type() == at::kFloat && row.numel() == t.rows && row.is_contiguous() &&
                  col.scalar_type() == at::kFloat && col.numel() == batches * t.cols && col.is_contiguous(),
              "qconf fused_step: factored statistics of parameter ", i, " have the wrong size or dtype");
  cx.check_device(row, i);
  cx.check_device(col, i);
  t.row = row.data_ptr<float>();
  t.col = col.data_ptr<float>();
  // fixed row chunking of the factor pass, the same for both drivers and every thread count: the
  // column sums add the chunks' partial sums in chunk order
  t.rows_per_chunk = (t.rows + kFactorChunks - 1) / kFactorChunks;
}

// Row chunks of a factored tensor's factor pass (numel > 0).
inline int64_t factor_chunks(const TensorDesc& t) { return (t.rows + t.rows_per_chunk - 1) / t.rows_per_chunk; }

// Starts loading the metadata of parameter j's tensors (see prefetch_meta).
inline void prefetch_param(const CallContext& cx, at::TensorList params, at::TensorList grads, at::TensorList steps,
                           int64_t j, bool deep) {
  if (j >= static_cast<int64_t>(params.size())) return;
  prefetch_meta(params[j], deep);
  prefetch_meta(grads[j], deep);
  prefetch_meta(steps[j], deep);
  for (int s = 0; s < kSlotLen; ++s) prefetch_meta(cx.state(j, s), deep);
}

// Builds one TensorDesc per parameter from `meta` (and increments every step counter unless
// `advance_steps` is false: the descriptions then hold the next step all the same). `tab` is
// the address of `tables`' data as the kernels will read it (host or device memory), `ntab` the
// number of tables. Parameters, gradients and states must be on `device`; `where` names the
// driver in messages ("CPU", "CUDA"); `out.tile_target`, the driver's tile length, is read.
// Scratch pointers (partial, new_recip, row_sum, ...) are left for the driver to set.
inline void describe_tensors(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                             at::TensorList states, const at::Tensor& meta, const float* tab, int64_t ntab,
                             c10::ArrayRef<double> hyper, int64_t seed, const at::Device& device,
                             const char* where, CallDescs& out, bool advance_steps = true) {
  const int64_t T = static_cast<int64_t>(params.size());
  TORCH_CHECK(meta.device().is_cpu(), "qconf fused_step: meta must be a CPU tensor");
  const int64_t* M = meta.data_ptr<int64_t>();
  const CallContext cx(rule, states, tab, ntab, seed, device, where);
  out.descs.assign(T, TensorDesc{});
  out.grad_storage.assign(T, at::Tensor());
  out.max_tile = 64;
  out.any_factored = false;
  ScalarsCache scalars;
  for (int64_t j = 0; j < 4; ++j) prefetch_param(cx, params, grads, steps, j, false);
  for (int64_t i = 0; i < T; ++i) {
    prefetch_param(cx, params, grads, steps, i + 4, false);
    prefetch_param(cx, params, grads, steps, i + 2, true);
    const int64_t* m = M + i * kMetaCols;
    TensorDesc& t = out.descs[i];
    describe_param(cx, i, params[i], grads[i], m, out.grad_storage[i], t);
    const double step = advance_step(steps[i], i, advance_steps);
    t.index = static_cast<uint64_t>(m[kMetaIndex]);
    t.step = static_cast<uint64_t>(step);
    t.h = scalars.get(rule, hyper, step, m[kMetaFirst] != 0);
    t.factored = static_cast<int32_t>(m[kMetaFactored]);
    const int64_t unit = describe_states(cx, i, m, step, t);
    const int64_t base_unit = describe_weights(cx, i, params[i], m, step, t);
    choose_tiling(t, lcm64(unit, base_unit), base_unit, out.tile_target);
    if (t.factored) {
      describe_factored(cx, i, t);
      out.any_factored = true;
      out.max_tile = std::max(out.max_tile, t.cols);
    }
    out.max_tile = std::max(out.max_tile, t.tile);
  }
}

}  // namespace host

struct CpuWorkspace {
  host::CallDescs call;
  std::vector<float> scratch_f;
  std::vector<uint32_t> scratch_u;
  std::vector<WorkItem> factor_items, single_items, batch_items;
  std::vector<int64_t> batch;
  // the split step (fused_step_cpu_reduce / _apply): `call` and the scratch hold a step whose
  // reduce pass has run, until apply() completes it (or a plain step replaces it)
  bool pending = false;
  int64_t pending_rule = 0;
  int64_t pending_maxima = 0;  // numel of the maxima apply() takes
};

}  // namespace qconf
