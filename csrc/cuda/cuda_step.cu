// The fused optimizer step on CUDA: the entry points (the op, StepPlan.run / reduce / apply) and
// the specialized driver.
//
// Every call checks all its arguments' devices first (nothing is read or written before), then
// describes the tensors with the CPU driver's code (qconf/step_host.h). With
// QCONF_CUDA_KERNELS=specialized, the tensors a specialized kernel takes (qconf/spec_key.h) run
// there -- kernels compiled ahead of time (spec_aot.cu) or at first use with NVRTC through the
// on-disk cache (qconf/spec_source.h; loaded and launched through the CUDA runtime's library API,
// like the ahead-of-time ones), a plan built once per parameter set and kept in the
// CudaWorkspace (qconf/spec_plan.h; a later step only refreshes its gradients and scalars: no
// planning, no upload, no synchronization) -- and the rest on the generic kernel (step.cu).
// Otherwise everything runs on the generic kernel, which a GPU has verified.
//
// Specialized launches of a plan, on the current stream: the rank-1 partial maxima zeroed; per
// launch, for a spec with a rank-1 state its reduce pass and the finalize of its scales, then its
// apply pass; the new rank-1 scales copied over the stored ones at the end.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/isfinite.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_driver.h"
#include "qconf/spec_plan.h"
#include "qconf/spec_source.h"
#include "qconf/step_driver.h"
#include "qconf/step_host.h"

namespace qconf {
namespace {

using spec::Launch;
using spec::SpecPlan;

// ---------------------------------------------------------------------------------------------
// spec-independent kernels: finalize the rank-1 scales, copy them over the stored ones

// Entries [first, first + n) of the rank-1 scratch: the new scale and its reciprocal from the
// absmax bits (element.h), one range per blockIdx.y.
__global__ void __launch_bounds__(256) finalize_ranges(const uint32_t* __restrict__ partial, float* __restrict__ recip,
                                                      float* __restrict__ scale,
                                                      const spec::Rank1Range* __restrict__ ranges) {
  const spec::Rank1Range r = ranges[blockIdx.y];
  for (int64_t j = r.first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < r.first + r.n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    finalize_scale_bits(partial[j], j, recip, scale);
}

// One copy per block: the new scales of a rank-1 state (from `scales`) over its stored ones.
__global__ void __launch_bounds__(256) copy_scales(const spec::ScaleCopy* __restrict__ copies,
                                                  const float* __restrict__ scales) {
  const spec::ScaleCopy c = copies[blockIdx.x];
  for (int64_t j = threadIdx.x; j < c.n; j += blockDim.x) c.dst[j] = scales[c.src + j];
}

// ---------------------------------------------------------------------------------------------
// kernels of a spec: ahead of time, or compiled at first use

// What a plan needs of its device.
struct DeviceFacts {
  int arch = 0;          // compute capability, e.g. 90
  int sms = 1;           // multiprocessors
  int64_t l2_bytes = 0;  // L2 cache
};

DeviceFacts device_facts(const at::Device& device) {
  DeviceFacts f;
  int major = 0, minor = 0, l2 = 0;
  const int d = device.index();
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, d));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, d));
  f.arch = major * 10 + minor;
  f.l2_bytes = l2;
  return f;
}

// The kernels one launch runs (ahead of time, or from a module compiled at run time: both are
// launched with cudaLaunchKernel), and how many of its blocks fit a multiprocessor.
struct LaunchKernels {
  const void* apply = nullptr;
  const void* reduce = nullptr;
  int blocks_per_sm = 1;
};

// A module compiled at run time (a CUDA library of the runtime's library API, CUDA 12+).
struct JitModule {
  std::string name;
#if CUDART_VERSION >= 12000
  cudaLibrary_t library = nullptr;
  cudaKernel_t apply = nullptr, reduce = nullptr;
#endif
};

}  // namespace}  // namespace

