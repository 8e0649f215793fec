// The run-time compiled form of a specialized CUDA kernel (spec.h): a spec's program for NVRTC
// (the kernel headers, embedded in the extension by setup.py, and two lines naming the spec) and
// its compilation through the on-disk cache (nvrtc_cache.h), with the one set of options both the
// CUDA driver and the tools (torch.ops.qconf.cuda_compile, benchmarks/cuda_static.py) use.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "qconf/nvrtc_cache.h"
#include "qconf/spec_key.h"

namespace qconf {
namespace spec {

// The headers the kernels include, as (include name, text).
const std::vector<std::pair<std::string, std::string>>& kernel_headers();

// The NVRTC program of spec `key`: entry points qconf_spec_apply and qconf_spec_reduce.
jit::Source spec_program(const SpecKey& key);

// The options every spec is compiled with (the nvcc flags of setup.py's ahead-of-time kernels:
// no contraction, C++17), before `extra` (e.g. --ptxas-options=-v for the tools).
std::vector<std::string> spec_options(const std::vector<std::string>& extra = {});

// The NVRTC library the run-time compilation loads: $QCONF_NVRTC_LIBRARY if set, else the one the
// installed torch came with (the nvidia-cuda-nvrtc wheel beside it: nvidia/cu13/lib/libnvrtc.so.13,
// nvidia/cuda_nvrtc/lib/libnvrtc.so.12), else the loader's libnvrtc.so.13 / .12 / libnvrtc.so.
std::string nvrtc_library();

// Compiles spec `key` for sm_<arch> through the cache in `dir` ("" = none).
jit::Compiled compile_spec(const jit::NvrtcApi& api, const SpecKey& key, int arch, const std::string& dir,
                           const std::vector<std::string>& extra = {});

}  // namespace spec
}  // namespace qconf
