// Entry points of the fused optimizer step (CPU driver in csrc/cpu/step.cpp, CUDA in
// csrc/cuda/step.cu). Their `meta` / `states` / `tables` / `hyper` arguments, which
// qconf/optim/fused.py builds, are laid out as qconf/layout.h says.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "qconf/layout.h"

namespace qconf {

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