// Host-side state of the CUDA step kept by a StepPlan between steps (step_driver.h).
struct CudaWorkspace {
  host::CallDescs call;
  int64_t rule = 0;
  std::vector<uint64_t> signature;  // of the descriptions the plan was made for (spec_plan.h)
  SpecPlan plan;
  std::vector<LaunchKernels> kernels;  // per launch
  std::vector<int32_t> grids;          // blocks per launch (a persistent grid)
  at::Tensor scratch;                  // device: the rank-1 scratch
  at::Tensor aux;                      // device: every launch's rank-1 ranges, then the scale copies
  std::vector<int64_t> range_at;       // per launch: its first range in aux
  at::Tensor dev_tables;               // device copy of the codec tables
  const void* tables_src = nullptr;    // ... of this host tensor data, at this version
  uint32_t tables_version = 0;
  std::vector<JitModule> modules;
  std::vector<spec::SpecKey> failed;   // specs whose run-time compilation failed: generic
  std::unique_ptr<jit::NvrtcApi> nvrtc;  // loaded at the first run-time compilation
  std::vector<at::Tensor> grad_copies; // this call's aligned copies of misaligned gradients
  bool pending = false;                // a split step's reduce() has run, apply() has not
  int64_t pending_rule = 0;
  ~CudaWorkspace() {
#if CUDART_VERSION >= 12000
    for (JitModule& m : modules)
      if (m.library != nullptr) cudaLibraryUnload(m.library);  // an error at exit is of no use
#endif
  }
};

namespace {

// A spec compiled with NVRTC through the on-disk cache for `arch`, loaded as a library: the
// module, or an exception saying why not.
JitModule load_spec(CudaWorkspace& ws, const spec::SpecKey& key, int arch) {
#if CUDART_VERSION >= 12000
  if (!ws.nvrtc) ws.nvrtc = std::make_unique<jit::NvrtcApi>(jit::load_nvrtc(spec::nvrtc_library()));
  const jit::Compiled c = spec::compile_spec(*ws.nvrtc, key, arch, jit::default_cache_dir());
  JitModule m{spec::spec_name(key)};
  C10_CUDA_CHECK(cudaLibraryLoadData(&m.library, c.cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
  C10_CUDA_CHECK(cudaLibraryGetKernel(&m.apply, m.library, "qconf_spec_apply"));
  C10_CUDA_CHECK(cudaLibraryGetKernel(&m.reduce, m.library, "qconf_spec_reduce"));
  return m;
#else
  (void)ws, (void)key, (void)arch;
  throw std::runtime_error("run-time compiled kernels need CUDA 12 or later");
#endif
}

// The kernels of `key`: ahead of time, or a module compiled at first use and kept by the workspace.
// False (with a warning, once per spec and workspace: the workspace then plans it generic) if it
// does not compile.
bool resolve_kernels(CudaWorkspace& ws, const spec::SpecKey& key, const DeviceFacts& dev, LaunchKernels& k) {
  const AotKernels aot = aot_kernels(key);
  k.apply = aot.apply;
  k.reduce = aot.reduce;
  if (k.apply == nullptr) {
    const std::string name = spec::spec_name(key);
    const JitModule* m = nullptr;
    for (const JitModule& x : ws.modules)
      if (x.name == name) m = &x;
    if (m == nullptr) {
      try {
        ws.modules.push_back(load_spec(ws, key, dev.arch));
      } catch (const std::exception& e) {
        TORCH_WARN("qconf: the specialized CUDA kernel ", name, " did not compile (", e.what(),
                        "); its tensors take the generic kernel");
        return false;
      }
      m = &ws.modules.back();
    }
#if CUDART_VERSION >= 12000
    k.apply = reinterpret_cast<const void*>(m->apply);
    k.reduce = reinterpret_cast<const void*>(m->reduce);
#endif
  }
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k.blocks_per_sm, k.apply, spec::kThreads, 0));
  return true;
}

// One launch of a kernel with the launch's parameters.
void launch(const void* kernel, int32_t grid, const spec::SpecArgs& args, cudaStream_t stream) {
  void* params[] = {const_cast<spec::SpecArgs*>(&args)};
  C10_CUDA_CHECK(cudaLaunchKernel(kernel, dim3(grid), dim3(spec::kThreads), params, 0, stream));
}

// The device copy of the codec tables, refreshed when the host tensor (or its content) changed.
void refresh_tables(CudaWorkspace& ws, const at::Tensor& tables, const at::Device& device) {
  const uint32_t version = tables.unsafeGetTensorImpl()->version_counter().current_version();
  if (ws.dev_tables.defined() && ws.tables_src == tables.data_ptr() && ws.tables_version == version &&
      ws.dev_tables.sizes() == tables.sizes())
    return;
  ws.dev_tables = tables.to(device, /*non_blocking=*/false, /*copy=*/true);
  ws.tables_src = tables.data_ptr();
  ws.tables_version = version;
}

// The plan's rank-1 ranges and scale copies on the device (one upload per plan).
void upload_aux(CudaWorkspace& ws, const at::Device& device) {
  std::vector<spec::Rank1Range> ranges;
  ws.range_at.clear();
  for (const Launch& L : ws.plan.launches) {
    ws.range_at.push_back(static_cast<int64_t>(ranges.size()));
    ranges.insert(ranges.end(), L.rank1.begin(), L.rank1.end());
  }
  const size_t rb = sizeof(spec::Rank1Range) * ranges.size(), cb = sizeof(spec::ScaleCopy) * ws.plan.copies.size();
  at::Tensor host = at::empty({static_cast<int64_t>(std::max<size_t>(rb + cb, 16))},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  if (rb > 0) std::memcpy(host.data_ptr<uint8_t>(), ranges.data(), rb);
  if (cb > 0) std::memcpy(host.data_ptr<uint8_t>() + rb, ws.plan.copies.data(), cb);
  ws.aux = at::empty(host.sizes(), at::TensorOptions().dtype(at::kByte).device(device));
  ws.aux.copy_(host, /*non_blocking=*/true);
}

}  // namespace
}  // namespace qconf

