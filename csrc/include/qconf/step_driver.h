// Entry points of the fused optimizer step (CPU driver in csrc/cpu/step.cpp, CUDA in
// csrc/cuda/step.cu). Their `meta` / `states` / `tables` / `hyper` arguments, which
// qconf/optim/fused.py builds, are laid out as qconf/layout.h says.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <tuple>

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

// The same CPU step in two calls, for a caller that combines the new scales' maxima across ranks
// in between (FSDP: a state's scales belong to the global parameter).
//   reduce: everything up to the reduce pass, over every tensor at once, with `grads` as given;
//           nothing is written (parameters, states, scales, steps). Returns (maxima, offsets):
//           maxima, float32 [M]: per two-pass quantized state (tensors in order, then state 0,
//           state 1) its num_scales absmax values, each the max |x| over the finite new values of
//           that scale's elements, before the FLT_MIN floor; offsets, int64 [T, 3]: where tensor
//           i's state 0 / state 1 / Kahan buffer start in maxima, -1 for states that are not
//           two-pass quantized (single-pass, fp32, absent, or an empty tensor's). Factored second
//           moments are refused.
//   apply:  completes that step with `maxima` (the same layout; finite and >= 0): each scale
//           becomes scale_from_absmax_bits(maxima) (FLT_MIN floor, element.h), then the apply
//           pass, the new scales stored and the steps incremented. Unchanged maxima give exactly
//           the plain step. The tensors (and `ws`) must stay as they are in between.
std::tuple<at::Tensor, at::Tensor> fused_step_cpu_reduce(CpuWorkspace& ws, int64_t rule, at::TensorList params,
                                                         at::TensorList grads, at::TensorList steps,
                                                         at::TensorList states, const at::Tensor& meta,
                                                         const at::Tensor& tables, c10::ArrayRef<double> hyper,
                                                         int64_t seed);
void fused_step_cpu_apply(CpuWorkspace& ws, at::TensorList steps, const at::Tensor& maxima);

// Which kernels the CUDA step runs, from the environment variable QCONF_CUDA_KERNELS: "generic"
// (the default: the kernel a GPU has verified) or "specialized" (the specialized kernels of
// qconf/spec.h where a spec exists, the generic kernel for the rest). Any other value is an error
// naming the two. (In every build: the Python side asks it through torch.ops.qconf.cuda_kernels.)
std::string cuda_kernels_mode();

#ifdef QCONF_WITH_CUDA
// The same step for parameters, gradients and states on one CUDA device (csrc/cuda/cuda_step.cu);
// `steps` and `meta` stay on the CPU, `tables` may be on the CPU or on that device.
void fused_step_cuda(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                     at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                     c10::ArrayRef<double> hyper, int64_t seed);

// The CUDA step's host state kept between steps (the specialized kernels' plan, run-time
// compiled modules, scratch): a StepPlan keeps one.
struct CudaWorkspace;
std::shared_ptr<CudaWorkspace> make_cuda_workspace();
void fused_step_cuda_reusing(CudaWorkspace& ws, int64_t rule, at::TensorList params, at::TensorList grads,
                             at::TensorList steps, at::TensorList states, const at::Tensor& meta,
                             const at::Tensor& tables, c10::ArrayRef<double> hyper, int64_t seed);

// The split step on CUDA (as fused_step_cpu_reduce / _apply): specialized kernels only, so
// QCONF_CUDA_KERNELS=specialized, CPU tables and every parameter of a specialized spec (else an
// error naming why). The maxima are a float32 tensor on the device (rank-1 states only: the other
// states of specialized kernels are single-pass), in the CPU step's order; apply() checks them
// with one synchronization.
std::tuple<at::Tensor, at::Tensor> fused_step_cuda_reduce(CudaWorkspace& ws, int64_t rule, at::TensorList params,
                                                          at::TensorList grads, at::TensorList steps,
                                                          at::TensorList states, const at::Tensor& meta,
                                                          const at::Tensor& tables, c10::ArrayRef<double> hyper,
                                                          int64_t seed);
void fused_step_cuda_apply(CudaWorkspace& ws, at::TensorList steps, const at::Tensor& maxima);
#endif

}  // namespace qconf
