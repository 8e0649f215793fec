// What the CUDA entry points (csrc/cuda/cuda_step.cu) call in the other CUDA files: the generic
// kernel's step (step.cu) and the specialized kernels compiled ahead of time (spec_aot.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <vector>

#include "qconf/spec_key.h"
#include "qconf/step_types.h"

namespace qconf {

// One step of the generic kernel for `descs` (any codec), described against `tab`: the codec
// tables' address, host (`tables` on the CPU: copied to the device per call) or device.
void run_generic(int64_t rule, const std::vector<TensorDesc>& descs, const at::Tensor& tables, const float* tab,
                 const at::Device& device, cudaStream_t stream);

// The kernels of a spec compiled ahead of time (spec_aot.cu), or nulls if it is not one of them.
struct AotKernels {
  const void* apply = nullptr;
  const void* reduce = nullptr;
};
AotKernels aot_kernels(const spec::SpecKey& key);

}  // namespace qconf