namespace qconf {
namespace {

// A plan of ws.call for the current device: the launches' kernels (a spec whose run-time
// compilation fails is planned again on the generic kernel), grids, scratch and aux buffer.
// (Copying the tables allocates on the device, which makes the context current for the driver
// API calls of run-time compiled modules.)
void build_plan(CudaWorkspace& ws, int64_t rule, const at::Tensor& tables, const at::Device& device) {
  refresh_tables(ws, tables, device);
  const DeviceFacts dev = device_facts(device);
  const float* tab_host = tables.data_ptr<float>();
  const float* tab_dev = ws.dev_tables.data_ptr<float>();
  for (;;) {
    ws.plan = spec::plan_specs(static_cast<int32_t>(rule), ws.call.descs, tab_host, tab_dev, dev.l2_bytes / 2,
                               ws.failed);
    ws.kernels.assign(ws.plan.launches.size(), LaunchKernels{});
    bool all = true;
    for (size_t l = 0; l < ws.plan.launches.size() && all; ++l) {
      if (resolve_kernels(ws, ws.plan.launches[l].key, dev, ws.kernels[l])) continue;
      ws.failed.push_back(ws.plan.launches[l].key);
      all = false;
    }
    if (all) break;
  }
  ws.grids.clear();
  for (size_t l = 0; l < ws.plan.launches.size(); ++l) {
    const int64_t resident = static_cast<int64_t>(std::max(ws.kernels[l].blocks_per_sm, 1)) * dev.sms;
    ws.grids.push_back(static_cast<int32_t>(std::min<int64_t>(ws.plan.launches[l].args.nunits, resident)));
  }
  ws.scratch = at::empty({std::max<int64_t>(ws.plan.scratch_floats(), 1)},
                         at::TensorOptions().dtype(at::kFloat).device(device));
  spec::assign_scratch(ws.plan, ws.scratch.data_ptr<float>());
  upload_aux(ws, device);
  ws.rule = rule;
  ws.signature = spec::plan_signature(static_cast<int32_t>(rule), ws.call.descs, tab_host);
}

// The plan for this call's descriptions: the workspace's, refreshed, while they are unchanged.
void plan_call(CudaWorkspace& ws, int64_t rule, const at::Tensor& tables, const at::Device& device, int64_t seed) {
  const bool same = ws.rule == rule && !ws.signature.empty() && ws.tables_src == tables.data_ptr() &&
                    ws.tables_version == tables.unsafeGetTensorImpl()->version_counter().current_version() &&
                    ws.signature == spec::plan_signature(static_cast<int32_t>(rule), ws.call.descs,
                                                         tables.data_ptr<float>());
  if (!same || !spec::refresh_plan(ws.plan, ws.call.descs, static_cast<uint64_t>(seed))) {
    build_plan(ws, rule, tables, device);
    spec::refresh_plan(ws.plan, ws.call.descs, static_cast<uint64_t>(seed));
  }
}

// A gradient the vector loads cannot read (not 16-byte aligned) is copied to one they can.
void align_grads(CudaWorkspace& ws) {
  ws.grad_copies.clear();
  for (Launch& L : ws.plan.launches)
    for (int32_t j = 0; j < L.args.ntensors; ++j) {
      if (spec::aligned16(L.args.t[j].grad)) continue;
      at::Tensor& g = ws.call.grad_storage[L.tensors[j]];
      ws.grad_copies.push_back(g.clone(at::MemoryFormat::Contiguous));
      L.args.t[j].grad = ws.grad_copies.back().data_ptr();
    }
}

const spec::Rank1Range* ranges_of(const CudaWorkspace& ws, size_t l) {
  return reinterpret_cast<const spec::Rank1Range*>(ws.aux.data_ptr<uint8_t>()) + ws.range_at[l];
}

// The finalize of launch l's rank-1 scales.
void finalize_launch(const CudaWorkspace& ws, size_t l, cudaStream_t stream) {
  const Launch& L = ws.plan.launches[l];
  if (L.rank1.empty()) return;
  int64_t widest = 1;
  for (const spec::Rank1Range& r : L.rank1) widest = std::max(widest, r.n);
  float* s = ws.scratch.data_ptr<float>();
  const int64_t M = ws.plan.rank1_entries;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((widest + 255) / 256, 1024)),
                  static_cast<unsigned>(L.rank1.size()));
  finalize_ranges<<<grid, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(s), s + M, s + 2 * M, ranges_of(ws, l));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_new_scales(const CudaWorkspace& ws, cudaStream_t stream) {
  if (ws.plan.copies.empty()) return;
  size_t nranges = 0;
  for (const Launch& L : ws.plan.launches) nranges += L.rank1.size();
  const auto* copies = reinterpret_cast<const spec::ScaleCopy*>(ws.aux.data_ptr<uint8_t>() +
                                                                sizeof(spec::Rank1Range) * nranges);
  copy_scales<<<static_cast<unsigned>(ws.plan.copies.size()), 256, 0, stream>>>(
      copies, ws.scratch.data_ptr<float>() + 2 * ws.plan.rank1_entries);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void zero_partials(const CudaWorkspace& ws, cudaStream_t stream) {
  if (ws.plan.rank1_entries > 0)
    C10_CUDA_CHECK(cudaMemsetAsync(ws.scratch.data_ptr<float>(), 0, sizeof(float) * ws.plan.rank1_entries, stream));
}

// The reduce pass of launch l (a spec with a rank-1 state).
void reduce_launch(const CudaWorkspace& ws, size_t l, cudaStream_t stream) {
  launch(ws.kernels[l].reduce, ws.grids[l], ws.plan.launches[l].args, stream);
}

void apply_launch(const CudaWorkspace& ws, size_t l, cudaStream_t stream) {
  launch(ws.kernels[l].apply, ws.grids[l], ws.plan.launches[l].args, stream);
}

// A whole step of the planned launches (see the top of the file).
void run_specialized(const CudaWorkspace& ws, cudaStream_t stream) {
  zero_partials(ws, stream);
  for (size_t l = 0; l < ws.plan.launches.size(); ++l) {
    if (ws.plan.launches[l].two_pass) {
      reduce_launch(ws, l, stream);
      finalize_launch(ws, l, stream);
    }
    apply_launch(ws, l, stream);
  }
  copy_new_scales(ws, stream);
}

// Refuses (before anything is written) a call whose generic-kernel tensors hold what that kernel
// does not implement: a quantized Kahan buffer, which only the specialized kernels take.
void check_generic_supported(const CudaWorkspace& ws, bool specialized) {
  const int32_t T = static_cast<int32_t>(ws.call.descs.size());
  for (int32_t i = 0; i < T; ++i) {
    if (ws.call.descs[i].comp.kind != kQuant || (specialized && ws.plan.reasons[i].empty())) continue;
    TORCH_CHECK(false, "qconf fused_step (CUDA): parameter ", i,
                " has a quantized Kahan buffer (weights.compensation_codec), which only the specialized CUDA kernels "
                "implement (QCONF_CUDA_KERNELS=specialized), ",
                specialized ? "and it has none (" + ws.plan.reasons[i] + ")" : std::string("which are off"),
                "; the buffer in the parameter's dtype (no compensation_codec) runs everywhere");
  }
}

// The descriptions of the tensors the generic kernel takes.
std::vector<TensorDesc> generic_descs(const CudaWorkspace& ws) {
  std::vector<TensorDesc> out;
  for (int32_t i : ws.plan.generic) out.push_back(ws.call.descs[i]);
  return out;
}

// Every tensor argument on `device` (steps and meta on the CPU, tables on either), checked before
// anything is read or written; a clear error otherwise.
void check_devices(at::TensorList params, at::TensorList grads, at::TensorList steps, at::TensorList states,
                   const at::Tensor& meta, const at::Tensor& tables, const at::Device& device) {
  const auto where = [&device](const at::Tensor& t) { return t.device() == device; };
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(where(params[i]), "qconf fused_step (CUDA): parameter ", i, " is on ", params[i].device(),
                ", not on the ", device);
    TORCH_CHECK(grads[i].defined() && where(grads[i]), "qconf fused_step (CUDA): gradient ", i, " is not on the ",
                device, (grads[i].defined() ? " (it is on " + grads[i].device().str() + ")" : std::string()));
    TORCH_CHECK(steps[i].device().is_cpu(), "qconf fused_step (CUDA): step ", i, " must be a CPU tensor");
  }
  for (size_t s = 0; s < states.size(); ++s)
    TORCH_CHECK(!states[s].defined() || states[s].numel() == 0 || where(states[s]),
                "qconf fused_step (CUDA): a state of parameter ", s / kSlotLen, " is on ", states[s].device(),
                ", not on the ", device);
  TORCH_CHECK(meta.device().is_cpu(), "qconf fused_step (CUDA): meta must be a CPU tensor");
  TORCH_CHECK(tables.is_cpu() || where(tables), "qconf fused_step (CUDA): tables must be on the CPU or on the ",
              device);
}

