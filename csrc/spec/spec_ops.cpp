// Ops that show the specialized CUDA step to tools and tests, in every build (no GPU needed):
//
//   cuda_kernels() -> str    which kernels the CUDA step runs (QCONF_CUDA_KERNELS: generic or
//                            specialized; qconf/step_driver.h)
//   cuda_specs(rule, params, grads, steps, states, meta, tables, hyper, seed) -> str[]
//       per parameter, the name of the spec whose kernel the specialized CUDA step would run
//       (qconf/spec_key.h), or "generic: <reason>" for one the generic kernel takes; the step
//       counters are not advanced
//   cuda_kernel_headers() -> (str[] names, str[] texts)    the kernel headers as NVRTC reads them
//   cuda_spec_source(str name) -> str                      the NVRTC program of a spec
//   cuda_compile(str name, int arch, str cache_dir, str nvrtc_library, str[] options)
//       -> (Tensor cubin, str log, bool cache_hit, str path)
//       the spec compiled exactly as the CUDA driver compiles it at first use (spec_source.h),
//       with NVRTC loaded from `nvrtc_library` and `options` added (e.g. --ptxas-options=-v)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "qconf/spec_key.h"
#include "qconf/spec_plan.h"
#include "qconf/spec_source.h"
#include "qconf/step_driver.h"
#include "qconf/step_host.h"

namespace {

using namespace qconf;

std::vector<std::string> cuda_specs(int64_t rule, at::TensorList params, at::TensorList grads, at::TensorList steps,
                                    at::TensorList states, const at::Tensor& meta, const at::Tensor& tables,
                                    c10::ArrayRef<double> hyper, int64_t seed) {
  host::check_call(rule, params, grads, steps, states, meta, tables, hyper);
  if (params.empty()) return {};
  // the codecs' shortcuts (grid, octave lines) are read from the tables on the host
  const at::Tensor host_tables = tables.cpu().contiguous();
  host::CallDescs call;
  host::describe_tensors(rule, params, grads, steps, states, meta, host_tables.data_ptr<float>(), host_tables.size(0),
                         hyper, seed, params[0].device(), "CUDA", call, /*advance_steps=*/false);
  std::vector<std::string> out;
  for (const TensorDesc& t : call.descs) {
    spec::SpecKey key;
    std::string why = spec::spec_key(static_cast<int32_t>(rule), t, key);
    if (why.empty()) why = spec::buffers_unaligned(t);
    out.push_back(why.empty() ? spec::spec_name(key) : "generic: " + why);
  }
  return out;
}

spec::SpecKey parse_checked(const std::string& name) {
  spec::SpecKey key;
  TORCH_CHECK(spec::parse_spec(name, key), "qconf: '", name,
              "' is not a spec name (see csrc/include/qconf/spec_key.h, e.g. "
              "'adam.wd-f32.f32-plain-q4.g128.search-q4.r1.grid-none')");
  const std::string why = spec::spec_invalid(key);
  TORCH_CHECK(why.empty(), "qconf: spec '", name, "' is not one the kernels take: ", why);
  return key;
}

std::tuple<std::vector<std::string>, std::vector<std::string>> cuda_kernel_headers() {
  std::vector<std::string> names, texts;
  for (const auto& h : spec::kernel_headers()) {
    names.push_back(h.first);
    texts.push_back(h.second);
  }
  return {names, texts};
}

std::string cuda_spec_source(const std::string& name) { return spec::spec_program(parse_checked(name)).text; }

std::tuple<at::Tensor, std::string, bool, std::string> cuda_compile(const std::string& name, int64_t arch,
                                                                    const std::string& cache_dir,
                                                                    const std::string& nvrtc_library,
                                                                    std::vector<std::string> options) {
  const spec::SpecKey key = parse_checked(name);
  TORCH_CHECK(arch > 0 && arch < 1000, "qconf cuda_compile: arch must be a compute capability like 90, got ", arch);
  jit::Compiled out;
  try {
    out = spec::compile_spec(jit::load_nvrtc(nvrtc_library), key, static_cast<int>(arch), cache_dir, options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "qconf cuda_compile of ", name, ": ", e.what());
  }
  at::Tensor cubin = at::empty({static_cast<int64_t>(out.cubin.size())}, at::kByte);
  std::memcpy(cubin.data_ptr(), out.cubin.data(), out.cubin.size());
  return {cubin, out.log, out.cache_hit, out.path};
}

}  // namespace

namespace qconf {

std::string cuda_kernels_mode() {
  const char* v = std::getenv("QCONF_CUDA_KERNELS");
  const std::string mode = v == nullptr ? "" : v;
  if (mode.empty() || mode == "generic") return "generic";
  TORCH_CHECK(mode == "specialized", "QCONF_CUDA_KERNELS='", mode,
              "' is not a CUDA kernel choice; use 'generic' (the default) or 'specialized'");
  return mode;
}

}  // namespace qconf

TORCH_LIBRARY_FRAGMENT(qconf, m) {
  m.def("cuda_kernels() -> str", &qconf::cuda_kernels_mode);
  m.def("cuda_specs(int rule, Tensor[] params, Tensor[] grads, Tensor[] steps, Tensor[] states, Tensor meta, "
        "Tensor tables, float[] hyper, int seed) -> str[]",
        &cuda_specs);
  m.def("cuda_kernel_headers() -> (str[], str[])", &cuda_kernel_headers);
  m.def("cuda_spec_source(str name) -> str", &cuda_spec_source);
  m.def("cuda_compile(str name, int arch, str cache_dir, str nvrtc_library, str[] options) -> "
        "(Tensor cubin, str log, bool cache_hit, str path)",
        &cuda_compile);
}
