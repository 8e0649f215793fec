// Entry points of the fused optimizer step (CPU driver in csrc/cpu/step.cpp, CUDA in
// csrc/cuda/step.cu) and the layout of their `meta` / `tables` / `hyper` arguments, which
// qconf/ops/__init__.py builds.
#pragma once

#include <ATen/ATen.h>

#include <memory>

namespace qconf {

// meta: int64 [T, kMetaCols], one row per parameter
constexpr int kColIndex = 0;     // parameter index in the optimizer (RNG stream)
constexpr int kColFirst = 1;     // 1 on the first step of a lazily created state (SGD buffer = grad)
constexpr int kColFactored = 2;  // 1: factored second moment (row/col statistics in state slots 4, 5)
constexpr int kColNdim = 3;
constexpr int kColShape = 4;     // 8 dims
constexpr int kColState = 12;    // per state k: kColState + k * kStateCols + ...
constexpr int kStateCols = 9;    // kind, table, bits, levels, scale_kind, block, d1, inner, stochastic
// how the new values reach a bf16/fp16 parameter: bit 0 stochastic rounding, bit 1 Kahan
constexpr int kColWeights = kColState + 2 * kStateCols;
constexpr int kColComp = kColWeights + 1;  // the Kahan buffer: kParamDtype, or kQuant (block scales)
constexpr int kMetaCols = kColComp + kStateCols;
// states: kStateSlots tensors per parameter: s0 (values|codes), s0 scales, s1, s1 scales, row, col,
// Kahan buffer (values|codes), its scales
constexpr int kStateSlots = 8;
// tables: float32 [N, kTableRows, 256]: qmap, midpoints(+inf), qmap(+inf), coarse16 (16 mids,
// 16 qmap, midpoint grid, shifted 16-entry search tables), coarse32 (32 mids, 32 qmap, their
// shifted copies), mids columns (7 x 32), qmap columns (7 x 32), octave lines (8-bit maps), the
// qmap and midpoints as 16-bit and as byte planes; see qconf/ops/step.py codec_table
constexpr int kTableRows = 12;
// hyper: lr, beta1, beta2, eps, weight_decay, momentum, dampening, maximize, nesterov, decoupled
constexpr size_t kHyperLen = 10;

void fused_step_cpu(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                    at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                    c10::ArrayRef<double> hyper, int64_t seed);

// Host-side buffers of the CPU driver (descriptors, work lists, two-pass and factored scratch).
// A StepPlan keeps one between steps, so a step with 1000s of tensors allocates nothing new.
struct CpuWorkspace;
std::shared_ptr<CpuWorkspace> make_cpu_workspace();
void fused_step_cpu_reusing(CpuWorkspace& ws, int64_t rule, at::TensorList params, at::TensorList grads,
                    at::TensorList steps, at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                    c10::ArrayRef<double> hyper, int64_t seed);

#ifdef QCONF_WITH_CUDA
// The same step for parameters, gradients and states on one CUDA device (csrc/cuda/step.cu);
// `steps` and `meta` stay on the CPU, `tables` may be on the CPU or on that device.
void fused_step_cuda(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                     at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                     c10::ArrayRef<double> hyper, int64_t seed);
#endif

}  // namespace qconf