// The checks and descriptions every CUDA entry point starts with; the device of the call.
at::Device describe_cuda_call(CudaWorkspace& ws, int64_t rule, at::TensorList params, at::TensorList grads,
                              at::TensorList steps, at::TensorList states, const at::Tensor& meta,
                              const at::Tensor& tables, c10::ArrayRef<double> hyper, int64_t seed, bool advance) {
  TORCH_CHECK(params[0].is_cuda(), "qconf fused_step (CUDA): parameter 0 is not a CUDA tensor");
  const at::Device device = params[0].device();
  check_devices(params, grads, steps, states, meta, tables, device);
  host::describe_tensors(rule, params, grads, steps, states, meta, tables.data_ptr<float>(), tables.size(0), hyper,
                         seed, device, "CUDA", ws.call, advance);
  return device;
}

// Drops the call's gradients when it ends (the workspace outlives the call), unless `keep` (a split
// step holds them from reduce() to apply()).
struct ReleaseCall {
  CudaWorkspace& ws;
  bool keep = false;
  ~ReleaseCall() {
    if (keep) return;
    for (auto& g : ws.call.grad_storage) g.reset();
    ws.grad_copies.clear();
  }
};

}  // namespace

std::shared_ptr<CudaWorkspace> make_cuda_workspace() { return std::make_shared<CudaWorkspace>(); }

void fused_step_cuda(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                     at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                     c10::ArrayRef<double> hyper, int64_t seed) {
  CudaWorkspace ws;
  fused_step_cuda_reusing(ws, rule, params, grads, steps, states, meta, tables, hyper, seed);
}

void fused_step_cuda_reusing(CudaWorkspace& ws, int64_t rule, at::TensorList params, at::TensorList grads,
                             at::TensorList steps, at::TensorList states, const at::Tensor& meta,
                             const at::Tensor& tables, c10::ArrayRef<double> hyper, int64_t seed) {
  ws.pending = false;
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  if (params.empty()) return;
  TORCH_CHECK(params[0].is_cuda(), "qconf fused_step (CUDA): parameter 0 is not a CUDA tensor");
  c10::cuda::CUDAGuard guard(params[0].device());
  ReleaseCall release{ws};
  const at::Device device =
      describe_cuda_call(ws, rule, params, grads, steps, states, meta, tables, hyper, seed, /*advance=*/false);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // specialized kernels read the codecs' shortcuts from the tables on the host
  const bool specialized = cuda_kernels_mode() == "specialized" && tables.is_cpu();
  if (specialized) plan_call(ws, rule, tables, device, seed);
  check_generic_supported(ws, specialized);
  // nothing has changed yet; from here on the step runs
  for (size_t i = 0; i < steps.size(); ++i) host::advance_step(steps[i], static_cast<int64_t>(i));
  if (!specialized) {
    run_generic(rule, ws.call.descs, tables, tables.data_ptr<float>(), device, stream);
    return;
  }
  align_grads(ws);
  run_specialized(ws, stream);
  run_generic(rule, generic_descs(ws), tables, tables.data_ptr<float>(), device, stream);
}

std::tuple<at::Tensor, at::Tensor> fused_step_cuda_reduce(CudaWorkspace& ws, int64_t rule, at::TensorList params,
                                                          at::TensorList grads, at::TensorList steps,
                                                          at::TensorList states, const at::Tensor& meta,
                                                          const at::Tensor& tables, c10::ArrayRef<double> hyper,
                                                          int64_t seed) {
  ws.pending = false;
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  TORCH_CHECK(!params.empty(), "qconf StepPlan.reduce: no parameters");
  TORCH_CHECK(cuda_kernels_mode() == "specialized" && tables.is_cpu(),
              "qconf StepPlan.reduce on CUDA needs the specialized kernels (QCONF_CUDA_KERNELS=specialized) and the "
              "codec tables on the CPU");
  TORCH_CHECK(params[0].is_cuda(), "qconf fused_step (CUDA): parameter 0 is not a CUDA tensor");
  c10::cuda::CUDAGuard guard(params[0].device());
  ReleaseCall release{ws};
  const at::Device device =
      describe_cuda_call(ws, rule, params, grads, steps, states, meta, tables, hyper, seed, /*advance=*/false);
  plan_call(ws, rule, tables, device, seed);
  for (size_t g = 0; g < ws.plan.generic.size(); ++g) {
    const int32_t i = ws.plan.generic[g];
    TORCH_CHECK(ws.call.descs[i].numel == 0, "qconf StepPlan.reduce on CUDA: parameter ", i,
                " has no specialized kernel (", ws.plan.reasons[i], "); the split step runs only specialized kernels");
  }
  align_grads(ws);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  zero_partials(ws, stream);
  for (size_t l = 0; l < ws.plan.launches.size(); ++l)
    if (ws.plan.launches[l].two_pass) reduce_launch(ws, l, stream);
  const int64_t T = static_cast<int64_t>(params.size());
  at::Tensor offsets = at::full({T, 3}, -1, at::kLong);
  for (int64_t i = 0; i < T; ++i)
    for (int k = 0; k < 2; ++k) offsets[i][k] = ws.plan.rank1_offset[2 * i + k];
  ws.pending = true;
  ws.pending_rule = rule;
  release.keep = true;
  // the partials themselves, as floats: absmax values are finite and >= 0, so their bits order
  return {ws.scratch.narrow(0, 0, ws.plan.rank1_entries), offsets};
}

void fused_step_cuda_apply(CudaWorkspace& ws, at::TensorList steps, const at::Tensor& maxima) {
  TORCH_CHECK(ws.pending, "qconf StepPlan.apply: no pending reduce() (apply() completes the step that the last "
              "reduce() of this plan started, once)");
  const int64_t M = ws.plan.rank1_entries;
  const at::Device device = ws.scratch.device();
  TORCH_CHECK(maxima.scalar_type() == at::kFloat && maxima.device() == device && maxima.dim() == 1 &&
                  maxima.numel() == M,
              "qconf StepPlan.apply: maxima must be a 1-D float32 tensor of ", M, " elements on ", device,
              " (as reduce() returned it), got ", maxima.scalar_type(), " of shape ", maxima.sizes(), " on ",
              maxima.device());
  c10::cuda::CUDAGuard guard(device);
  // finite and >= +0, as the CPU step requires (one synchronization: the split step's maxima come
  // from an all-reduce between the halves anyway)
  TORCH_CHECK(M == 0 || (at::isfinite(maxima) & ~maxima.signbit()).all().item<bool>(),
              "qconf StepPlan.apply: maxima must be finite and >= +0");
  ReleaseCall release{ws};
  ws.pending = false;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  at::Tensor partials = ws.scratch.narrow(0, 0, M);
  if (M > 0 && maxima.data_ptr() != partials.data_ptr()) partials.copy_(maxima);
  for (size_t l = 0; l < ws.plan.launches.size(); ++l) finalize_launch(ws, l, stream);
  for (size_t l = 0; l < ws.plan.launches.size(); ++l) apply_launch(ws, l, stream);
  copy_new_scales(ws, stream);
  for (size_t i = 0; i < steps.size(); ++i) host::advance_step(steps[i], static_cast<int64_t>(i));
}

}  // namespace qconf
